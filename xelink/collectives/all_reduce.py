"""All-reduce: ring, direct (one-shot), two-shot and hierarchical.

Every algorithm reduces half types in float32 and produces bit-identical results on every rank
(each rank combines the same values in the same order).
"""
from __future__ import annotations

import torch

from ..transport import shm
from . import _groups
from . import gpu
from ._common import (bounds, check_algo, check_op_dtype, combine, finish, fingerprint_check, group_of,
                      is_cuda, parse_op, as_tensor, run, step, tag_for, work_dtype)

__all__ = ["all_reduce", "ALGOS"]

ALGOS = ("ring", "direct", "two_shot", "hierarchical")


def all_reduce(tensor, op="sum", group=None, async_op: bool = False, algo: str = "auto", timeout=None):
    """Reduce ``tensor`` over every rank of ``group``, in place (torch.distributed.all_reduce).

    Args:
        tensor: torch CPU or CUDA tensor or numpy array, any shape, contiguous; float64/32/16,
            bfloat16, int32 or int64 (half types are reduced in float32). CUDA tensors take the GPU
            path (``collectives/gpu.py``: its algorithms, NCCL's stream semantics).
        op: "sum", "avg" (floating dtypes), "max", "min", "prod", or a torch ``ReduceOp``.
        group: xelink communicator (None: the world).
        async_op: return a ``Work`` handle instead of waiting.
        algo: "auto" or one of ``ALGOS``.
        timeout: deadline in seconds (default: the group's); expiry raises ``xelink.TimeoutError``.

    Returns:
        None, or a ``Work`` when ``async_op``.

    Collective: every rank of ``group`` must call this with the same shape, dtype, op and algo.
    """
    fn = "all_reduce"
    if torch.compiler.is_compiling():
        from . import compiled

        compiled.traced(fn, async_op)
        return torch.ops.xelink.all_reduce_(tensor, parse_op(fn, op), algo, compiled.group_name(group))
    comm = group_of(group, fn)
    if is_cuda(tensor):
        return gpu.all_reduce(comm, tensor, parse_op(fn, op), algo, async_op, timeout)
    x = as_tensor(fn, "tensor", tensor, reduce=True)
    op = parse_op(fn, op)
    check_op_dtype(fn, op, x.dtype)
    check_algo(fn, algo, ALGOS)
    fingerprint_check(comm, fn, (fn, tuple(x.shape), str(x.dtype), op, algo))
    if comm.size == 1:
        return run(comm, fn, lambda deadline: None, async_op, timeout)
    if algo == "auto":
        from .dispatch import choose

        algo = choose(comm, fn, x.numel() * x.element_size(), x.dtype)
    flat = x.view(-1)
    return run(comm, fn, lambda deadline: _ALGOS[algo](comm, flat, op, deadline), async_op, timeout)


def _ring(comm, x, op, deadline):
    """Reduce-scatter around the ring, then all-gather around it: 2(n-1) steps, 2(n-1)/n of the data."""
    n, r = comm.size, comm.rank
    acc = x.to(work_dtype(x.dtype), copy=True)
    _ring_reduce_scatter(comm, acc, op, tag_for(comm), deadline)
    b = bounds(acc.numel(), n)
    finish(acc[b[r]:b[r + 1]], op, n)
    _ring_all_gather(comm, acc, b, tag_for(comm), deadline)
    x.copy_(acc)


def _ring_reduce_scatter(comm, acc, op, tag, deadline):
    """After it, chunk ``rank`` of ``acc`` holds the reduction of that chunk over all ranks."""
    n, r = comm.size, comm.rank
    b = bounds(acc.numel(), n)
    right, left = (r + 1) % n, (r - 1) % n
    incoming = torch.empty(b[1] - b[0], dtype=acc.dtype)
    for s in range(n - 1):
        out_c, in_c = (r - s - 1) % n, (r - s - 2) % n
        buf = incoming[: b[in_c + 1] - b[in_c]]
        step(comm, [(right, acc[b[out_c]:b[out_c + 1]])], [(left, buf)], tag, deadline, "all_reduce")
        combine(acc[b[in_c]:b[in_c + 1]], buf, op)


def _ring_all_gather(comm, buf, b, tag, deadline):
    """Chunk ``rank`` of ``buf`` (offsets ``b``) is known; after it, every chunk is."""
    n, r = comm.size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        out_c, in_c = (r - s) % n, (r - s - 1) % n
        step(comm, [(right, buf[b[out_c]:b[out_c + 1]])], [(left, buf[b[in_c]:b[in_c + 1]])], tag, deadline,
             "all_gather")


def _direct(comm, x, op, deadline):
    """One-shot: every rank gets every peer's whole buffer and reduces all n in rank order.

    On one host under MPI the buffers are read straight from the peers' shared memory
    (``_direct_peer_memory``); otherwise every rank sends its buffer to every peer in one step.
    """
    if shm.available(comm) and comm.local_size == comm.size:
        return _direct_peer_memory(comm, x, op, deadline)
    n, r = comm.size, comm.rank
    parts = [x if p == r else torch.empty_like(x) for p in range(n)]
    step(comm, [(p, x) for p in range(n) if p != r], [(p, parts[p]) for p in range(n) if p != r],
         tag_for(comm), deadline, "all_reduce")
    acc = parts[0].to(work_dtype(x.dtype), copy=True)
    for p in range(1, n):
        combine(acc, parts[p], op)
    x.copy_(finish(acc, op, n))


def _direct_peer_memory(comm, x, op, deadline):
    """One-shot through MPI-3 shared memory: copy in, one peer-counter barrier, read every peer.

    One barrier per call is enough because calls alternate between the window's two fixed slots
    (``PeerWindow.next_slot`` says why that holds whatever the sizes of consecutive calls).
    """
    n, nbytes = comm.size, x.numel() * x.element_size()
    win = comm.__dict__.get("_peer_window")
    if win is None or win.freed:  # sized for two slots of this call at once (no growth in next_slot)
        win = comm._peer_window = shm.PeerWindow(comm, 2 * (-(-nbytes // 64) * 64),
                                                 timeout=max(deadline.remaining(), 1e-3))
    offset = win.next_slot(nbytes, timeout=max(deadline.remaining(), 1e-3))
    win.torch_view(win.node_rank, x.dtype, x.numel(), offset).copy_(x.view(-1))
    win.barrier(deadline, "all_reduce")
    acc = win.torch_view(0, x.dtype, x.numel(), offset).to(work_dtype(x.dtype), copy=True)
    for p in range(1, n):
        combine(acc, win.torch_view(p, x.dtype, x.numel(), offset), op)
    x.view(-1).copy_(finish(acc, op, n))


def _two_shot(comm, x, op, deadline):
    """Each rank reduces one chunk from all peers (direct reduce-scatter), then sends it to all."""
    n, r = comm.size, comm.rank
    b = bounds(x.numel(), n)
    mine = slice(b[r], b[r + 1])
    incoming = [torch.empty(b[r + 1] - b[r], dtype=x.dtype) for _ in range(n)]
    step(comm, [(p, x[b[p]:b[p + 1]]) for p in range(n) if p != r], [(p, incoming[p]) for p in range(n) if p != r],
         tag_for(comm), deadline, "all_reduce")
    incoming[r] = x[mine]
    acc = incoming[0].to(work_dtype(x.dtype), copy=True)
    for p in range(1, n):
        combine(acc, incoming[p], op)
    x[mine] = finish(acc, op, n)
    tag = tag_for(comm)
    step(comm, [(p, x[mine]) for p in range(n) if p != r], [(p, x[b[p]:b[p + 1]]) for p in range(n) if p != r],
         tag, deadline, "all_reduce")


def _hierarchical(comm, x, op, deadline):
    """Reduce inside each package to its leader, all-reduce across the leaders, spread inside.

    Uneven packages are fine: each package has one leader whatever its size. The fabric carries
    only the leaders' ring, so each package's data crosses it 2(P-1)/P times for P packages.
    """
    pkg, leaders = _groups.package_comms(comm, deadline)
    acc = x.to(work_dtype(x.dtype), copy=True)
    inner = "sum" if op == "avg" else op
    _reduce_to_first(pkg, acc, inner, deadline)
    if leaders is not None and leaders.size > 1:
        _ring(leaders, acc, inner, deadline)
    if op == "avg":
        acc.div_(comm.size)
    if pkg.size > 1:
        tag = tag_for(pkg)
        if pkg.rank == 0:
            step(pkg, [(p, acc) for p in range(1, pkg.size)], [], tag, deadline, "all_reduce")
        else:
            step(pkg, [], [(0, acc)], tag, deadline, "all_reduce")
    x.copy_(acc)


def _reduce_to_first(comm, acc, op, deadline):
    """Rank 0 of ``comm`` ends with op over every rank's ``acc`` (others' ``acc`` unchanged)."""
    if comm.size == 1:
        return
    tag = tag_for(comm)
    if comm.rank == 0:
        parts = [torch.empty_like(acc) for _ in range(1, comm.size)]
        step(comm, [], list(zip(range(1, comm.size), parts)), tag, deadline, "all_reduce")
        for part in parts:
            combine(acc, part, op)
    else:
        step(comm, [(0, acc)], [], tag, deadline, "all_reduce")


_ALGOS = {"ring": _ring, "direct": _direct, "two_shot": _two_shot, "hierarchical": _hierarchical}

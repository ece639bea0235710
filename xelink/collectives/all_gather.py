"""All-gather: ring, direct, and topology-aware (each shard crosses the fabric once per remote package)."""
from __future__ import annotations

import torch

from . import _groups
from . import gpu
from ._common import as_tensor, check_algo, fingerprint_check, group_of, is_cuda, output_input, run, step, tag_for
from .all_reduce import _ring_all_gather

__all__ = ["all_gather_into_tensor", "all_gather", "ALGOS"]

ALGOS = ("ring", "direct", "topo")


def all_gather_into_tensor(output, input, group=None, async_op: bool = False, algo: str = "auto", timeout=None):
    """Concatenate every rank's ``input`` into ``output`` in rank order (torch.distributed semantics).

    Args:
        output: tensor/array of ``world_size * input.numel()`` elements, same dtype; either shape
            ``(world_size * d0, ...)`` or any shape with that many elements.
        input: this rank's shard (any dtype).
        algo: "auto" or one of ``ALGOS``.
        timeout: deadline in seconds (default: the group's).

    Returns:
        None, or a ``Work`` when ``async_op``.

    Collective: every rank of ``group`` must call this with inputs of the same shape and dtype.
    """
    fn = "all_gather_into_tensor"
    if torch.compiler.is_compiling():
        from . import compiled

        compiled.traced(fn, async_op)
        return torch.ops.xelink.all_gather_into_tensor_(output, input, algo, compiled.group_name(group))
    comm = group_of(group, fn)
    if is_cuda(output) or is_cuda(input):
        return gpu.all_gather_into_tensor(comm, output, input, algo, async_op, timeout)
    out, inp = output_input(fn, output, input)
    if out.numel() != comm.size * inp.numel():
        raise ValueError(f"{fn}: output.numel()={out.numel()} != world_size*input.numel()="
                         f"{comm.size * inp.numel()}")
    check_algo(fn, algo, ALGOS)
    fingerprint_check(comm, fn, (fn, tuple(inp.shape), str(inp.dtype), algo))
    return run(comm, fn, lambda deadline: _gather(comm, out.view(-1), inp.reshape(-1), algo, deadline, fn),
               async_op, timeout)


def all_gather(tensor_list, tensor, group=None, async_op: bool = False, algo: str = "auto", timeout=None):
    """List form: ``tensor_list[r]`` receives rank r's ``tensor`` (torch.distributed.all_gather).

    Collective: every rank of ``group`` must call this with tensors of the same shape and dtype.
    """
    fn = "all_gather"
    comm = group_of(group, fn)
    if is_cuda(tensor):
        return _gpu_all_gather_list(comm, tensor_list, tensor, algo, async_op, timeout)
    inp = as_tensor(fn, "tensor", tensor)
    if not isinstance(tensor_list, (list, tuple)) or len(tensor_list) != comm.size:
        got = len(tensor_list) if isinstance(tensor_list, (list, tuple)) else type(tensor_list).__name__
        raise ValueError(f"{fn}: tensor_list must be a list of world_size={comm.size} tensors, got {got}")
    outs = [as_tensor(fn, f"tensor_list[{i}]", t) for i, t in enumerate(tensor_list)]
    for i, t in enumerate(outs):
        if t.dtype != inp.dtype or t.numel() != inp.numel():
            raise ValueError(f"{fn}: tensor_list[{i}] has {t.numel()} x {t.dtype}, expected "
                             f"{inp.numel()} x {inp.dtype} like tensor")
    check_algo(fn, algo, ALGOS)
    fingerprint_check(comm, fn, (fn, tuple(inp.shape), str(inp.dtype), algo))

    def body(deadline):
        flat = torch.empty(comm.size * inp.numel(), dtype=inp.dtype)
        _gather(comm, flat, inp.reshape(-1), algo, deadline, fn)
        for i, t in enumerate(outs):
            t.view(-1).copy_(flat[i * inp.numel():(i + 1) * inp.numel()])

    return run(comm, fn, body, async_op, timeout)


def _gpu_all_gather_list(comm, tensor_list, tensor, algo, async_op, timeout):
    if not isinstance(tensor_list, (list, tuple)) or len(tensor_list) != comm.size:
        raise ValueError(f"all_gather: tensor_list must be a list of world_size={comm.size} tensors")
    for i, t in enumerate(tensor_list):
        if not is_cuda(t) or t.dtype != tensor.dtype or t.numel() != tensor.numel():
            raise ValueError(f"all_gather: tensor_list[{i}] must be a CUDA tensor of {tensor.numel()} x "
                             f"{tensor.dtype} like tensor")
    flat = torch.empty(comm.size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    gpu.all_gather_into_tensor(comm, flat, tensor.contiguous(), algo, False, timeout)
    for i, t in enumerate(tensor_list):
        t.copy_(flat[i * tensor.numel():(i + 1) * tensor.numel()].view_as(t))
    return gpu.GpuWork(comm, "all_gather") if async_op else None


def _gather(comm, out, inp, algo, deadline, fn):
    n, r, m = comm.size, comm.rank, inp.numel()
    out[r * m:(r + 1) * m].copy_(inp)
    if n == 1 or m == 0:
        return
    if algo == "auto":
        from .dispatch import choose

        algo = choose(comm, "all_gather", out.numel() * out.element_size(), out.dtype)
    b = [i * m for i in range(n + 1)]
    if algo == "ring":
        _ring_all_gather(comm, out, b, tag_for(comm), deadline)
    elif algo == "direct":
        step(comm, [(p, inp) for p in range(n) if p != r], [(p, out[b[p]:b[p + 1]]) for p in range(n) if p != r],
             tag_for(comm), deadline, fn)
    else:
        _topo(comm, out, b, deadline, fn)


def cross_target(packages, src_local: int, dst_package: int) -> int:
    """The rank of package ``dst_package`` that receives shards from local index ``src_local``.

    Same local index where it exists; a smaller package wraps (local index mod its size), so uneven
    packages still receive every shard exactly once.
    """
    members = packages[dst_package]
    return members[src_local % len(members)]


def _topo(comm, out, b, deadline, fn):
    """Topology-aware all-gather in two steps.

    1. Across the fabric: my shard goes to one rank of every other package (``cross_target``), so
       it crosses the fabric once per remote package.
    2. Inside the package: each rank sends the shards it holds (its own and those it received) to
       every other member of its package over the fast local link.
    """
    packages = _groups.layout(comm)
    me_p, me_i = _groups.where(packages, comm.rank)
    chunk = lambda q: out[b[q]:b[q + 1]]  # noqa: E731
    # Who sends me what across: every rank q in another package whose target in my package is me.
    held = [comm.rank]
    sends, recvs = [], []
    for p, members in enumerate(packages):
        if p == me_p:
            continue
        sends.append((cross_target(packages, me_i, p), chunk(comm.rank)))
        for q_i, q in enumerate(members):
            if cross_target(packages, q_i, me_p) == comm.rank:
                recvs.append((q, chunk(q)))
                held.append(q)
    step(comm, sends, recvs, tag_for(comm), deadline, fn)
    # Inside the package: I send what I hold to each member and receive what each member holds.
    sends, recvs = [], []
    for m_i, m in enumerate(packages[me_p]):
        if m == comm.rank:
            continue
        theirs = [m] + [q for p, members in enumerate(packages) if p != me_p
                        for q_i, q in enumerate(members) if cross_target(packages, q_i, me_p) == m]
        sends += [(m, chunk(q)) for q in held]
        recvs += [(m, chunk(q)) for q in theirs]
    step(comm, sends, recvs, tag_for(comm), deadline, fn)

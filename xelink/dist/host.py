"""The distributed GEMM schedules on CPU ranks: xelink's public collectives and point-to-point, overlapped
with ``torch.matmul`` of the chunk that arrived.

Point-to-point runs on a private duplicate of the group (made on the first call, a resource of the group,
freed with it), so its messages never match the user's own; a message carries shard (or block) q under tag
q, which is unique per pair and call. Every send and receive of a call completes before it returns.

Overlap on CPU ranks is what the MPI library gives: nonblocking transfers progress when a rank tests or
waits (each step tests the pending receives before its matmul, which also starts the forwards of shards
that landed); the all-reduce chunks of ``matmul_all_reduce`` run on the group's worker thread
(``async_op=True``), truly beside the matmul.
"""
from __future__ import annotations

import functools
import math

import torch

from ..collectives import all_gather_into_tensor, all_reduce, irecv, isend, reduce_scatter_tensor
from . import schedule

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "AR_CHUNKS", "private", "fails_group",
           "gathered"]

# Row chunks of the pipelined matmul_all_reduce: enough to hide all but one chunk's all-reduce.
AR_CHUNKS = 4
_HALF = (torch.float16, torch.bfloat16)


def private(comm):
    """The group's duplicate for this module's point-to-point (collective on first use)."""
    return comm.resource(("xelink.dist", "p2p"), lambda: comm.split(0))


def fails_group(schedule_fn):
    """An error part way through a schedule leaves messages posted (receives, sends, queued all-reduces) that
    the ranks no longer agree on: the group and its private duplicate then refuse further use, so this rank's
    next call raises at once instead of waiting for messages that never come (the others' waits on this rank
    expire and name it)."""
    @functools.wraps(schedule_fn)
    def run(comm, *args, **kwargs):
        try:
            return schedule_fn(comm, *args, **kwargs)
        except BaseException as exc:
            for c in (comm, comm.resource(("xelink.dist", "p2p"))):
                if c is not None:
                    c.fail(exc)
            raise
    return run


def _mm_into(x: torch.Tensor, w: torch.Tensor, dst: torch.Tensor) -> None:
    if dst.is_contiguous():
        torch.matmul(x, w, out=dst)
    else:  # a block of a sequence-gathered 3-D output, or a strided out=
        dst.copy_(torch.matmul(x, w))


def _result(shape, a, out):
    return out if out is not None else torch.empty(shape, dtype=a.dtype)


def gathered(stage: torch.Tensor, dim: int) -> torch.Tensor:
    """``cat(stage[0], ..., stage[n-1], dim)`` from the ``[n, *shard]`` gather buffer (a view for dim 0)."""
    n, shard = stage.shape[0], tuple(stage.shape[1:])
    if dim == 0:
        return stage.view((n * shard[0],) + shard[1:])
    moved = stage.movedim(0, dim)
    return moved.reshape(shard[:dim] + (n * shard[dim],) + shard[dim + 1:])


def _run_gather_plan(p2p, stage, reads, compute) -> None:
    """Obtain every shard by ``reads`` (``schedule``) into ``stage[q]``, calling ``compute(q)`` on each,
    own shard first; a shard that others obtain from this rank is sent on as soon as it is here."""
    me, n = p2p.rank, p2p.size
    fwd = {q: [] for q in range(n)}
    for x in range(n):
        for q, src in reads[x]:
            if src == me:
                fwd[q].append(x)
    recvs = {q: irecv(stage[q], group=p2p, tag=q, group_src=src) for q, src in reads[me]}
    sends = [isend(stage[me], group=p2p, tag=me, group_dst=x) for x in fwd[me]]
    forwarded = set()

    def forward(q):
        forwarded.add(q)
        sends.extend(isend(stage[q], group=p2p, tag=q, group_dst=x) for x in fwd[q])

    compute(me)
    for q, _ in reads[me]:
        for p, h in recvs.items():  # forward what already landed (and let MPI progress)
            if p not in forwarded and fwd[p] and h.is_completed():
                forward(p)
        recvs[q].wait()
        if q not in forwarded and fwd[q]:
            forward(q)
        compute(q)
    for s in sends:
        s.wait()


@fails_group
def all_gather_matmul(comm, a, weights, dim, outs, algo, return_gathered):
    n, r = comm.size, comm.rank
    shard = tuple(a.shape)
    stage = torch.empty((n,) + shard, dtype=a.dtype)
    full = list(shard)
    full[dim] *= n
    cs = [_result(tuple(full[:-1]) + (w.shape[1],), a, o) for w, o in zip(weights, outs)]
    if algo == "sequential":
        all_gather_into_tensor(stage, a.contiguous(), group=comm)
        a_full = gathered(stage, dim)
        for w, c in zip(weights, cs):
            _mm_into(a_full, w, c)
        return (a_full if return_gathered else None), cs
    stage[r].copy_(a)
    rows = shard[dim]

    def compute(q):
        for w, c in zip(weights, cs):
            _mm_into(stage[q], w, c.narrow(dim, q * rows, rows))

    reads = schedule.topo_plan(comm.packages) if algo == "topo" else schedule.ring_plan(n)
    _run_gather_plan(private(comm), stage, reads, compute)
    return (gathered(stage, dim) if return_gathered else None), cs


def _work_dtype(dtype):
    return torch.float32 if dtype in _HALF else dtype


@fails_group
def matmul_reduce_scatter(comm, a, w, dim, op, out, algo):
    n = comm.size
    blk = a.shape[dim] // n
    shape = list(a.shape[:-1]) + [w.shape[1]]
    shape[dim] = blk
    shape = tuple(shape)
    if algo == "sequential":
        p = torch.matmul(a, w)
        # reduce_scatter_tensor takes n blocks in rank order, each contiguous.
        blocks = p if dim == 0 else p.unflatten(dim, (n, blk)).movedim(dim, 0).contiguous()
        res = out if out is not None and out.is_contiguous() else torch.empty(shape, dtype=a.dtype)
        reduce_scatter_tensor(res, blocks, op=op, group=comm)
        return res if out is None or res is out else out.copy_(res)
    wd = _work_dtype(a.dtype)

    def partial(j):
        return torch.matmul(a.narrow(dim, j * blk, blk), w).to(wd).contiguous()

    p2p = private(comm)
    sends = []
    if algo == "pipelined":
        acc = _ring_reduce(p2p, partial, shape, wd, sends)
    else:
        acc = _topo_reduce(p2p, comm.packages, partial, shape, wd, sends)
    for s in sends:
        s.wait()
    if op == "avg":
        acc.div_(n)
    if out is None:
        return acc.to(a.dtype)
    return out.copy_(acc)


def _ring_reduce(p2p, partial, shape, wd, sends):
    """Ring: at step s rank r computes its partial of block r - s - 1, adds the sum its left neighbour sent
    (posted before the matmul, so it lands meanwhile) and sends it right; the last step is its own block."""
    n, r = p2p.size, p2p.rank
    left, right = (r - 1) % n, (r + 1) % n
    for s in range(n):
        j = (r - s - 1) % n
        h = None
        if s:
            inbox = torch.empty(shape, dtype=wd)
            h = irecv(inbox, group=p2p, tag=j, group_src=left)
        part = partial(j)
        if h is not None:
            h.wait()
            part.add_(inbox)
        if s < n - 1:
            sends.append(isend(part, group=p2p, tag=j, group_dst=right))
            while len(sends) > 1:  # the sum sent a step ago has landed: its buffer goes
                sends.pop(0).wait()
    return part


def _topo_reduce(p2p, packages, partial, shape, wd, sends):
    """Reduce inside the package, then across: for a destination j of another package every member sends
    its partial to the package's aggregator for j (``schedule.aggregator``), which adds them and sends the
    one sum across; members of the own package send straight to j; the own block is computed last, then
    the package's partials and one sum per other package are added to it."""
    me = p2p.rank
    p, i = schedule.package_index(packages, me)
    mine = packages[p]
    others = [m for m in mine if m != me]
    remote = [j for t in range(1, len(packages)) for j in packages[(p + t) % len(packages)]]
    local = [mine[(i + s) % len(mine)] for s in range(1, len(mine))]

    def post(src, tag):
        buf = torch.empty(shape, dtype=wd)
        return buf, irecv(buf, group=p2p, tag=tag, group_src=src)

    as_agg = {j: [post(m, j) for m in others] for j in remote if schedule.aggregator(packages, p, j) == me}
    incoming = [post(m, me) for m in others]
    incoming += [post(schedule.aggregator(packages, q, me), me) for q in range(len(packages)) if q != p]
    for j in remote:
        part = partial(j)
        if j in as_agg:
            for buf, h in as_agg[j]:
                h.wait()
                part.add_(buf)
            sends.append(isend(part, group=p2p, tag=j, group_dst=j))
        else:
            sends.append(isend(part, group=p2p, tag=j, group_dst=schedule.aggregator(packages, p, j)))
    for j in local:
        sends.append(isend(partial(j), group=p2p, tag=j, group_dst=j))
    acc = partial(me)
    for buf, h in incoming:
        h.wait()
        acc.add_(buf)
    return acc


@fails_group
def matmul_all_reduce(comm, a, w, out, algo):
    shape = tuple(a.shape[:-1]) + (w.shape[1],)
    c = out if out is not None and out.is_contiguous() else torch.empty(shape, dtype=a.dtype)
    if algo == "sequential":
        _mm_into(a, w, c)
        all_reduce(c, group=comm)
    else:
        rows = math.prod(a.shape[:-1])
        a2, c2 = a.reshape(rows, a.shape[-1]), c.view(rows, w.shape[1])
        chunks = max(1, min(AR_CHUNKS, rows))
        base, extra = divmod(rows, chunks)
        works, lo = [], 0
        for k in range(chunks):
            hi = lo + base + (1 if k < extra else 0)
            if hi > lo:
                _mm_into(a2[lo:hi], w, c2[lo:hi])
                works.append(all_reduce(c2[lo:hi], group=comm, async_op=True,
                                        algo="hierarchical" if algo == "topo" else "auto"))
            lo = hi
        for wk in works:
            wk.wait()
    return c if out is None or c is out else out.copy_(c)

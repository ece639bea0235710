"""torch.distributed's rooted collectives on CUDA tensors: broadcast, gather and scatter by point-to-point
transfers (``p2p.start``: peer memory, else NCCL), the root sending or receiving one message per other rank,
all in flight together. Stream-ordered as the rest of the backend: each transfer forks from the caller's
current stream and is joined back before the call returns, so later work on that stream sees the result and
the handle of ``async_op=True`` has nothing left to wait for. (``reduce`` is an all-reduce: ``api.reduce``.)
"""
from __future__ import annotations

from ... import symm
from . import p2p

__all__ = ["broadcast", "gather", "scatter"]


def _run(comm, fn: str, moves, async_op: bool):
    """Start every ``(peer, tensor, send)`` transfer, join them into the current stream."""
    if moves:
        problem = p2p.unsupported(comm)
        if problem is not None:
            raise problem
    works = [p2p.start(comm, t, peer, send) for peer, t, send in moves]
    for work in works:
        work.wait()
    return symm.Work(None, fn) if async_op else None


def broadcast(comm, x, src: int, async_op: bool):
    if comm.rank == src:
        moves = [(p, x, True) for p in range(comm.size) if p != src]
    else:
        moves = [(src, x, False)]
    return _run(comm, "broadcast", moves, async_op)


def gather(comm, x, outs, dst: int, async_op: bool):
    """``outs``: the root's list (None elsewhere), each like ``x`` (contiguous, on this rank's device)."""
    if comm.rank != dst:
        return _run(comm, "gather", [(dst, x, True)], async_op)
    outs[dst].view(-1).copy_(x.view(-1))
    return _run(comm, "gather", [(p, t, False) for p, t in enumerate(outs) if p != dst], async_op)


def scatter(comm, x, ins, src: int, async_op: bool):
    """``ins``: the root's list (None elsewhere), each like ``x``."""
    if comm.rank != src:
        return _run(comm, "scatter", [(src, x, False)], async_op)
    x.view(-1).copy_(ins[src].view(-1))
    return _run(comm, "scatter", [(p, t, True) for p, t in enumerate(ins) if p != src], async_op)

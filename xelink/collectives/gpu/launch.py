"""How the GPU backend enqueues work: launch plans cached per call signature, the team's kernels, the
copy-engine transfers of a plan, and the handle of an asynchronous call.

Semantics are NCCL's: a call enqueues its work on the current CUDA stream and returns; nothing here
synchronizes the host, so calls can be captured in CUDA graphs (after one warm-up call, which sets up
peer memory and compiles) and replayed. A kernel whose barrier outlives the deadline records the
missing ranks; the next call on the communicator (or ``xelink.synchronize``) raises them.
"""
from __future__ import annotations

import torch

from ...config import resolve_timeout
from ...transport import cuda as peer

__all__ = ["GpuWork", "done", "team", "launch", "kernel", "pieces", "symmetric", "Copy", "Join", "peers", "round16",
           "kernels", "OPS"]

BLOCK = {1: 4096, 2: 4096, 4: 2048, 8: 1024}  # elements per tile: 16-byte vectors x 8 warps x 2
NUM_WARPS = 8
OPS = {"sum": 0, "avg": 1, "max": 2, "min": 3, "prod": 4}  # the kernels' OP codes
_kernels_module = None
_raw_stream = torch._C._cuda_getCurrentRawStream if hasattr(torch._C, "_cuda_getCurrentRawStream") else None


def kernels():
    """``xelink.kernels.collectives``, imported on first use (it imports Triton); kept for the hot path."""
    global _kernels_module
    if _kernels_module is None:
        from ...kernels import collectives

        _kernels_module = collectives
    return _kernels_module


def team(comm, fn: str = "peer memory"):
    """The communicator's peer-memory team (its resource ``"cuda.team"``), set up on first use (collective)."""
    return peer.team_of(comm, fn)


class GpuWork:
    """Handle of an ``async_op=True`` call on CUDA tensors (torch.distributed's Work)."""

    def __init__(self, comm, what):
        self._event = torch.cuda.Event()
        self._event.record()
        self._comm, self._what = comm, what

    def is_completed(self) -> bool:
        return self._event.query()

    def wait(self, timeout=None) -> bool:
        """Make the current stream wait for the operation (the host does not block)."""
        torch.cuda.current_stream().wait_event(self._event)
        return True

    def synchronize(self) -> None:
        """Block the host until the operation has finished; raise its timeout if it had one."""
        self._event.synchronize()
        t = self._comm._resources.get("cuda.team")
        if t is not None:
            t.check(self._what)


def done(comm, what, async_op):
    return GpuWork(comm, what) if async_op else None


def _timeout_ns(comm, timeout) -> int:
    return int((comm.timeout if timeout is None else resolve_timeout(timeout, "timeout")) * 1e9)


def launch(comm, fn, timeout, key, build):
    """Enqueue the cached plan ``key`` on the current stream; ``build(team, timeout_ns)`` makes it once.

    A plan is the list of ``Bound`` kernel launches of one call (pieces included), every argument
    fixed, so a repeated call costs a dict lookup and the launches. Keys hold everything a plan
    depends on (addresses, sizes, dtype, op, algorithm, deadline, peers' addresses of a symmetric
    input); growing the scratch buffer drops every plan.
    """
    t = team(comm, fn)
    t.check(fn)
    plan = t.plans.get(key)
    if plan is None:
        plan = build(t, _timeout_ns(comm, timeout))
        if len(t.plans) > 4096:  # many distinct buffers: start over rather than grow without bound
            t.plans.clear()
        t.plans[key] = plan
    stream = _raw_stream(t.device.index)
    for bound in plan:
        bound(stream)
    return t


def kernel(t, name, dtype, small=False, **consts):
    """The team's kernel ``name`` for ``dtype`` and these meta-parameters (built once, then a dict hit).

    ``small``: half the tile and warps, for latency-bound messages (measured on 2 x H200: 0.2-0.3 us
    less at 32-256 KiB, slower above 1 MiB).
    """
    key = (name, dtype, small, *consts.values())
    k = t.kernels.get(key)
    if k is None:
        K = kernels()
        if "ACC" in consts:
            consts["ACC"] = K.acc_type(dtype)
        div = 2 if small else 1
        k = t.kernels[key] = K.Kernel(name, t, dtype, num_warps=NUM_WARPS // div, BLOCK=BLOCK[dtype.itemsize] // div,
                                      **consts)
    return k


def pieces(count, per_piece):
    """(start, length) of consecutive pieces of at most ``per_piece`` elements (one empty piece for 0)."""
    per_piece = max(per_piece, 1)
    return [(s, min(per_piece, count - s)) for s in range(0, max(count, 1), per_piece)]


def symmetric(comm, t):
    """Every rank's address of ``t`` if it is a symmetric tensor of ``comm`` (``xelink.empty``), else None."""
    found = comm._resources.get("cuda.team")
    if found is None or not found.symmetric:
        return None
    sym = found.peer_addresses(t)
    return None if sym is None else tuple(sym)


def round16(v):
    return -(-v // 16) * 16


def peers(addresses):
    return {f"B{i}": a for i, a in enumerate(addresses)}


class Copy:
    """A copy-engine transfer in a plan: ``copy(stream)``; ``aside`` runs it on a side stream.

    On the side stream (forked from the calling stream and joined back at ``Join``) the local copy of
    this rank's own shard overlaps the pulls over the links instead of queueing behind them.
    """

    __slots__ = ("dst", "src", "nbytes", "aside")

    def __init__(self, dst, src, nbytes, aside=None):
        self.dst, self.src, self.nbytes, self.aside = dst, src, nbytes, aside

    def __call__(self, stream):
        if self.aside is None:
            peer.copy(self.dst, self.src, self.nbytes, stream)
            return
        side, forked, finished = self.aside
        current = torch.cuda.current_stream()
        forked.record(current)
        side.wait_event(forked)
        peer.copy(self.dst, self.src, self.nbytes, side.cuda_stream)
        finished.record(side)


class Join:
    """Make the calling stream wait for a ``Copy`` that ran aside."""

    __slots__ = ("finished",)

    def __init__(self, finished):
        self.finished = finished

    def __call__(self, stream):
        torch.cuda.current_stream().wait_event(self.finished)

"""How the GPU collectives enqueue work on the peer-memory layer (``xelink.symm``): the team's kernels with
the collectives' tile sizes, cached launch plans, the piece split, and the handle of an asynchronous call.

Semantics are NCCL's: a call enqueues its work on the current CUDA stream and returns; nothing here
synchronizes the host, so calls can be captured in CUDA graphs (after one warm-up call, which sets up peer
memory and compiles) and replayed. A kernel whose wait outlives the deadline records the missing ranks;
the next call on the communicator (or ``xelink.synchronize``) raises them.
"""
from __future__ import annotations

from ... import symm

__all__ = ["done", "team", "launch", "kernel", "pieces", "symmetric", "peers", "round16", "kernel_module", "OPS"]

BLOCK = {1: 4096, 2: 4096, 4: 2048, 8: 1024}  # elements per tile: 16-byte vectors x 8 warps x 2
NUM_WARPS = 8
OPS = {"sum": 0, "avg": 1, "max": 2, "min": 3, "prod": 4}  # the kernels' OP codes
_kernels_module = None


def kernel_module():
    """``xelink.collectives.gpu.kernels``, imported on first use (it imports Triton); kept for the hot path."""
    global _kernels_module
    if _kernels_module is None:
        from . import kernels as module

        _kernels_module = module
    return _kernels_module


def team(comm, fn: str = "peer memory"):
    """The communicator's peer-memory team, set up on first use (collective)."""
    return symm.team_of(comm, fn)


def done(comm, what, async_op):
    """The handle of an ``async_op=True`` call (None otherwise): ``wait()`` makes the current stream wait."""
    if not async_op:
        return None
    found = comm._resources.get("cuda.team")
    return symm.Work(None if found is None else found.check, what)


def launch(comm, fn, timeout, key, build):
    """Enqueue the cached plan ``key`` on the current stream; ``build(team, timeout_ns)`` makes it once."""
    t = team(comm, fn)
    t.run(fn, key, lambda t_ns: build(t, t_ns), timeout)
    return t


def kernel(t, name, dtype, small=False, **consts):
    """The team's collective kernel ``name`` for ``dtype`` and these meta-parameters (built once).

    ``small``: half the tile and warps, for latency-bound messages (measured on 2 x H200: 0.2-0.3 us
    less at 32-256 KiB, slower above 1 MiB).
    """
    key = (name, dtype, small, *consts.values())
    k = t.kernels.get(key)
    if k is None:
        K = kernel_module()
        if "ACC" in consts:
            consts["ACC"] = K.acc_type(dtype)
        div = 2 if small else 1
        k = t.kernel(K.KERNELS[name], key, dtype, num_warps=NUM_WARPS // div, BLOCK=BLOCK[dtype.itemsize] // div,
                     **consts)
    return k


def pieces(count, per_piece):
    """(start, length) of consecutive pieces of at most ``per_piece`` elements (one empty piece for 0)."""
    per_piece = max(per_piece, 1)
    return [(s, min(per_piece, count - s)) for s in range(0, max(count, 1), per_piece)]


def symmetric(comm, t):
    """Every rank's address of ``t`` if it is a symmetric tensor of ``comm`` (``xelink.empty``), else None."""
    return symm.peer_addresses(t, comm)


def round16(v):
    return -(-v // 16) * 16


def peers(addresses):
    return {f"B{i}": a for i, a in enumerate(addresses)}

"""Device-side primitives of the CUDA peer-memory layer, as ``triton.jit`` functions that any Triton kernel
of a composed op can call (the rules they follow are in ``xelink.symm.cuda``'s docstring).

- ``pick(i, a0..a7)``: the i-th of eight pointer arguments (peer addresses travel as separate
  arguments so that Triton specializes each on 16-byte alignment and emits vector accesses).
- ``notify(counter)``: release-add 1 to a counter in peer memory at system scope, after a block-wide
  barrier, so that every thread's earlier stores (to any rank) happen before it.
- ``wait_at_least(counter, target, err, who, timeout_ns)``: acquire-poll ``counter`` until it reaches
  ``target`` (int32, wrap-safe comparison) or the deadline passes; a late wait writes ``who`` into the
  error word ``err`` (``err[0] = 1``, ``err[1 + who] = 1``) and moves on, and the host raises. Returns
  nonzero when it gave up (what was waited for is not there).
- ``block_barrier(S0..S7, err, target, timeout_ns, pid, RANK, WORLD)``: block ``pid`` of every rank
  meets block ``pid`` of every other rank (the signal-pad barrier the collectives use).

Without Triton (CPU installs) the names are None and nothing here can run.
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

__all__ = ["MAX_WORLD", "pick", "notify", "wait_at_least", "block_barrier", "available"]

MAX_WORLD = 8  # ranks of one team; pads hold MAX_WORLD counters per block or signal slot


def available() -> bool:
    return triton is not None


if triton is not None:
    _globaltimer = tl.extra.cuda.globaltimer

    @triton.jit
    def pick(i: tl.constexpr, a0, a1, a2, a3, a4, a5, a6, a7):
        if i == 0:
            return a0
        elif i == 1:
            return a1
        elif i == 2:
            return a2
        elif i == 3:
            return a3
        elif i == 4:
            return a4
        elif i == 5:
            return a5
        elif i == 6:
            return a6
        else:
            return a7

    @triton.jit
    def notify(counter):
        # Every thread's earlier stores (to peers too) happen before this release.
        tl.debug_barrier()
        tl.atomic_add(counter, 1, sem="release", scope="sys")

    @triton.jit
    def _poll(counter, target, err, who, timeout_ns):
        v = tl.atomic_add(counter, 0, sem="acquire", scope="sys")
        start = _globaltimer()
        late = (start < 0).to(tl.int32)
        while ((v - target) < 0) & (late == 0):
            v = tl.atomic_add(counter, 0, sem="acquire", scope="sys")
            late = ((_globaltimer() - start) > timeout_ns).to(tl.int32)
        if late != 0:
            tl.store(err + 1 + who, 1)
            tl.store(err, 1)
        return late

    @triton.jit
    def wait_at_least(counter, target, err, who, timeout_ns):
        late = _poll(counter, target, err, who, timeout_ns)
        # The writes this wait acquired happen before every thread's accesses after it.
        tl.debug_barrier()
        return late

    @triton.jit
    def block_barrier(S0, S1, S2, S3, S4, S5, S6, S7, ERR, target, timeout_ns, pid,
                      RANK: tl.constexpr, WORLD: tl.constexpr):
        # Pads are [block][peer] with MAX_WORLD (8) counters a block. Every thread's earlier stores
        # happen before thread 0's releases...
        tl.debug_barrier()
        for p in tl.static_range(WORLD):
            if p != RANK:
                peer = pick(p, S0, S1, S2, S3, S4, S5, S6, S7)
                tl.atomic_add(peer + pid * 8 + RANK, 1, sem="release", scope="sys")
        mine = pick(RANK, S0, S1, S2, S3, S4, S5, S6, S7)
        for p in tl.static_range(WORLD):
            if p != RANK:
                _poll(mine + pid * 8 + p, target, ERR, p, timeout_ns)
        # ...and the peers' writes this block waited for happen before every thread's accesses after it.
        tl.debug_barrier()
else:
    pick = notify = wait_at_least = block_barrier = None

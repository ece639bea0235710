"""The Triton kernels of the CUDA peer-memory layer itself: the device barrier, signal and wait on a
semaphore slot, and the SM copy behind ``put``/``get`` (the composed ops' own kernels call the device
functions of ``xelink.symm.device`` instead)."""
from __future__ import annotations

from .device import block_barrier, notify, triton, wait_at_least

if triton is not None:
    import triton.language as tl

__all__ = ["KERNELS"]

KERNELS: dict = {}

if triton is not None:
    @triton.jit
    def _barrier_kernel(S0, S1, S2, S3, S4, S5, S6, S7, EPOCH, ERR, timeout_ns,
                        RANK: tl.constexpr, WORLD: tl.constexpr):
        pid = tl.program_id(0)
        e0 = tl.load(EPOCH + pid)
        block_barrier(S0, S1, S2, S3, S4, S5, S6, S7, ERR, e0 + 1, timeout_ns, pid, RANK, WORLD)
        tl.store(EPOCH + pid, e0 + 1)

    @triton.jit
    def _signal_kernel(PEER_SLOT):
        # One program: the stream order makes every earlier kernel's and copy's writes complete first.
        notify(PEER_SLOT)

    @triton.jit
    def _wait_kernel(MY_SLOT, SEEN, ERR, who, timeout_ns):
        # Semaphore: consume one signal. SEEN (this rank's own count of consumed signals) moves on the
        # device, so a replayed CUDA graph waits for the next signal, not the one it saw at capture.
        target = tl.load(SEEN) + 1
        wait_at_least(MY_SLOT, target, ERR, who, timeout_ns)
        tl.store(SEEN, target)

    @triton.jit
    def _copy_kernel(X, Y, n, BLOCK: tl.constexpr):
        ar = tl.arange(0, BLOCK)
        for t in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
            o = t.to(tl.int64) * BLOCK + ar
            m = o < n
            tl.store(Y + o, tl.load(X + o, mask=m), mask=m)

    KERNELS.update(barrier=_barrier_kernel, signal=_signal_kernel, wait=_wait_kernel, copy=_copy_kernel)

"""Split kernels that finish in one launch: the last split of a tile combines the partials itself.

A kernel split along a reduction (GEMV's K, decode attention's keys) writes one float32 partial per split
and tile. Instead of a second kernel that combines them, each program, once its partial is stored, takes
a ticket from its tile's int32 counter (:func:`last_split`): the program that draws the last ticket
combines every split's partial, in split order (so the result does not depend on which split finished
last: deterministic), writes the output, and sets the counter back to 0 for the next call.

Memory order (PTX model): every thread's partial stores are ordered before the ticket by a CTA barrier,
and the ticket is one ``acq_rel`` atomic at GPU scope by one thread (Triton's scalar atomics), whose
result reaches the other threads through shared memory and a barrier: the partials of the splits that
drew earlier tickets are visible to the last one, which reads them past L1 (``.cg``).

Counters and partials live in :class:`Scratch`, per (device, stream): calls on one stream run one after
another (programmatic dependent launch included: a kernel touches memory only after ``pdl_wait``, which
waits for the previous kernel to finish), so they share it; calls on other streams get their own. Under
CUDA-graph capture every call gets buffers of its own, so a graph never shares them with eager calls or
another graph: partials from the graph's pool, counters cut from a zeroed arena made at the device's first
eager call (never handed out twice; each captured call's counters are back at 0 after every replay). A
captured memset would zero them too, but a memset node between two kernels cost the 8-row gemv's graph
about 1.5 us a call on an H200 (the kernels lose their programmatic-dependent-launch overlap): it is the
fallback only, for a capture before any eager call or past the arena's 2^18 counters.
"""
from __future__ import annotations

import torch

from .common import tl, triton

__all__ = ["Scratch", "SCRATCH", "last_split"]

if triton is not None:
    @triton.jit
    def last_split(counters, tile, splits):
        """After this program stored its partial of ``tile``: True for the program that drew the last of
        ``splits`` tickets (it then combines the partials; the counter is back at 0)."""
        tl.debug_barrier()  # every thread's partial stores, before the ticket
        ticket = tl.atomic_add(counters + tile, 1, sem="acq_rel", scope="gpu")
        last = ticket == splits - 1
        if last:
            tl.atomic_xchg(counters + tile, 0, sem="relaxed", scope="gpu")
        return last
else:
    last_split = None


class Scratch:
    """Per (device, stream) buffers of split kernels: int32 counters (all 0 between calls: the last
    split resets its own) and float32 partials (any content); under CUDA-graph capture, a call's own."""

    ARENA = 1 << 18  # counters a device keeps for captured calls
    STREAMS = 64     # (device, stream) pairs kept: a job that makes a new stream a step does not pile them up

    def __init__(self):
        self._held: dict = {}
        self._arena: dict = {}  # device index -> [zeroed int32 tensor, counters handed out]

    def get(self, device: torch.device, counters: int, floats: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(counters, partials): at least ``counters`` zeroed int32 and ``floats`` float32 on ``device``."""
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            if torch._C._cuda_isCurrentStreamCapturing():
                return self._captured(index, device, counters, floats)
            key = (index, torch._C._cuda_getCurrentRawStream(index))
        elif device.type == "cpu":  # the interpreter: one program at a time, one call at a time
            key = "cpu"
        else:  # another device: buffers of this call's own
            return torch.zeros(counters, dtype=torch.int32, device=device), \
                torch.empty(floats, dtype=torch.float32, device=device)
        held = self._held.get(key)
        if held is None or held[0].numel() < counters or held[1].numel() < floats:
            # A larger pair replaces the old one; the old buffers go back to the caching allocator, which
            # hands them out again only in this stream's order (after the kernels that use them).
            c = max(counters, held[0].numel() if held else 0, 1024)
            f = max(floats, held[1].numel() if held else 0, 1 << 16)
            held = (torch.zeros(c, dtype=torch.int32, device=device),
                    torch.empty(f, dtype=torch.float32, device=device))
            self._keep(key, held)
            if device.type == "cuda" and key[0] not in self._arena:
                self._arena[key[0]] = [torch.zeros(self.ARENA, dtype=torch.int32, device=device), 0]
        return held

    def _keep(self, key, held) -> None:
        """Remember ``held`` under ``key``, forgetting the oldest pair past ``STREAMS``. A forgotten pair goes
        back to the caching allocator, which reuses its blocks in the order of the stream they were made on
        (the stream its calls ran on), so a kernel still reading them is not overtaken."""
        self._held.pop(key, None)
        if len(self._held) >= self.STREAMS:
            self._held.pop(next(iter(self._held)))
        self._held[key] = held

    def _captured(self, index: int, device: torch.device, counters: int, floats: int):
        partials = torch.empty(floats, dtype=torch.float32, device=device)  # the graph's pool
        arena = self._arena.get(index)
        if arena is None or arena[1] + counters > self.ARENA:
            return torch.zeros(counters, dtype=torch.int32, device=device), partials  # a captured memset
        start = arena[1]
        arena[1] = start + -(-counters // 4) * 4  # 16-byte aligned slices, as the launch plans were keyed
        return arena[0][start:start + counters], partials


SCRATCH = Scratch()

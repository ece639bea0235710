"""The context-parallel ring on CUDA tensors, on the public peer-memory layer (``xelink.symm``).

Every rank has a symmetric staging buffer of two slots, each the packed KV ``(2, B, Hkv, L, D)`` of the
longest local length L (a slot holds a block of length l as its first ``2*B*Hkv*l*D`` elements, contiguous,
so one copy moves it). The ring (``schedule.topo_ring`` order) is double-buffered: at step s slot ``s % 2``
holds the block of the rank s places to the left; the main stream attends to it while a side stream pulls
the next block from the left neighbour's slot ``s % 2`` into this rank's slot ``(s + 1) % 2`` with the copy
engines (``symm.get``, ``engine="copy"``). The side stream, before that pull, waits for

- ``READY`` from the left neighbour: its slot ``s % 2`` holds the block (signalled after its own copy-in or
  after its pull of the previous step landed);
- ``FREE`` from the right neighbour (from step 1 on): it finished pulling this rank's slot ``(s + 1) % 2``
  (its pull of step s - 1), so the slot may be overwritten;
- the event of the main stream's attention of step s - 1, which read slot ``(s + 1) % 2``;

then records the event the main stream waits for before step s + 1, signals ``FREE`` to the left and
``READY`` to the right (when the right neighbour will still pull from it). Step 0 attends to the caller's
own k and v directly. At the end the side stream consumes the right neighbour's last ``FREE``, and the main
stream waits for the side one: when the call's work is done nobody reads this rank's slots any more, so
the next call may overwrite them. Signals and waits balance per call (n - 1 of each per neighbour), and
nothing synchronises the host.

What it allocates: per (group, slot shape, dtype) the staging buffer (``xelink.symm.empty``, collective, on
the first call of that shape, kept as a resource of the group), the group's side stream (shared with the
distributed GEMM); per call the float32 accumulator and the partials, from torch's caching allocator.

``all_gather`` (in ``cp_engine``, shared with CPU ranks) runs its gather here (``start_gather``): xelink's
``all_gather_into_tensor`` on the side stream while the current stream attends to the own block.

CUDA graphs: run each shape once before capturing it (peer memory, the staging buffer and the semaphore
kernels are set up by the first call). Semaphore slots ``CP_READY`` and ``CP_FREE`` of the group's team
belong to this ring.
"""
from __future__ import annotations

import torch

from .. import symm
from ..collectives import all_gather_into_tensor, cuda_p2p_unsupported
from . import schedule
from .cp_engine import Accumulator, attend
from .device import side_stream, stage_buffer

__all__ = ["CP_READY", "CP_FREE", "unmet", "start_gather", "ring_attention"]

CP_READY, CP_FREE = 12, 13


def unmet(comm, algo: str) -> str | None:
    """Why ``algo`` cannot run on CUDA tensors of ``comm`` (None: it can)."""
    if algo == "ring" and not symm.available(comm):
        return (f"algo='ring' on CUDA tensors needs peer memory between the ranks (one host, at most "
                f"{symm.MAX_WORLD} ranks); use 'all_gather'")
    if algo == "window":  # the halo's point-to-point
        problem = cuda_p2p_unsupported(comm)
        return None if problem is None else f"window= exchanges its halo point-to-point: {problem}"
    return None


def start_gather(comm, stage, send):
    """The all-gather of ``all_gather`` on the group's side stream, after the work queued so far (the packing
    of ``send``), so the own block's attention on the current stream runs beside it; returns its handle."""
    main, side = torch.cuda.current_stream(send.device), side_stream(comm, send.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        all_gather_into_tensor(stage, send, group=comm)
    # The handle holds send and stage until wait(): freed earlier, the caching allocator would hand their memory
    # to the current stream's next tensor while the gather still used it.
    return symm.Work(None, "cp_attention", side, keep=(send, stage))


def ring_attention(comm, q, kv, lengths, layout, causal, scale):
    n, r, dev = comm.size, comm.rank, q.device
    seq_len = sum(lengths)
    order = schedule.topo_ring(comm.packages)
    pos = order.index(r)
    left, right = order[(pos - 1) % n], order[(pos + 1) % n]
    owners = [order[(pos - s) % n] for s in range(n)]  # the block at hand at step s
    two, B, Hkv, _, D = kv.shape
    per_pos = two * B * Hkv * D
    stage = stage_buffer(comm, "cp_ring", (2, per_pos * max(lengths)), kv.dtype)

    def slot(s: int, owner: int) -> torch.Tensor:
        return stage[s % 2, :per_pos * lengths[owner]]

    def packed(t: torch.Tensor, owner: int) -> torch.Tensor:
        return t.view(two, B, Hkv, lengths[owner], D)

    qpieces = schedule.rank_pieces(seq_len, n, layout, r)
    acc = Accumulator(q)
    main, side = torch.cuda.current_stream(dev), side_stream(comm, dev)
    slot(0, r).copy_(kv.reshape(-1))
    symm.signal(right, CP_READY, group=comm, stream=main)
    side.wait_stream(main)  # this call's copy-in, and the previous call's reads of the slots, come first
    landed, computed = {}, {}
    for s in range(n):
        if s < n - 1:  # the pull of step s + 1's block, beside step s's attention
            symm.wait(left, CP_READY, group=comm, stream=side)
            if s >= 1:
                symm.wait(right, CP_FREE, group=comm, stream=side)
                side.wait_event(computed[s - 1])
            # the left neighbour's slot s % 2 (named by this rank's view of it) into this rank's next slot
            symm.get(slot(s + 1, owners[s + 1]), slot(s, owners[s + 1]), left, group=comm, engine="copy",
                     stream=side)
            landed[s + 1] = torch.cuda.Event()
            landed[s + 1].record(side)
            symm.signal(left, CP_FREE, group=comm, stream=side)
            if s + 1 < n - 1:
                symm.signal(right, CP_READY, group=comm, stream=side)
        if s == 0:
            k_at, v_at = kv[0], kv[1]
        else:
            main.wait_event(landed[s])
            block = packed(slot(s, owners[s]), owners[s])
            k_at, v_at = block[0], block[1]
        attend(acc, q, qpieces, schedule.rank_pieces(seq_len, n, layout, owners[s]), k_at, v_at,
               causal, scale)
        computed[s] = torch.cuda.Event()
        computed[s].record(main)
    symm.wait(right, CP_FREE, group=comm, stream=side)
    main.wait_stream(side)
    return acc

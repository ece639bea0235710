"""Context-parallel attention under a sliding window (``cp_attention(..., window=W)``): a halo exchange, on
either backend (public point-to-point and kernels only, so the same code runs on CPU ranks and CUDA tensors).

A query at position p sees the keys in (p - W, p] (causal; without causal every query sees the sequence's last
W positions, ``flash_attention``'s non-causal window). So each of a rank's pieces (a contiguous run of its
positions, ``schedule.rank_pieces``) reads one contiguous span of keys (``schedule.window_spans``), and a rank
needs of the others only the rows its spans reach (``schedule.halo_runs``: with W no longer than a layout block,
the last W - 1 rows of the block before each piece). The ranks send each other exactly those rows (each ordered
pair at most one message each way, the runs packed in global order), then every piece attends to its span in
one ``flash_attention`` call (end-aligned causal with the window: exact, nothing to merge). A rank keeps its own
KV and the halo: memory O(S_local + W), work O(S_local x W), where the ring and the gather move and attend
every block.

The backward exchanges the halo again (the forward's is not kept), runs ``flash_attention_backward`` of each
piece over its span, adds the span's key and value gradients of its own rows locally and sends those of the
other ranks' rows back to their owners, who add them in rank order (a fixed order: the results do not depend on
arrival). Point-to-point runs on the group's private duplicate (``host.private``) under this module's tags;
an error part way fails the group (``host.fails_group``) as the ring's does.
"""
from __future__ import annotations

import torch

from ..collectives import irecv, isend
from ..kernels import flash_attention, flash_attention_backward
from . import schedule
from .host import fails_group, private

__all__ = ["window_attention", "window_backward"]

# The tags of the halo's messages (the ring's use owners and n + owners: these sit above any group size).
_KV_TAG, _GRAD_TAG = 1 << 13, (1 << 13) + 1


class _Halo:
    """Who sends which rows to whom for one call, and where each span's keys come from."""

    def __init__(self, comm, lengths, layout: str, window: int, causal: bool):
        n, r = comm.size, comm.rank
        seq_len = sum(lengths)
        self.comm = comm
        pieces = schedule.rank_pieces(seq_len, n, layout, r)
        self.spans = schedule.window_spans(seq_len, window, causal, pieces)
        self.recv = {x: schedule.halo_runs(seq_len, n, layout, window, causal, r, x) for x in range(n)}
        self.send = {x: schedule.halo_runs(seq_len, n, layout, window, causal, x, r) for x in range(n)}
        # Every source of keys: (global start, length, None for this rank's KV or the sender, offset there)
        self.sources = [(start, length, None, off) for start, length, off in pieces]
        for x, runs in self.recv.items():
            at = 0
            for start, length, _ in runs:
                self.sources.append((start, length, x, at))
                at += length

    def segments(self, first: int, end: int) -> list[tuple[int, int, int | None, int]]:
        """The span [first, end) as ``(offset in the span, length, source, offset in the source)``, in order."""
        segs = []
        for start, length, src, off in self.sources:
            a, b = max(first, start), min(end, start + length)
            if a < b:
                segs.append((a - first, b - a, src, off + a - start))
        segs.sort()
        if sum(length for _, length, _, _ in segs) != end - first:  # a plan bug, never the caller's
            raise AssertionError(f"cp_attention: the halo plan does not cover keys [{first}, {end})")
        return segs

    def exchange(self, kv: torch.Tensor, tag: int, outgoing=None) -> dict:
        """Send every other rank the rows of ``kv`` ((2, B, Hkv, L, D): this rank's) its spans reach and receive
        this rank's halo: {sender: (2, B, Hkv, rows, D)}. ``outgoing`` ({rank: tensor}, the backward's return
        trip) sends those tensors instead and receives, from each rank this rank sends rows to, a tensor of
        ``kv``'s dtype and the shape of those rows."""
        p2p = private(self.comm)
        two, B, Hkv, _, D = kv.shape
        if outgoing is None:
            outgoing = {}
            for x, runs in self.send.items():
                views = [kv[:, :, :, off:off + length] for _, length, off in runs]
                if views:
                    outgoing[x] = views[0].contiguous() if len(views) == 1 else torch.cat(views, dim=3)
            incoming = self.recv
        else:
            incoming = self.send
        # Every send before any receive, and every message packed first: a CUDA receive spins on the GPU until
        # its message lands, and a kernel launched behind it for the first time would wait for it (gpu.p2p).
        posted = [isend(t, group=p2p, tag=tag, group_dst=x) for x, t in sorted(outgoing.items())]
        got = {}
        for x, runs in sorted(incoming.items()):
            rows = sum(length for _, length, _ in runs)
            if rows:
                got[x] = kv.new_empty((two, B, Hkv, rows, D))
                posted.append(irecv(got[x], group=p2p, tag=tag, group_src=x))
        for h in posted:
            h.wait()
        return got

    def span(self, kv: torch.Tensor, got: dict, first: int, end: int) -> torch.Tensor:
        """The packed keys and values of positions [first, end): (2, B, Hkv, end - first, D)."""
        views = [(kv if src is None else got[src])[:, :, :, off:off + length]
                 for _, length, src, off in self.segments(first, end)]
        return views[0] if len(views) == 1 else torch.cat(views, dim=3)


@fails_group
def window_attention(comm, q, kv, lengths, layout, causal, scale, window) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in q's dtype, float32 LSE) of this rank's queries under the window (module docstring)."""
    halo = _Halo(comm, lengths, layout, window, causal)
    got = halo.exchange(kv, _KV_TAG)
    B, H, L, D = q.shape
    out = q.new_empty((B, H, L, D))
    lse = torch.empty((B, H, L), dtype=torch.float32, device=q.device)
    for lo, hi, first, end in halo.spans:
        keys = halo.span(kv, got, first, end)
        o, s = flash_attention(q[:, :, lo:hi], keys[0], keys[1], causal=causal, scale=scale, return_lse=True,
                               window=window)
        out[:, :, lo:hi] = o
        lse[:, :, lo:hi] = s
    return out, lse


@fails_group
def window_backward(comm, g, kv, lengths, layout, causal, scale, window) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq, dkv) of this rank; ``g``: (q, dout, out, lse, dlse), dlse None where no loss used the LSE."""
    q, dout, out, lse, dlse = g
    halo = _Halo(comm, lengths, layout, window, causal)
    got = halo.exchange(kv, _KV_TAG)
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=ct, device=q.device)
    dgot = {x: torch.zeros(t.shape, dtype=ct, device=q.device) for x, t in got.items()}
    for lo, hi, first, end in halo.spans:
        keys = halo.span(kv, got, first, end)
        a, dk, dv = flash_attention_backward(dout[:, :, lo:hi], q[:, :, lo:hi], keys[0], keys[1], out[:, :, lo:hi],
                                             lse[:, :, lo:hi], causal=causal, scale=scale, window=window,
                                             dlse=None if dlse is None else dlse[:, :, lo:hi], dtype=ct)
        dq[:, :, lo:hi] = a
        for at, length, src, off in halo.segments(first, end):
            dst = dkv if src is None else dgot[src]
            dst[0][:, :, off:off + length] += dk[:, :, at:at + length]
            dst[1][:, :, off:off + length] += dv[:, :, at:at + length]
    back = halo.exchange(dkv, _GRAD_TAG, outgoing=dgot)
    for x in sorted(back):  # the gradients of this rank's rows that rank x's spans read, in rank order
        at = 0
        for _, length, off in halo.send[x]:
            dkv[:, :, :, off:off + length] += back[x][:, :, :, at:at + length]
            at += length
    return dq, dkv

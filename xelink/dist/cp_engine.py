"""The local engine of context-parallel attention, shared by both backends: the float32 accumulator of
partials, the kernel calls of (query pieces, key block) pairs (``schedule.attend_parts``, coalesced), and the
``all_gather`` schedule (public collectives only, so it runs on CPU ranks and on CUDA tensors alike).
"""
from __future__ import annotations

import torch

from ..kernels import flash_attention, merge_attention
from . import schedule

__all__ = ["Accumulator", "attend", "needed", "gathered_runs", "gather_kv", "all_gather_attention"]


class Accumulator:
    """The running result over this rank's queries: ``out`` (B, Hq, S_local, D) and ``lse`` (B, Hq,
    S_local), float32, starting empty (0, -inf: a row without a partial weighs nothing in a merge)."""

    def __init__(self, q: torch.Tensor):
        B, H, S, D = q.shape
        self.out = torch.zeros((B, H, S, D), dtype=torch.float32, device=q.device)
        self.lse = torch.full((B, H, S), float("-inf"), dtype=torch.float32, device=q.device)
        self.written: list[tuple[int, int]] = []  # row ranges that hold a partial (a handful per call)

    def add(self, lo: int, hi: int, out: torch.Tensor, lse: torch.Tensor) -> None:
        acc, acc_lse = self.out[:, :, lo:hi], self.lse[:, :, lo:hi]
        part = out if out.dtype == torch.float32 else out.float()
        if all(b <= lo or hi <= a for a, b in self.written):  # the first partial of these rows: no merge
            acc.copy_(part)
            acc_lse.copy_(lse)
        else:
            _, merged = merge_attention([acc, part], [acc_lse, lse], out=acc)
            acc_lse.copy_(merged)
        self.written.append((lo, hi))

    def result(self, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.out.to(dtype), self.lse


def attend(acc: Accumulator, q: torch.Tensor, qpieces, kpieces, k: torch.Tensor, v: torch.Tensor,
           causal: bool, scale) -> int:
    """Add what this rank's queries (``qpieces``: ``schedule.local_pieces``) see of the keys ``k``, ``v`` (B, Hkv, L, D)
    to ``acc``, the keys' positions given as ``kpieces`` (``(global start, length, offset in k)``); returns the
    number of kernel calls made.

    The calls are ``schedule.attend_calls`` (split by ``attend_parts``, coalesced where the kernel allows)."""
    merged = schedule.attend_calls(qpieces, kpieces, causal)
    for lo, hi, ka, kb, c in merged:
        o, lse = flash_attention(q[:, :, lo:hi], k[:, :, ka:kb], v[:, :, ka:kb], causal=c, scale=scale,
                                 return_lse=True)
        acc.add(lo, hi, o, lse)
    return len(merged)


def needed(qpieces, kstart: int, klen: int, causal: bool) -> bool:
    """Whether any of this rank's queries sees a key of ``[kstart, kstart + klen)``."""
    return any(schedule.attend_parts((qs, qs + ql), (kstart, kstart + klen), causal) for qs, ql, _ in qpieces)


def gathered_runs(n: int, me: int, seq_len: int, layout: str) -> list[list[tuple[int, int, int]]]:
    """The other ranks' blocks in global order, grouped into runs of adjacent blocks; each block as
    ``(owner, offset in the owner's local sequence, length)``. Empty blocks are left out."""
    owned = {}
    for x in range(n):
        for start, length, off in schedule.rank_pieces(seq_len, n, layout, x):
            owned[start, length] = (x, off)
    runs, run = [], []
    for start, length in schedule.cp_blocks(seq_len, n, layout):
        x, off = owned[start, length]
        if x == me:
            if run:
                runs.append(run)
            run = []
        elif length:
            run.append((x, off, length))
    if run:
        runs.append(run)
    return runs


def gather_kv(comm, kv, lengths, start_gather):
    """Start the gather of every rank's packed KV, padded to the longest local length, with the backend's
    ``start_gather(comm, stage, send)``; returns ``(stage (n, 2, B, Hkv, lmax, D), handle with wait())``."""
    lmax = max(lengths)
    two, B, Hkv, L, D = kv.shape
    send = kv.new_empty((two, B, Hkv, lmax, D))
    send[:, :, :, :L].copy_(kv)
    if lmax > L:
        send[:, :, :, L:].zero_()  # moved but never read; zeros keep the bytes defined
    stage = kv.new_empty((comm.size, two, B, Hkv, lmax, D))
    return stage, start_gather(comm, stage, send)


def all_gather_attention(comm, q, kv, lengths, layout, causal, scale, start_gather):
    """``algo="all_gather"`` on either backend: gather the packed KV (``gather_kv``), attend to the own KV
    meanwhile, then to the other ranks' blocks run by run."""
    n, r = comm.size, comm.rank
    seq_len = sum(lengths)
    stage, work = gather_kv(comm, kv, lengths, start_gather)
    acc = Accumulator(q)
    qpieces = schedule.rank_pieces(seq_len, n, layout, r)
    attend(acc, q, qpieces, qpieces, kv[0], kv[1], causal, scale)
    work.wait()
    starts = {}
    for x in range(n):
        for start, length, off in schedule.rank_pieces(seq_len, n, layout, x):
            starts[x, off] = start
    for run in gathered_runs(n, r, seq_len, layout):
        x0, off0, _ = run[0]
        kstart, klen = starts[x0, off0], sum(length for _, _, length in run)
        if not needed(qpieces, kstart, klen, causal):
            continue
        views = [stage[x, :, :, :, off:off + length] for x, off, length in run]
        block = views[0] if len(views) == 1 else torch.cat(views, dim=3)
        attend(acc, q, qpieces, [(kstart, klen, 0)], block[0], block[1], causal, scale)
    return acc

"""Context-parallel attention over packed sequences (``cp_attention_varlen``): FlashAttention's
``flash_attn_varlen_func`` contract with the packed tokens laid over the ranks of a group, as ring-flash-attention's
``zigzag_ring_flash_attn_varlen_func`` and ``llama3_flash_attn_varlen_func`` are used in training on packed batches.

Layouts (``cp_shard(x, layout=..., dim=0, cu_seqlens=cu_seqlens)`` cuts a packed tensor; ``layout.varlen_pieces``):
``"zigzag"`` lays every sequence out on its own (2n blocks, rank r holding blocks r and 2n-1-r), sequence after
sequence, so every rank has the same causal work; ``"contiguous"`` cuts the packed stream (every sequence's tokens one
after another, ``cu_seqlens`` their global offsets, the same on every rank) into n blocks, a sequence lying inside
one block or running over several. Block sizes are ``numpy.array_split``'s.

How. Every rank gathers the others' keys and values (one ``all_gather_into_tensor`` of its packed (k, v) share,
padded to the longest) and runs ``flash_attention_varlen``: each of its pieces (a run of one sequence's tokens)
against that sequence's keys up to the piece's last token (causal; the whole sequence otherwise), the keys taken
from the gathered shares by index. A causal mask aligned to the end of the keys (FlashAttention 2.1+'s, which
``flash_attention_varlen`` keeps) is then exactly the global one, because a piece's last query is its last key;
windows likewise. One call holds at most one piece of a sequence (its keys then appear once): contiguous needs one
call, zigzag two (a sequence's first and second blocks). Nothing to merge; memory O(T) for the gathered keys during
the call, as the all-gather algorithm of ``cp_attention``.

Autograd (one ``torch.autograd.Function``): the forward keeps only this rank's q, k, v, output and LSE, not the
gathered keys (O(T) a layer, which a model's every layer would otherwise hold until its backward); the backward
gathers them again, runs ``flash_attention_varlen_backward`` on the forward's calls, adds each call's key and value
gradients into one float32 buffer of every rank's block (a call's keys are distinct, and the calls run in order:
deterministic) and sums it onto the owners with one ``reduce_scatter_tensor`` (in rank order). The backward is
collective: every rank of the group must back-propagate through its output (ranks that disagree about grad raise in
the forward), ranks without a token included.

Every check, and one host exchange of the call's signature (shapes, dtype, flags, grad, the offsets), run before any
byte moves, so ranks that disagree all raise the same error instead of hanging.

Not traced by ``torch.compile`` (a graph break: the call reads the offsets on the host) and refused during CUDA-graph
capture for the same reason.
"""
from __future__ import annotations

import bisect
import functools
import hashlib

import torch

from ..collectives import all_gather_into_tensor, reduce_scatter_tensor
from ..collectives.checks import group_of
from ..kernels import flash_attention_varlen, flash_attention_varlen_backward
from ..layout import varlen_pieces
from .cp_attention import _check_flags, _check_qkv, _exchange_lengths, _layout, _offsets
from .schedule import local_pieces

__all__ = ["cp_attention_varlen"]


def _lengths(fn: str, comm, cu: list, layout: str, local: int, signature: tuple) -> list:
    """The ranks' token counts (their ``varlen_pieces``), checked against every rank's ``local``; above one rank after
    one host exchange of (``local``, ``signature``: shapes but the local length, dtype, device type, layout, flags,
    grad, a digest of the offsets), so that a difference raises the same error on every rank."""
    n = comm.size
    want = [sum(length for _, length in varlen_pieces(cu, n, layout, x)) for x in range(n)]
    got = [local]
    if n > 1:
        got = _exchange_lengths(fn, comm, local, signature, "heads, head_dim, dtype, device, layout, causal, scale, "
                                                           "window, return_lse, which of q, k, v require grad, "
                                                           "heads_k_stride, a digest of cu_seqlens")
    if got != want:
        raise ValueError(f"{fn}: the ranks' local token counts {got} are not those of layout={layout!r} for "
                         f"cu_seqlens={cu} over {n} ranks ({want}); cut the packed tensors with "
                         f"xelink.cp_shard(x, layout={layout!r}, dim=0, cu_seqlens=cu_seqlens)")
    return want


def _gather(k, v, comm, lengths: list, heads: tuple):
    """Start gathering every rank's (k, v) block of KV heads ``heads`` (lo, hi), padded to the longest block, in rank
    order: ((n, 2, P, hi - lo, D), the pending collective's work or None, its input: kept until the work is done)."""
    kv = torch.stack([k[:, heads[0]:heads[1]], v[:, heads[0]:heads[1]]])  # (2, T_local, h, D)
    if comm.size == 1:
        return kv[None], None, None
    P = max(lengths)
    if kv.shape[1] < P:
        kv = torch.cat([kv, kv.new_zeros((2, P - kv.shape[1]) + tuple(kv.shape[2:]))], dim=1)
    kv = kv.contiguous()
    out = kv.new_empty((comm.size,) + tuple(kv.shape))
    return out, all_gather_into_tensor(out, kv, group=comm, async_op=True), kv


def _gathered_chunks(k, v, comm, lengths: list, chunks: list):
    """Each chunk of KV heads' gathered (k, v) (``_gather``), in order, the next chunk's gather in flight while the
    caller works on one."""
    pending = _gather(k, v, comm, lengths, chunks[0])
    for i in range(len(chunks)):
        kv_all, work, _ = pending
        if work is not None:
            work.wait()
        if i + 1 < len(chunks):
            pending = _gather(k, v, comm, lengths, chunks[i + 1])
        yield kv_all


def _rows(x, rows, dim: int = 0):
    """A call's rows of ``x`` (None: one call, every row in order), or None for None."""
    return x if rows is None or x is None else x.index_select(dim, rows)


def _owners(cu: list, n: int, layout: str):
    """(owner rank, offset in the owner's block) of every packed token: two CPU long tensors of T."""
    owner = torch.empty(cu[-1], dtype=torch.long)
    offset = torch.empty(cu[-1], dtype=torch.long)
    for x in range(n):
        for start, length, at in local_pieces(varlen_pieces(cu, n, layout, x)):
            owner[start:start + length] = x
            offset[start:start + length] = torch.arange(at, at + length)
    return owner, offset


def _calls(cu: list, pieces, causal: bool) -> list:
    """This rank's ``flash_attention_varlen`` calls: each a list of its pieces as (local offset, length, keys' global
    start, end), at most one piece of a sequence a call (a zigzag rank's two pieces of a sequence read overlapping
    keys). A piece's keys run from its sequence's start to its own last token (causal) or the sequence's end."""
    calls, seen = [], {}
    for start, length, at in local_pieces(pieces):
        i = bisect.bisect_right(cu, start) - 1  # the sequence holding the piece: cu[i] <= start < cu[i + 1]
        c = seen[i] = seen.get(i, -1) + 1
        if c == len(calls):
            calls.append([])
        calls[c].append((at, length, cu[i], start + length if causal else cu[i + 1]))
    return calls


def _ranges(spans) -> torch.Tensor:
    """The indices of the ranges ``(start, end)``, concatenated (a CPU long tensor)."""
    return torch.cat([torch.arange(a, b) for a, b in spans])


@functools.lru_cache(maxsize=32)
def _plan(cu: tuple, n: int, r: int, layout: str, causal: bool, dev: torch.device):
    """A call's work, on ``dev``, remembered (a step's layers share one batch's offsets, so their kernel calls get the
    same offset tensors, whose values flash_attention_varlen then reads on the host once): for each call, (the
    gathered keys' owner ranks and offsets, this rank's rows or None for all of them in order, cu_q, cu_k, the
    longest query and key runs); and the permutation putting the calls' rows back in local order (None for one
    call)."""
    owner, offset = _owners(list(cu), n, layout)
    pieces = varlen_pieces(cu, n, layout, r)
    total = sum(length for _, length in pieces)
    calls, rows = [], []
    for call in _calls(list(cu), pieces, causal):
        keys = _ranges([(a, b) for _, _, a, b in call])
        mine = _ranges([(at, at + length) for at, length, _, _ in call])
        rows.append(mine)
        cu_q, cu_k = [0], [0]
        for _, length, a, b in call:
            cu_q.append(cu_q[-1] + length)
            cu_k.append(cu_k[-1] + b - a)
        calls.append((owner[keys].to(dev), offset[keys].to(dev), None if len(mine) == total else mine.to(dev),
                      torch.tensor(cu_q, dtype=torch.int32, device=dev), torch.tensor(cu_k, dtype=torch.int32,
                                                                                       device=dev),
                      max(length for _, length, _, _ in call), max(b - a for _, _, a, b in call)))
    where = None
    if len(calls) > 1:
        where = torch.empty(total, dtype=torch.long)
        where[torch.cat(rows)] = torch.arange(total)
        where = where.to(dev)
    return calls, where


@torch.compiler.disable
def cp_attention_varlen(q, k, v, cu_seqlens, max_seqlen=None, *, causal: bool = False, scale=None, group=None,
                        layout: str = "zigzag", window=None, return_lse: bool = False, heads_k_stride=None):
    """Attention of this rank's block of packed sequences over their keys on every rank.

    Args:
        q: (T_local, Hq, D) this rank's share of the packed queries, ``cp_shard(x, layout=layout, dim=0,
            cu_seqlens=cu_seqlens)`` of the (T, Hq, D) packed tensor, T = cu_seqlens[-1]; float64, float32, float16
            or bfloat16; a CPU tensor or a CUDA tensor on this rank's device; any strides.
        k, v: (T_local, Hkv, D) the same tokens' keys and values; Hq divisible by Hkv (GQA: only KV heads move).
        cu_seqlens: (B + 1,) int32/int64 global offsets of the packed sequences (0, nondecreasing, ending at T),
            the same on every rank, on any device (read on the host; on a GPU once a tensor and version, as
            ``flash_attention_varlen``'s: write them through torch ops or pass a new tensor).
        max_seqlen: None, or an int at least the longest sequence (only checked: the offsets are read anyway).
        causal, scale, window: ``flash_attention_varlen``'s, over each whole sequence (global positions).
        group: xelink communicator (None: the world).
        layout: "zigzag" (each sequence cut into 2n blocks, rank r holding blocks r and 2n-1-r of every sequence:
            every rank the same causal work, ring-flash-attention's zigzag varlen) or "contiguous" (the packed tokens
            cut into n blocks, a sequence possibly over several: its llama3 varlen).
        return_lse: also return the float32 LSE of this rank's rows, (Hq, T_local) (FlashAttention 2's layout).
        heads_k_stride: None (every KV head at once) or an int >= 1: the keys are gathered and attended that many KV
            heads at a time (their query heads with them), the next heads' gather in flight meanwhile, so a call holds
            the gathered keys of that many heads only (ring-flash-attention's llama3 varlen argument).

    Returns:
        out (T_local, Hq, D) in q's dtype, equal to ``flash_attention_varlen`` over the whole packed batch restricted
        to this rank's tokens; or (out, lse).

    Raises:
        TypeError / ValueError: bad tensors, offsets, flags or layout, before anything is sent; after the
            signature exchange (every rank raises the same): ranks that disagree, or a local share that is not the
            layout's. RuntimeError: during CUDA-graph capture.

    Collective: every rank of ``group`` calls it with the same offsets, heads, head dim, dtype and flags, and with
    grad every rank runs the backward too.
    """
    fn = "cp_attention_varlen"
    comm = group_of(group, fn)
    _check_qkv(fn, q, k, v, comm, packed=True)
    scale = _check_flags(fn, causal, scale, return_lse, window)
    layout = _layout(fn, layout)
    cu = _offsets(fn, cu_seqlens, max_seqlen)
    if heads_k_stride is not None and (isinstance(heads_k_stride, bool) or not isinstance(heads_k_stride, int) or
                                       heads_k_stride < 1):
        raise ValueError(f"{fn}: heads_k_stride={heads_k_stride!r} must be None or an int >= 1")
    hkv = k.shape[1]
    stride = min(heads_k_stride or hkv, hkv)
    chunks = [(h, min(h + stride, hkv)) for h in range(0, hkv, stride)]
    n, r = comm.size, comm.rank
    grad = tuple(torch.is_grad_enabled() and t.requires_grad for t in (q, k, v))
    signature = (q.shape[1], hkv, q.shape[2], str(q.dtype), q.device.type, layout, causal, scale, window,
                 return_lse, grad, stride, hashlib.sha1(repr(cu).encode()).hexdigest())
    lengths = _lengths(fn, comm, cu, layout, q.shape[0], signature)
    plan = _plan(tuple(cu), n, r, layout, causal, q.device)
    out, lse = _Attend.apply(q, k, v, comm, lengths, plan, chunks, (causal, scale, window))
    return (out, lse) if return_lse else out


class _Attend(torch.autograd.Function):
    """The gather and the calls of ``_plan``; saves the local tensors only and gathers again in the backward (module
    docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, comm, lengths, plan, chunks, flags):
        causal, scale, window = flags
        calls, where = plan
        g = q.shape[1] // k.shape[1]
        outs, lses = [[] for _ in calls], [[] for _ in calls]
        for (lo, hi), kv_all in zip(chunks, _gathered_chunks(k, v, comm, lengths, chunks)):
            for c, (owners, offsets, rows, cu_q, cu_k, max_q, max_k) in enumerate(calls):
                kvk = kv_all[owners, :, offsets]  # (keys, 2, hi - lo, D), no key twice in a call
                o, l = flash_attention_varlen(_rows(q[:, g * lo:g * hi], rows), kvk[:, 0], kvk[:, 1], cu_q, cu_k,
                                              max_q, max_k, causal=causal, scale=scale, return_lse=True,
                                              window=window)
                outs[c].append(o)
                lses[c].append(l)
        outs = [torch.cat(o, 1) if len(o) > 1 else o[0] for o in outs]  # each call's heads together
        lses = [torch.cat(l, 0) if len(l) > 1 else l[0] for l in lses]
        if not calls:  # no query token here
            out, lse = q.new_empty(q.shape), torch.empty((q.shape[1], 0), dtype=torch.float32, device=q.device)
        elif where is None:
            out, lse = outs[0], lses[0]
        else:  # the calls' rows back in local order
            out, lse = torch.cat(outs).index_select(0, where), torch.cat(lses, 1).index_select(1, where)
        ctx.comm, ctx.lengths, ctx.plan, ctx.chunks, ctx.flags = comm, lengths, plan, chunks, flags
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.set_materialize_grads(False)  # an unused LSE's gradient comes as None: the kernels skip its term
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:  # only the LSE was used
            dout = torch.zeros_like(out)
        causal, scale, window = ctx.flags
        comm, lengths, chunks = ctx.comm, ctx.lengths, ctx.chunks
        g = q.shape[1] // k.shape[1]
        ctype = torch.float32 if q.dtype != torch.float64 else q.dtype
        dkv_all = torch.zeros((comm.size, 2, max(lengths)) + tuple(k.shape[1:]), dtype=ctype, device=q.device)
        dq = torch.empty(q.shape, dtype=ctype, device=q.device)
        for (lo, hi), kv_all in zip(chunks, _gathered_chunks(k, v, comm, lengths, chunks)):
            qh = slice(g * lo, g * hi)
            for owners, offsets, rows, cu_q, cu_k, max_q, max_k in ctx.plan[0]:
                kvk = kv_all[owners, :, offsets]
                a, dk, dv = flash_attention_varlen_backward(
                    _rows(dout[:, qh], rows), _rows(q[:, qh], rows), kvk[:, 0], kvk[:, 1], _rows(out[:, qh], rows),
                    _rows(lse[qh], rows, 1), cu_q, cu_k, max_q, max_k, causal, scale,
                    dlse=None if dlse is None else _rows(dlse[qh], rows, 1), dtype=ctype, window=window)
                if rows is None:
                    dq[:, qh] = a
                else:
                    dq[rows, qh] = a
                dkv_all[owners, :, offsets, lo:hi] += torch.stack([dk, dv], dim=1)  # distinct keys: a plain add
        mine = dkv_all[0]
        if comm.size > 1:
            mine = torch.empty(dkv_all.shape[1:], dtype=dkv_all.dtype, device=q.device)
            reduce_scatter_tensor(mine, dkv_all, group=comm)
        L = q.shape[0]
        return (dq.to(q.dtype), mine[0, :L].to(k.dtype), mine[1, :L].to(v.dtype), None, None, None, None, None)

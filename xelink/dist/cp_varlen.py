"""Context-parallel attention over packed sequences (``cp_attention_varlen``): FlashAttention's
``flash_attn_varlen_func`` contract with the packed tokens cut over the ranks of a group, as
ring-flash-attention's ``llama3_flash_attn_varlen_func`` is used in training on packed batches.

Layout. The packed stream (every sequence's tokens one after another, ``cu_seqlens`` their global offsets, the
same on every rank) is cut into the ranks' contiguous blocks: ``cp_shard(x, layout="contiguous", dim=0)`` gives rank r
its block (``numpy.array_split``'s sizes: the first ``T % n`` ranks hold one token more). A sequence may lie inside
one rank's block or run over several.

How. Every rank gathers the others' keys and values (one ``all_gather_into_tensor`` of its packed (k, v) block,
padded to the longest block) and runs one ``flash_attention_varlen`` call: for each sequence its queries on this
rank (a contiguous run) against its keys up to this rank's last token (causal; the whole sequence otherwise). A
causal mask aligned to the end of the keys (FlashAttention 2.1+'s, which ``flash_attention_varlen`` keeps) is then
exactly the global one, because the run's last query is the last key; windows likewise. Nothing to merge; memory
O(T) for the gathered keys, as the all-gather algorithm of ``cp_attention``.

Autograd: the gather is differentiable (its backward a ``reduce_scatter_tensor`` of the gathered keys' and values'
gradients, summed in rank order: every rank's gradient of its own block, deterministic), and
``flash_attention_varlen`` is, so dq, dk and dv (and the LSE's gradient) come from the same graph. The backward is
collective: every rank of the group must back-propagate through its output (ranks that disagree about grad raise in
the forward). Every check, and one host exchange of the call's signature (shapes, dtype, flags, grad, the offsets),
run before any byte moves, so ranks that disagree all raise the same error instead of hanging.

Not traced by ``torch.compile`` (a graph break: the call reads the offsets on the host) and refused during CUDA-graph
capture for the same reason.
"""
from __future__ import annotations

import hashlib

import torch

from ..collectives import all_gather_into_tensor, reduce_scatter_tensor
from ..collectives.checks import group_of
from ..kernels import flash_attention_varlen
from . import schedule
from .cp_attention import _check_flags, _check_qkv, _exchange_lengths

__all__ = ["cp_attention_varlen"]


def _offsets(fn: str, cu_seqlens, max_seqlen) -> list:
    """``cu_seqlens`` read on the host and checked: 0, then nondecreasing (zero-length sequences allowed)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{fn}: cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{fn}: cu_seqlens must be a 1-D int32/int64 tensor of (sequences + 1) offsets, got "
                         f"{tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
    if cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{fn}: cannot run during CUDA-graph capture (it reads cu_seqlens on the host)")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{fn}: cu_seqlens={cu} must start at 0 and never decrease")
    longest = max(b - a for a, b in zip(cu, cu[1:]))
    if max_seqlen is not None:
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < longest:
            raise ValueError(f"{fn}: max_seqlen={max_seqlen!r} must be None or an int >= the longest sequence "
                             f"({longest})")
    return cu


def _lengths(fn: str, comm, total: int, local: int, signature: tuple) -> list:
    """The ranks' token counts (``cp_lengths`` of the total), checked against every rank's ``local``; above one rank
    after one host exchange of (``local``, ``signature``: shapes but the local length, dtype, device type, flags,
    grad, a digest of the offsets), so that a difference raises the same error on every rank."""
    n = comm.size
    want = schedule.cp_lengths(total, n, "contiguous")
    got = [local]
    if n > 1:
        got = _exchange_lengths(fn, comm, local, signature, "heads, head_dim, dtype, device, causal, scale, window, "
                                                           "return_lse, which of q, k, v require grad, a digest of "
                                                           "cu_seqlens")
    if got != want:
        raise ValueError(f"{fn}: the ranks' local token counts {got} are not the contiguous blocks of "
                         f"cu_seqlens[-1]={total} tokens over {n} ranks ({want}); cut the packed tensors with "
                         f"xelink.cp_shard(x, layout='contiguous', dim=0)")
    return want


class _GatherKV(torch.autograd.Function):
    """Every rank's padded (k, v) block, gathered in rank order: (n, 2, P, Hkv, D); the backward sums every rank's
    gradient of block r into rank r (``reduce_scatter_tensor``)."""

    @staticmethod
    def forward(ctx, kv, comm):
        ctx.comm = comm
        out = kv.new_empty((comm.size,) + tuple(kv.shape))
        all_gather_into_tensor(out, kv, group=comm)
        return out

    @staticmethod
    def backward(ctx, grad):
        mine = grad.new_empty(grad.shape[1:])
        reduce_scatter_tensor(mine, grad.contiguous(), group=ctx.comm)
        return mine, None


def _runs(cu: list, lo: int, hi: int, causal: bool):
    """This rank's sequences (those with tokens in its block [lo, hi)): (their query offsets into the block, their
    key offsets into the keys from the first one's start, the keys' global [start, end); None, None without one).
    A sequence's keys end at its last token (causal: at its last token in the block)."""
    cu_q, cu_k = [0], [0]
    first = end = None
    for a, b in zip(cu, cu[1:]):
        if b <= lo or a >= hi or a == b:
            continue
        k_end = min(b, hi) if causal else b
        if first is None:
            first = a
        cu_q.append(cu_q[-1] + min(b, hi) - max(a, lo))
        cu_k.append(k_end - first)
        end = k_end
    return cu_q, cu_k, first, end


@torch.compiler.disable
def cp_attention_varlen(q, k, v, cu_seqlens, max_seqlen=None, *, causal: bool = False, scale=None, group=None,
                        window=None, return_lse: bool = False):
    """Attention of this rank's block of packed sequences over their keys on every rank.

    Args:
        q: (T_local, Hq, D) this rank's block of the packed queries: ``cp_shard(x, layout="contiguous", dim=0)`` of
            the (T, Hq, D) packed tensor, T = cu_seqlens[-1]; float64, float32, float16 or bfloat16; a CPU tensor or
            a CUDA tensor on this rank's device; any strides.
        k, v: (T_local, Hkv, D) the same tokens' keys and values; Hq divisible by Hkv (GQA: only KV heads move).
        cu_seqlens: (B + 1,) int32/int64 global offsets of the packed sequences (0, nondecreasing, ending at T),
            the same on every rank, on any device (read on the host).
        max_seqlen: None, or an int at least the longest sequence (only checked: the offsets are read anyway).
        causal, scale, window: ``flash_attention_varlen``'s, over each whole sequence (global positions).
        group: xelink communicator (None: the world).
        return_lse: also return the float32 LSE of this rank's rows, (Hq, T_local) (FlashAttention 2's layout).

    Returns:
        out (T_local, Hq, D) in q's dtype, equal to ``flash_attention_varlen`` over the whole packed batch restricted
        to this rank's tokens; or (out, lse).

    Raises:
        TypeError / ValueError: bad tensors, offsets, flags, or a local block that is not this rank's share of T,
            before anything is sent; after the signature exchange (every rank raises the same): ranks that
            disagree. RuntimeError: during CUDA-graph capture.

    Collective: every rank of ``group`` calls it with the same offsets, heads, head dim, dtype and flags, and with
    grad every rank runs the backward too.
    """
    fn = "cp_attention_varlen"
    comm = group_of(group, fn)
    _check_qkv(fn, q, k, v, comm, packed=True)
    scale = _check_flags(fn, causal, scale, return_lse, window)
    cu = _offsets(fn, cu_seqlens, max_seqlen)
    n, r = comm.size, comm.rank
    grad = tuple(torch.is_grad_enabled() and t.requires_grad for t in (q, k, v))
    signature = (q.shape[1], k.shape[1], q.shape[2], str(q.dtype), q.device.type, causal, scale, window, return_lse,
                 grad, hashlib.sha1(repr(cu).encode()).hexdigest())
    lengths = _lengths(fn, comm, cu[-1], q.shape[0], signature)
    lo = sum(lengths[:r])
    hi = lo + lengths[r]
    if n == 1:
        kv_all = None
        keys, values = k, v
    else:
        # every rank's (k, v) block padded to the longest, gathered; then the global tokens in order
        P = max(lengths)
        kv = torch.stack([k, v]).contiguous()
        if kv.shape[1] < P:
            kv = torch.cat([kv, kv.new_zeros((2, P - kv.shape[1]) + tuple(kv.shape[2:]))], dim=1)
        kv_all = _GatherKV.apply(kv, comm)
        blocks = [kv_all[j, :, :lengths[j]] for j in range(n)]
        whole = torch.cat(blocks, dim=1)
        keys, values = whole[0], whole[1]
    cu_q, cu_k, first, end = _runs(cu, lo, hi, causal)
    if first is None:  # no query token here: an empty output that still reaches the gather's backward
        out = q.clone()  # (0, Hq, D), grad flows to q
        lse = torch.full((q.shape[1], 0), float("-inf"), dtype=torch.float32, device=q.device)
        if kv_all is not None and kv_all.requires_grad:
            out = out + kv_all.reshape(-1)[:0].sum()  # (+ 0 exactly; zeros flow back)
        return (out, lse) if return_lse else out
    dev = q.device
    cu_q_t = torch.tensor(cu_q, dtype=torch.int32, device=dev)
    cu_k_t = torch.tensor(cu_k, dtype=torch.int32, device=dev)
    max_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
    max_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))
    out, lse = flash_attention_varlen(q, keys[first:end], values[first:end], cu_q_t, cu_k_t, max_q, max_k,
                                      causal=causal, scale=scale, return_lse=True, window=window)
    return (out, lse) if return_lse else out

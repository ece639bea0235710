"""A Llama-style decoder (Llama 2 / 3.x, Mistral, Qwen2, Qwen3, Phi-3 / Phi-4; full attention) on xelink's kernels.

The model reads as a one-device model: embedding, then per layer RMSNorm (the residual add fused in),
fused QKV projection, RoPE, attention over the KV cache, O projection, RMSNorm, fused gate/up, SwiGLU,
down projection; a final norm and the head. Tensor parallelism is applied from outside
(``parallel.TensorParallel``): it chooses the slices each rank loads, and its collectives ride in the
row-parallel ``Linear``s (``reduce``) and the head (``gather_vocab``); nothing here knows the rank.

Ops (``impl``): ``"reference"`` runs the pure-torch twins (``xelink.kernels.reference_*``), ``"xelink"``
requires xelink's kernels (a GPU and bf16/fp16, checked at load; each kernel then takes its fastest xelink
path) and xelink's collectives, ``"auto"`` lets each kernel pick (the references on CPU and for dtypes the
kernels do not take). The decode step (``decode``) runs without host synchronization and is captured
whole in a CUDA graph by ``decode_graph``, which ``generate`` replays a token. Projections of 1-8 rows go
through ``gemv`` (any weight format), more rows through ``gemm`` (quantized weights dequantized first). A decode
step of tiled W4A16 projections on the CUDA C++ GEMV (one device, ``gemv_norm.CU_FOLD``, off until measured on a
GPU) folds each layer's RMSNorms into the GEMVs around them (``gemv_residual``: the residual add and the next
norm's weight at the O and down projections' store; ``gemv_rms``: each row's ``1 / rms`` on the QKV and gate/up
sums), two launches a layer fewer.

Sequences of a batch may have different lengths: a prompt chunk comes left-padded with an
``attention_mask``; each sequence's real tokens sit at cache positions ``start[b] ..``, so its RoPE
positions and its cache hold no padding. Attention and the cache are one object, ``KVCache``.

Context parallelism (``cp_group`` of n > 1 ranks, ``parallel.ContextParallel``) plugs in as another cache
with the same ``attend``, ``CPKVCache``. The prompt (one call at ``start_pos`` 0, every rank given all of it)
is computed on this rank's zigzag shard of the positions only (RoPE at their global positions), its
attention through ``xelink.cp_attention``; each rank caches the KV of its positions; the final hidden states
are gathered (``cp_unshard``) before the head, so every rank returns the logits of every position. A ragged
(left-padded) prompt's real tokens are packed and each row's laid out on its own (``cp_shard`` with their offsets,
``xelink.cp_attention_varlen``). A decode token (one per sequence, each at its row's position) is computed on every
rank; its KV is cached on rank ``position % n`` only, at a slot its position gives (``CPKVCache``: no host state, so
the step runs in ``decode`` and a CUDA graph as without CP); each rank attends the token's query to its own cached
keys of its row (all in the past: no mask) and the partials are merged by their LSE across the CP group. A chunk of
tokens after the prompts (a follow-up turn over a long cached document, or a prompt prefilled in chunks after its
first) is computed like decode tokens, on every rank: each position's KV cached on its owner, each rank attending the
chunk to its cached keys of the row and rank 0 to the chunk's own (causal), the partials merged. A sliding-window
layer (``CPRingCache``) computes the prompt on the shards too (``cp_attention``'s window), then gathers each row's
last ``window`` keys into a ring every rank holds, and attends later tokens to it as without CP. Under CP a token
inside its row's prompt raises ValueError.
"""
from __future__ import annotations

import importlib.util
import numbers
import operator
import sys
from pathlib import Path

import torch

from .. import cp_attention, cp_attention_varlen
from ..kernels import (decode_attention, flash_attention, gemm, gemv, gemv_residual, gemv_rms, norm_folds, qgemm,
                       reference_decode_attention, reference_flash_attention, reference_gemv, reference_rmsnorm,
                       reference_rope, reference_rope_decode_attention, reference_silu_mul, rmsnorm, rope,
                       rope_decode_attention, silu_mul, tiled_w4a16_native)
from ..kernels.common import gc_paused
from .checkpoint import (Checkpoint, LlamaConfig, RandomWeights, _resolve_config, head_tensor, read_json,
                         rope_inv_freq, tensor_shapes)
from .generate import generate, settings_of_model_config
from .parallel import ContextParallel, Linear, TensorParallel, check_groups, check_xelink_collectives

__all__ = ["CPKVCache", "CPRingCache", "DecodeGraph", "IMPLS", "KVCache", "Llama", "MAX_SEQ_LEN_DEFAULT",
           "Ops"]

IMPLS = ("auto", "xelink", "reference")
MAX_SEQ_LEN_DEFAULT = 8192
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_GEMV_ROWS = 8
# MiB of each layer's O projection weight at most that the decode step's attention asks L2 for once its keys are
# read (rope_decode_attention's prefetch, at 4K keys and more: HBM is idle while the splits end and the O GEMV
# starts); 0: none. 64: the whole weight of an 8B model (H100: 0.85% / 0.7% faster steps at 8K / 32K).
PREFETCH_O_MB = 64


class Ops:
    """The model's local ops on one path: ``"reference"`` (pure torch), ``"xelink"`` (xelink's kernels: the
    model checked at load that they can run, a GPU and bf16/fp16) or ``"auto"`` (each kernel's own choice).
    Both pass ``impl="auto"`` to the kernels, which on a GPU picks each kernel's fastest xelink path (gemv's
    and gemm's ``"cuda"`` kernels where they apply, else the portable Triton ones), never a torch op."""

    def __init__(self, impl: str, dtype: torch.dtype):
        self.impl, self.dtype = impl, dtype
        self.ref = impl == "reference"
        self.kimpl = "auto"
        # gemv/gemm take bf16/fp16 only: other dtypes go through the reference under "auto".
        self.dense_ref = self.ref or dtype not in _KERNEL_DTYPES

    @staticmethod
    def gemv_format(lin: Linear, x: torch.Tensor) -> str:
        """``lin``'s GEMV format for activations ``x``: its quantized format, or x's half dtype for dense."""
        return lin.fmt if lin.fmt != "dense" else ("bf16" if x.dtype == torch.bfloat16 else "fp16")

    def linear(self, lin: Linear, x: torch.Tensor) -> torch.Tensor:
        """``[M, K] -> [M, N]``: the projection, the TP sum of a row-parallel one, its bias."""
        fmt = self.gemv_format(lin, x)
        if self.dense_ref:
            y = reference_gemv(lin.weight, x, lin.scales, fmt if lin.fmt != "dense" else "bf16")
        elif x.shape[0] <= _GEMV_ROWS:
            y = gemv(lin.weight, x, lin.scales, fmt, self.kimpl)
        elif lin.fmt != "dense":  # quantized, more rows than a GEMV's: dequantized inside the GEMM's tiles
            y = qgemm(lin.weight, x, lin.scales, lin.fmt, self.kimpl)
        else:
            y = gemm(x, lin.weight.t(), self.kimpl)
        if lin.reduce is not None:
            y = lin.reduce(y.contiguous())
        if lin.bias is not None:
            y = y + lin.bias
        return y

    def rmsnorm(self, x, w, eps, residual=None):
        if self.ref:
            return reference_rmsnorm(x, w, eps, residual)
        return rmsnorm(x, w, eps, residual, impl=self.kimpl)

    def rope(self, q, k, cos, sin):
        return reference_rope(q, k, cos, sin) if self.ref else rope(q, k, cos, sin, impl=self.kimpl)

    def gemv_rms(self, lin: Linear, x: torch.Tensor, h: torch.Tensor, eps: float, act: str | None = None):
        """``lin``'s projection of ``x`` (``h * norm_weight``) scaled by each row's ``1 / rms(h)`` (the folded
        norm: kernels.gemv_rms)."""
        return gemv_rms(lin.weight, x, lin.scales, lin.fmt, h, eps, self.kimpl, act=act)

    def gemv_residual(self, lin: Linear, x: torch.Tensor, h: torch.Tensor, norm_weight: torch.Tensor | None):
        """``lin``'s projection of ``x`` added into the residual ``h`` in place; returns ``h * norm_weight`` (the
        next norm's input before its ``1 / rms``: kernels.gemv_residual)."""
        return gemv_residual(lin.weight, x, lin.scales, lin.fmt, h, norm_weight, self.kimpl)

    def silu_mul(self, x):
        return reference_silu_mul(x) if self.ref else silu_mul(x, impl=self.kimpl)

    def gate_up(self, lin: Linear, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU's ``silu(x @ gate^T) * (x @ up^T)`` of a fused ``[gate; up]`` projection: at decode (a GEMV
        without a TP sum or bias) one launch, ``gemv(act="silu_mul")``; else the projection, then silu_mul."""
        if self.dense_ref or x.shape[0] > _GEMV_ROWS or lin.reduce is not None or lin.bias is not None:
            return self.silu_mul(self.linear(lin, x))
        return gemv(lin.weight, x, lin.scales, self.gemv_format(lin, x), self.kimpl, act="silu_mul")

    def attention(self, q, k, v, causal: bool, return_lse: bool = False, window: int | None = None):
        if self.ref:
            return reference_flash_attention(q, k, v, causal=causal, return_lse=return_lse, window=window)
        return flash_attention(q, k, v, causal=causal, return_lse=return_lse, impl=self.kimpl, window=window)

    def decode_attention(self, q, k_cache, v_cache, kv_lens):
        """(out, lse) of ``q`` (B, Hq, 1, D) over each row's first ``kv_lens[b]`` cached keys."""
        if self.ref:
            return reference_decode_attention(q, k_cache, v_cache, kv_lens, return_lse=True)
        return decode_attention(q, k_cache, v_cache, kv_lens, return_lse=True, impl=self.kimpl)

    def rope_decode_attention(self, q, k, v, cos, sin, k_cache, v_cache, kv_lens, prefetch=None,
                              window: int | None = None, ring: bool = False):
        if self.ref:
            return reference_rope_decode_attention(q, k, v, cos, sin, k_cache, v_cache, kv_lens, window=window,
                                                   ring=ring)
        return rope_decode_attention(q, k, v, cos, sin, k_cache, v_cache, kv_lens, impl=self.kimpl, prefetch=prefetch,
                                     window=window, ring=ring)


class KVCache:
    """One layer's keys and values for ``batch`` sequences, and attention over them.

    ``k, v``: ``(batch, kv_heads, max_seq_len, head_dim)``. Sequence b's real tokens sit at positions
    ``0 .. len[b] - 1`` (no padding inside). This object is the model's one attention call site: a
    context-parallel cache (each CP rank holding a shard of the positions) replaces it with the same
    ``attend``. ``window``: the layer's sliding window (a query sees its last ``window`` positions), or None.

    A sliding-window layer whose window is shorter than ``max_seq_len`` keeps only what its queries can still see
    (``ring``, as transformers' sliding-window caches): ``window`` rows, position p at row ``p % window`` (keys are
    stored rotated, so their order does not matter to attention), whatever the context.
    """

    def __init__(self, batch: int, kv_heads: int, max_seq_len: int, head_dim: int, dtype, device,
                 window: int | None = None):
        self.window = window
        self.ring = window is not None and window < max_seq_len
        shape = (batch, kv_heads, window if self.ring else max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def row(self, position: int) -> int:
        """The cache row that holds ``position``."""
        return position % self.window if self.ring else position

    def hold(self, batch: int, position: int):
        """A function that puts back what a decode of ``batch`` rows at ``position`` writes (its cache row):
        ``DecodeGraph``'s warm-up."""
        r = self.row(position)
        k, v = self.k[:batch, :, r].clone(), self.v[:batch, :, r].clone()

        def restore():
            self.k[:batch, :, r], self.v[:batch, :, r] = k, v
        return restore

    def decode(self, q, k, v, cos, sin, positions: torch.Tensor, kv_lens: torch.Tensor, ops: Ops,
               prefetch=None) -> torch.Tensor:
        """One token per sequence, before RoPE: rotate q and k at ``positions[b]`` (rows of the ``cos``/``sin``
        tables), write k and v there and attend over positions ``0 .. positions[b]`` (``kv_lens = positions +
        1``), in one launch (``rope_decode_attention``); [B] tensors on the cache's device, no host
        synchronization (a CUDA graph can hold it). q: ``(B, Hq, 1, D)``; k, v: ``(B, Hkv, 1, D)``; ``prefetch``:
        what the kernel asks L2 for (the next GEMV's weight), or None."""
        B = q.shape[0]
        return ops.rope_decode_attention(q, k, v, cos, sin, self.k[:B], self.v[:B], kv_lens, prefetch,
                                         None if self.ring else self.window, self.ring)

    def attend(self, q, k, v, starts: list, pads: list, ops: Ops) -> torch.Tensor:
        """Write this chunk's keys and values, then attend.

        Args:
            q: ``(B, Hq, S, D)``; k, v: ``(B, Hkv, S, D)`` (after RoPE) of a chunk whose row b holds ``pads[b]``
                left pads then real tokens at positions ``starts[b] ..``.
            starts, pads: per-sequence host ints.
            ops: the local ops.

        Returns:
            ``(B, Hq, S, D)``: attention of each real token over its sequence's cache (causal); pads give 0.
        """
        if self.ring:
            return self._attend_ring(q, k, v, starts, pads, ops)
        B, _, S, _ = q.shape
        for b in range(B):
            n = S - pads[b]
            self.k[b, :, starts[b]:starts[b] + n] = k[b, :, pads[b]:]
            self.v[b, :, starts[b]:starts[b] + n] = v[b, :, pads[b]:]
        if not any(pads) and len(set(starts)) == 1:  # one rectangular call
            end = starts[0] + S
            return ops.attention(q, self.k[:B, :, :end], self.v[:B, :, :end], causal=True, window=self.window)
        out = q.new_zeros(q.shape)
        for b in range(B):
            p, end = pads[b], starts[b] + S - pads[b]
            if p < S:
                out[b:b + 1, :, p:] = ops.attention(q[b:b + 1, :, p:], self.k[b:b + 1, :, :end],
                                                    self.v[b:b + 1, :, :end], causal=True, window=self.window)
        return out

    def _attend_ring(self, q, k, v, starts: list, pads: list, ops: Ops) -> torch.Tensor:
        """``attend`` on a ring: each sequence's chunk attends to the cached positions its first query still sees
        (read out of the ring in position order) followed by its own keys; then its latest ``window`` keys are
        written at their rows. Sequences of one start without pads go together."""
        B, _, S, _ = q.shape
        W = self.window
        if not any(pads) and len(set(starts)) == 1:
            groups = [(slice(0, B), starts[0], 0)]
        else:
            groups = [(slice(b, b + 1), starts[b], pads[b]) for b in range(B) if pads[b] < S]
        out = q.new_zeros(q.shape)
        for rows, start, pad in groups:
            keys, values = k[rows, :, pad:], v[rows, :, pad:]
            if start:  # (a first chunk sees no cached position)
                seen = torch.arange(start - min(start, W - 1), start, device=self.k.device) % W
                keys = torch.cat([self.k[rows][:, :, seen], keys], dim=2)
                values = torch.cat([self.v[rows][:, :, seen], values], dim=2)
            out[rows, :, pad:] = ops.attention(q[rows, :, pad:], keys, values, causal=True, window=W)
            keep = min(S - pad, W)
            at = torch.arange(start + S - pad - keep, start + S - pad, device=self.k.device) % W
            self.k[rows, :, at] = k[rows, :, S - keep:]
            self.v[rows, :, at] = v[rows, :, S - keep:]
        return out


class CPKVCache:
    """One layer's keys and values on one rank of a CP group, and context-parallel attention (the module); a layer of
    full attention (``CPRingCache``: a sliding-window one).

    ``k, v``: ``(batch, kv_heads, capacity, head_dim)``. Row b's prompt (its first ``first[b]`` positions, cached by
    one prefill over the group) fills this rank's first ``base[b]`` slots with its share (the zigzag shard: of one
    prompt length, or of the row's real tokens in a packed ragged prompt); a decode position ``p >= first[b]`` is cached
    by rank ``p % n`` only (``cp.owner``), at slot ``base[b] + owned(p) - owned(first[b])`` (``owned(x)``: this rank's
    positions below x), so the slots are known from the position alone, on the host or the device. The other ranks
    write a decode token to the last slot, which no position uses. ``capacity`` bounds a rank's share of
    ``max_seq_len`` (its prompt shard, at most ``L/n + 2`` of a row of L, its share of the rest at most
    ``(max_seq_len - L)/n + 1``, and that spare slot).
    """

    def __init__(self, batch: int, kv_heads: int, max_seq_len: int, head_dim: int, dtype, device,
                 cp: ContextParallel):
        self.cp = cp
        self.capacity = max_seq_len // cp.size + 4
        shape = (batch, kv_heads, self.capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.first, self.base = [0] * batch, [0] * batch  # each row's prompt length, and its slots here
        self._rows = torch.zeros(2, batch, dtype=torch.int64, device=device)  # (first, base) on the device

    def cached(self, held: int, total: int) -> None:
        """Every row as if a prompt of ``total`` positions were cached, ``held`` of them in this rank's first slots,
        whatever keys and values they hold (the decode benchmark's caches, without a prefill)."""
        self._prompt([total] * len(self.first), [held] * len(self.base))

    def _prompt(self, first: list, base: list) -> None:
        B = len(first)
        self.first[:B], self.base[:B] = first, base
        self._rows[:, :B] = torch.tensor([first, base]).to(self._rows.device)

    def _slot(self, p, base, first):
        """The slot of decode position ``p`` in a row whose prompt of ``first`` positions fills ``base`` slots here (on
        its owner; the count of the row's slots below it elsewhere): ints, or [B] tensors on the device."""
        return base + self._owned(p) - self._owned(first)

    def _owned(self, x):
        """This rank's decode positions below ``x`` (an int or a tensor) counted from 0: ``ceil((x - rank) / n)``."""
        n, r = self.cp.size, self.cp.rank
        return (x - r + n - 1) // n if isinstance(x, int) else torch.div(x - r + n - 1, n, rounding_mode="floor")

    def attend(self, q, k, v, starts: list, pads: list, ops: Ops) -> torch.Tensor:
        """``KVCache.attend`` under CP (``Llama`` has checked the call).

        A prompt (``cp.seq_len`` > 1 tokens, start 0): q, k, v are this rank's shard of them (any length, none
        included), ``(B, H, S_local, D)`` of a prompt of one length or ``(1, H, T_local, D)`` of a ragged one's
        real tokens packed (``cp.packed``). Tokens after the rows' prompts (``cp.seq_len == 0``: a token a row, or a
        chunk of them, left-padded by ``pads``, row b's from position ``starts[b]``): q, k, v of all of them (after
        RoPE), the same on every rank (``_attend_after``).
        """
        if not self.cp.seq_len:
            return self._attend_after(q, k, v, starts, pads, ops)
        rows, _, lens = _prompt_tokens(self.cp, q.shape[0])
        counts = torch.bincount(rows, minlength=len(lens)).tolist()  # the rows' tokens here, in row order
        kf, vf = (_flat_tokens(t) for t in (k, v))
        at = 0
        for b, c in enumerate(counts):
            self._write(kf[None, :, at:at + c], vf[None, :, at:at + c], slice(b, b + 1), 0)
            at += c
        self._prompt(lens, counts)
        return _prompt_attention(self.cp, q, k, v)

    def _attend_after(self, q, k, v, starts: list, pads: list, ops: Ops) -> torch.Tensor:
        """``attend`` of tokens after their rows' prompts, the same on every rank (a decode token, or a chunk: row b's
        real tokens after ``pads[b]``, at positions ``starts[b] ..``). Each position's key and value is cached on its
        owner. A rank's two partials, merged across the group: attention to its slots of the row below the chunk,
        and on CP rank 0 to the chunk's own keys (causal)."""
        cp = self.cp
        B, H, S, D = q.shape
        out = q.new_zeros((2, B, H, S, D))
        lse = torch.full((2, B, H, S), float("-inf"), dtype=torch.float32, device=q.device)
        below = []  # per row: (its pads, its slots here below the chunk), None without a token
        for b, (p0, pad) in enumerate(zip(starts, pads)):
            at = self._slot(p0, self.base[b], self.first[b])
            j = torch.arange(S - pad)
            mine = j[cp.owner(p0 + j) == cp.rank] + pad  # this rank's tokens of the chunk
            self._write(k[b:b + 1, :, mine], v[b:b + 1, :, mine], slice(b, b + 1), at)
            below.append((pad, at) if pad < S else None)
        for key, rows in _same(below):
            if key is not None and key[1] > 0:  # (no key here yet: an empty partial)
                pad, hi = key
                o, l = ops.attention(q[rows, :, pad:], self.k[rows, :, :hi], self.v[rows, :, :hi], causal=False,
                                     return_lse=True)
                out[0][rows, :, pad:], lse[0][rows, :, pad:] = o, l
        if cp.rank == 0:
            for pad, rows in _same(pads):
                if pad < S:
                    o, l = ops.attention(q[rows, :, pad:], k[rows, :, pad:], v[rows, :, pad:], causal=True,
                                         return_lse=True)
                    out[1][rows, :, pad:], lse[1][rows, :, pad:] = o, l
        return cp.merge(out, lse, "reference" if ops.ref else ops.kimpl)

    def decode(self, q, k, v, cos, sin, positions: torch.Tensor, kv_lens: torch.Tensor, ops: Ops,
               prefetch=None) -> torch.Tensor:
        """``KVCache.decode`` under CP: rotate q and k at ``positions``, write k and v at their slots on the positions'
        owners, attend to each row's slots here, merge across the group; no host synchronization (a CUDA graph can
        hold it, the merge's all-gather included)."""
        B = q.shape[0]
        q, k = ops.rope(q, k, cos[positions][:, None], sin[positions][:, None])
        first, base = self._rows[:, :B]
        at = self._slot(positions, base, first)
        mine = self.cp.owner(positions) == self.cp.rank
        rows = torch.arange(B, device=q.device)
        slot = torch.where(mine, at, self.capacity - 1)
        self.k[rows, :, slot] = k[:, :, 0]
        self.v[rows, :, slot] = v[:, :, 0]
        out, lse = ops.decode_attention(q, self.k[:B], self.v[:B], at + mine.long())
        return self.cp.merge(out, lse, "reference" if ops.ref else ops.kimpl)

    def hold(self, batch: int, position: int):
        """A function that puts back what a decode of ``batch`` rows at ``position`` writes here (its slots and
        the spare one): ``DecodeGraph``'s warm-up."""
        # (a row's slot of the position even inside its prompt: a full cache's)
        slots = sorted({self.capacity - 1} | {self._slot(position, self.base[b], self.first[b]) for b in range(batch)})
        slots = [s for s in slots if 0 <= s < self.capacity]
        kept = [(s, self.k[:batch, :, s].clone(), self.v[:batch, :, s].clone()) for s in slots]

        def restore():
            for s, kk, vv in kept:
                self.k[:batch, :, s], self.v[:batch, :, s] = kk, vv
        return restore

    def _write(self, k, v, rows, at: int):
        n = k.shape[2]
        if at + n > self.capacity:
            raise ValueError(f"CPKVCache: {at + n} slots exceed this rank's capacity {self.capacity}")
        self.k[rows, :, at:at + n] = k
        self.v[rows, :, at:at + n] = v


class CPRingCache(KVCache):
    """A sliding-window layer's cache under CP (a window shorter than ``max_seq_len``): the prompt is computed on this
    rank's shard (``cp_attention``'s window, ``cp_attention_varlen``'s for a ragged one), then each row's keys and
    values of its last ``window`` prompt positions are gathered from the group into a ring that every rank holds
    (``KVCache``'s), so that tokens after the prompt (decode steps, chunks) attend on every rank alone, as without CP
    (no merge), the decode step on the device (``KVCache.decode``: a CUDA graph can hold it)."""

    def __init__(self, batch: int, kv_heads: int, max_seq_len: int, head_dim: int, dtype, device,
                 cp: ContextParallel, window: int):
        super().__init__(batch, kv_heads, max_seq_len, head_dim, dtype, device, window)
        self.cp = cp

    def attend(self, q, k, v, starts: list, pads: list, ops: Ops) -> torch.Tensor:
        """``CPKVCache.attend``'s calls: a prompt's shard (its window's keys then gathered into the ring), or tokens
        after the prompts, the same on every rank (``KVCache.attend`` on the ring)."""
        cp = self.cp
        if not cp.seq_len:
            return super().attend(q, k, v, starts, pads, ops)
        out = _prompt_attention(cp, q, k, v, self.window)
        rows, positions, lens = _prompt_tokens(cp, q.shape[0])
        W = self.window
        tail = torch.nonzero(positions >= torch.tensor(lens)[rows] - W)[:, 0]  # what a later token's window reaches
        tails = torch.tensor([min(n, W) for n in lens])  # each row's tail, over the group
        m = int(tails.sum())  # every row's tail: as much as one rank may hold
        k, v = (_flat_tokens(t) for t in (k, v))
        kv = k.new_zeros((2, k.shape[0], m, k.shape[2]))
        kv[0, :, :len(tail)], kv[1, :, :len(tail)] = k[:, tail.to(k.device)], v[:, tail.to(k.device)]
        tags = torch.full((2, m), -1, dtype=torch.int64)
        tags[0, :len(tail)], tags[1, :len(tail)] = rows[tail], positions[tail]
        kv, tags = cp.gather(kv), cp.gather(tags.to(k.device)).cpu()  # (n, 2, Hkv, m, D), (n, 2, m)
        held = tags[:, 1] >= 0
        r, p = tags[:, 0][held], tags[:, 1][held]
        if not torch.equal(torch.bincount(r, minlength=len(lens)), tails):
            raise RuntimeError(f"CPRingCache: the group's prompt tokens {sorted(zip(r.tolist(), p.tolist()))} are not "
                               f"each row's last {W} of {lens} (a broken shard)")
        at = (r.to(k.device), (p % W).to(k.device))
        held = held.to(k.device)
        self.k[at[0], :, at[1]] = kv[:, 0].transpose(1, 2)[held]
        self.v[at[0], :, at[1]] = kv[:, 1].transpose(1, 2)[held]
        return out


def _prompt_tokens(cp: ContextParallel, batch: int):
    """(rows, positions, lengths) of this rank's share of a CP prompt, in ``attend``'s order of its tokens: their rows
    and positions (CPU LongTensors), every row's prompt length (a list)."""
    if cp.packed is None:
        mine = cp.positions(cp.seq_len)
        return torch.arange(batch).repeat_interleave(len(mine)), mine.repeat(batch), [cp.seq_len] * batch
    rows, positions, cu = cp.packed
    return rows, positions, [hi - lo for lo, hi in zip(cu, cu[1:])]


def _flat_tokens(t: torch.Tensor) -> torch.Tensor:
    """``attend``'s ``(B, H, S, D)`` -> ``(H, B * S, D)``: the tokens in ``_prompt_tokens``' order."""
    return t.transpose(0, 1).reshape(t.shape[1], -1, t.shape[3])


def _prompt_attention(cp: ContextParallel, q, k, v, window: int | None = None) -> torch.Tensor:
    """A CP prompt's attention of this rank's shard (``attend``'s q, k, v): ``cp_attention`` for a prompt of one
    length, ``cp_attention_varlen`` for a ragged one's packed tokens."""
    if cp.packed is None:
        return cp_attention(q, k, v, causal=True, group=cp.group, layout=cp.LAYOUT, seq_len=cp.seq_len, window=window)
    out = cp_attention_varlen(*(t[0].transpose(0, 1) for t in (q, k, v)), torch.tensor(cp.packed[2]), causal=True,
                              group=cp.group, layout=cp.LAYOUT, window=window)
    return out.transpose(0, 1)[None]


def _same(keys) -> list:
    """``(key, rows)`` for each distinct key of the rows' ``keys``, ``rows`` an index of the rows with it: the whole
    batch's slice where every row has the same key."""
    keys = list(keys)
    if len(set(keys)) == 1:
        return [(keys[0], slice(0, len(keys)))]
    groups = {}
    for b, key in enumerate(keys):
        groups.setdefault(key, []).append(b)
    return [(key, torch.tensor(rows)) for key, rows in groups.items()]


class Llama:
    """A Llama-style causal LM with a KV cache (see the module). Build it with ``from_pretrained``.

    Attributes:
        config: the ``LlamaConfig``; tp: the ``TensorParallel`` plan; generation_config: the folder's
        ``generation_config.json`` (or {}); max_batch, max_seq_len, dtype, device, impl.
    """

    def __init__(self, config: LlamaConfig, weights: dict, tp: TensorParallel, *, dtype, device, impl: str,
                 max_batch: int, max_seq_len: int, generation_config: dict | None = None,
                 cp: ContextParallel | None = None):
        self.config, self.tp, self.cp, self.dtype, self.device, self.impl = config, tp, cp, dtype, device, impl
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.generation_config = generation_config or {}
        self.ops = Ops(impl, dtype)
        self.embed, self.norm, self.head, self.layers = (weights["embed"], weights["norm"], weights["head"],
                                                         weights["layers"])
        self.heads, self.kv_heads, self.head_dim = tp.heads, tp.kv_heads, config.head_dim
        inv_freq, scale = rope_inv_freq(config)
        freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        # As Hugging Face: cos/sin in float32 (times YaRN's attention factor), rounded to the activation dtype.
        self.cos, self.sin = (emb.cos() * scale).to(dtype).to(device), (emb.sin() * scale).to(dtype).to(device)
        if cp is None:
            self.caches = [KVCache(max_batch, self.kv_heads, max_seq_len, self.head_dim, dtype, device,
                                   config.layer_window(i)) for i in range(len(self.layers))]
        else:
            # (a window of max_seq_len or more reaches every position a query can have: full attention)
            windows = [config.layer_window(i) for i in range(len(self.layers))]
            self.caches = [CPKVCache(max_batch, self.kv_heads, max_seq_len, self.head_dim, dtype, device, cp)
                           if w is None or w >= max_seq_len else
                           CPRingCache(max_batch, self.kv_heads, max_seq_len, self.head_dim, dtype, device, cp, w)
                           for w in windows]
        self.last_timings: dict = {}
        self._graphs: dict = {}  # batch size -> DecodeGraph
        self._o_views: dict = {}  # (O weight address, MiB) -> the view the decode attention prefetches
        self._folds: dict = {}  # (the switches of norm_folds) -> whether the decode step folds its norms

    # -- loading ---------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path, *, tp_group=None, cp_group=None, dtype: torch.dtype = torch.bfloat16,
                        weights: str = "bf16", max_batch: int = 1, max_seq_len: int | None = None,
                        impl: str = "auto", device=None, quantize_head: bool = False) -> "Llama":
        """Load a Hugging Face Llama/Mistral/Qwen2/Qwen3/Phi-3 folder, each rank reading only the slices it keeps.

        Args:
            path: the folder (``config.json``, ``*.safetensors``, optional ``model.safetensors.index.json``,
                ``generation_config.json``).
            tp_group: the tensor-parallel communicator (None: no TP). Collective over it.
            cp_group: the context-parallel communicator (None: no CP; see the module for what CP runs and
                refuses). Its ranks hold the same TP slice; ``check_groups`` checks that the TP and CP groups
                tile the ranks (TP groups of consecutive ranks, CP groups strided by the TP size).
                Collective over it.
            dtype: activations, cache and dense weights: bfloat16, float16 or float32.
            weights: ``"bf16"`` (dense in ``dtype``), ``"w8a16"`` or ``"w4a16"`` (quantized at load with
                ``xelink.kernels.pack_w8a16`` / ``pack_w4a16``; the embedding stays dense, the head too unless
                ``quantize_head``).
            quantize_head: the head (``lm_head``, or the tied embedding's copy it reads) in ``weights`` too, as
                llama.cpp's and MLC's 4-bit models keep it (a W4A16 Llama-3.1-8B reads 0.8 GB less a token); the
                logits then move by the head's rounding, so greedy tokens may differ from a dense head's. Needs a
                quantized ``weights``.
            max_batch: sequences the cache holds.
            max_seq_len: tokens per sequence the cache holds; None: min(max_position_embeddings, 8192). A
                sliding window (``config.sliding_window``) is attended within on its layers, whose caches keep
                their window's rows only where it is shorter (``KVCache``'s ring; under CP, ``CPKVCache``'s
                window).
            impl: ``"auto"``, ``"xelink"`` (xelink's kernels and, on CUDA, xelink's collective algorithms
                forced: an error where they cannot run) or ``"reference"`` (pure torch).
            device: where the model runs; default the TP group's device, else the CP group's, else the world's
                when xelink is initialized, else the CPU.

        Returns:
            the model.

        Raises:
            ValueError / TypeError / FileNotFoundError: before any weight is read, for an unsupported config
            value, a missing or mis-shaped tensor (named), heads not divisible by the TP size, a bad dtype,
            impl or weight format, TP and CP groups that do not tile the ranks.
        """
        fn = "Llama.from_pretrained"
        path = Path(path)
        device = cls._resolve(fn, dtype, max_batch, max_seq_len, impl, tp_group, cp_group, device)
        hf = read_json(path, "config.json")
        if hf is None:
            raise FileNotFoundError(f"{fn}: {path / 'config.json'} does not exist")
        cfg = LlamaConfig.from_hf(hf, fn)
        if max_seq_len is None:
            max_seq_len = min(cfg.max_position_embeddings, MAX_SEQ_LEN_DEFAULT)
        generation = read_json(path, "generation_config.json")
        if generation is None:  # an older folder: config.json's settings, as transformers takes them
            generation = settings_of_model_config(hf)
        return cls._load(fn, cfg, lambda: Checkpoint(path, fn), generation,
                         tp_group=tp_group, cp_group=cp_group, dtype=dtype, weights=weights, max_batch=max_batch,
                         max_seq_len=max_seq_len, impl=impl, device=device, quantize_head=quantize_head)

    @classmethod
    def random(cls, config, *, seed: int = 0, tp_group=None, cp_group=None, dtype: torch.dtype = torch.bfloat16,
               weights: str = "bf16", max_batch: int = 1, max_seq_len: int | None = None, impl: str = "auto",
               device=None, quantize_head: bool = False) -> "Llama":
        """A model of ``config`` with random weights drawn on its device (``checkpoint.RandomWeights``: no
        folder, no download; benchmarks at real shapes). ``config``: a named config (``CONFIGS``), a Hugging
        Face dict or a ``LlamaConfig``; ``seed`` picks the weights (the same on every rank, so TP slices
        agree); the other arguments as ``from_pretrained``'s. Collective over the TP and CP groups."""
        fn = "Llama.random"
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"{fn}: seed={seed!r} must be an int")
        device = cls._resolve(fn, dtype, max_batch, max_seq_len, impl, tp_group, cp_group, device)
        cfg = _resolve_config(config, fn)
        if max_seq_len is None:
            max_seq_len = min(cfg.max_position_embeddings, MAX_SEQ_LEN_DEFAULT)
        return cls._load(fn, cfg, lambda: RandomWeights(cfg, seed, device), None, tp_group=tp_group,
                         cp_group=cp_group, dtype=dtype, weights=weights, max_batch=max_batch,
                         max_seq_len=max_seq_len, impl=impl, device=device, quantize_head=quantize_head)

    @staticmethod
    def _resolve(fn, dtype, max_batch, max_seq_len, impl, tp_group, cp_group, device) -> torch.device:
        """The argument checks that need no config, and the device (see ``from_pretrained``)."""
        if impl not in IMPLS:
            raise ValueError(f"{fn}: impl={impl!r} must be one of {', '.join(map(repr, IMPLS))}")
        if dtype not in _DTYPES:
            raise TypeError(f"{fn}: dtype={dtype!r} cannot be served (one of float32, bfloat16, float16)")
        for name, v in (("max_batch", max_batch), ("max_seq_len", max_seq_len)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{fn}: {name}={v!r} must be an int >= 1")
        check_groups(tp_group, cp_group, fn)
        if device is None:  # the groups' device, else the world's, else the CPU
            group = tp_group if tp_group is not None else cp_group
            if group is None:
                from ..comm import get_world
                from ..errors import NotInitializedError

                try:
                    group = get_world()
                except NotInitializedError:
                    pass
            device = group.device if group is not None else "cpu"
        device = torch.device(device)
        if impl == "xelink":
            if device.type == "cpu":
                raise ValueError(f"{fn}: impl='xelink' runs xelink's Triton kernels, which need a GPU (device is "
                                 f"cpu); use impl='auto' or 'reference'")
            if dtype not in _KERNEL_DTYPES:
                raise TypeError(f"{fn}: impl='xelink' needs dtype bfloat16 or float16 (the kernels' dtypes), got "
                                f"{dtype}")
            if importlib.util.find_spec("triton") is None:
                raise ValueError(f"{fn}: impl='xelink' needs Triton, which is not installed")
            check_xelink_collectives((("tp_group", tp_group), ("cp_group", cp_group)), device, fn)
        return device

    @classmethod
    def _load(cls, fn, cfg, source, generation_config, *, tp_group, cp_group, dtype, weights, max_batch,
              max_seq_len, impl, device, quantize_head) -> "Llama":
        """The model of ``cfg`` from ``source()`` (a ``Checkpoint`` or ``RandomWeights``), after the checks
        that need the config."""
        tp = TensorParallel(cfg, tp_group, fn, force_xelink=impl == "xelink")
        tp.check_formats(weights, fn)
        if quantize_head not in (False, True):
            raise ValueError(f"{fn}: quantize_head={quantize_head!r} must be a bool")
        if quantize_head and weights == "bf16":
            raise ValueError(f"{fn}: quantize_head=True quantizes the head to the projections' format: it needs "
                             f"weights='w8a16' or 'w4a16', got weights={weights!r}")
        ckpt = source()
        shapes = tensor_shapes(cfg)
        shapes.setdefault(head_tensor(cfg, ckpt), (cfg.vocab_size, cfg.hidden_size))  # (a head stored under the tie)
        ckpt.check(shapes)
        # W4A16 in tiles where the GEMVs read them in place (the tensor-core kernel: faster HBM reads)
        tiled = impl != "reference" and dtype in _KERNEL_DTYPES and tiled_w4a16_native(device)
        loaded = tp.load(ckpt, weights, dtype, device, tiled=tiled, quantize_head=quantize_head)
        return cls(cfg, loaded, tp, dtype=dtype, device=device, impl=impl, max_batch=max_batch,
                   max_seq_len=max_seq_len, generation_config=generation_config,
                   cp=ContextParallel(cp_group, force_xelink=impl == "xelink")
                   if cp_group is not None and cp_group.size > 1 else None)

    # -- forward ---------------------------------------------------------------------------------

    def _lengths(self, fn, input_ids, start_pos, attention_mask):
        """(starts, pads) as host lists, after the checks."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int32, torch.int64):
            what = input_ids.dtype if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise TypeError(f"{fn}: input_ids must be an int32/int64 tensor [B, S], got {what}")
        if input_ids.dim() != 2:
            raise ValueError(f"{fn}: input_ids.shape={tuple(input_ids.shape)} must be [B, S]")
        B, S = input_ids.shape
        V = self.config.vocab_size
        if input_ids.numel() and not (0 <= int(input_ids.min()) and int(input_ids.max()) < V):
            b, s = ((input_ids < 0) | (input_ids >= V)).nonzero()[0].tolist()
            raise ValueError(f"{fn}: token id {int(input_ids[b, s])} at input_ids[{b}, {s}] is not in "
                             f"[0, vocab_size={V})")
        if not 1 <= B <= self.max_batch:
            raise ValueError(f"{fn}: batch {B} must be in 1..max_batch={self.max_batch}")
        if S < 1:
            raise ValueError(f"{fn}: input_ids has no tokens")
        bad = ValueError(f"{fn}: start_pos={start_pos!r} must be an int >= 0 or one per sequence")
        if isinstance(start_pos, torch.Tensor) and start_pos.dim() == 0:
            start_pos = start_pos.item()
        if isinstance(start_pos, numbers.Integral) and not isinstance(start_pos, bool):
            starts = [int(start_pos)] * B
        else:
            try:
                starts = [operator.index(s) for s in (start_pos.reshape(-1).tolist()
                                                      if isinstance(start_pos, torch.Tensor) else start_pos)]
            except TypeError:
                raise bad from None
        if len(starts) != B or min(starts) < 0:
            raise bad
        if attention_mask is None:
            pads = [0] * B
        else:
            mask = attention_mask.to("cpu", torch.int64)
            if tuple(mask.shape) != (B, S):
                raise ValueError(f"{fn}: attention_mask.shape={tuple(mask.shape)} != input_ids.shape={(B, S)}")
            n = mask.sum(1)
            want = (torch.arange(S)[None, :] >= (S - n)[:, None]).long()
            if not torch.equal(mask, want):
                raise ValueError(f"{fn}: attention_mask must be left-padded (zeros, then ones in each row)")
            if (n == 0).all():  # a row without a token in this chunk (a ragged batch prefilled in chunks) is fine
                raise ValueError(f"{fn}: attention_mask has no token in any row")
            pads = (S - n).tolist()
        ends = [s + S - p for s, p in zip(starts, pads)]
        if max(ends) > self.max_seq_len:
            raise ValueError(f"{fn}: {max(ends)} tokens exceed max_seq_len={self.max_seq_len}")
        sharded = [c for c in self.caches if isinstance(c, CPKVCache)]  # (CP ring caches: as without CP)
        if sharded:
            prompts = sharded[0].first[:B]
            if any(starts) and any(s < p for s, p, d in zip(starts, prompts, pads) if d < S):
                raise ValueError(f"{fn}: under context parallelism a token goes after its row's prompt (of "
                                 f"{prompts} positions), not at start_pos {starts} (or every row at 0: new sequences)")
        return starts, pads

    def __call__(self, input_ids: torch.Tensor, start_pos=0, attention_mask: torch.Tensor | None = None,
                 logits_to_keep: int = 0):
        """Logits of a chunk of tokens; writes their keys and values into the cache.

        Args:
            input_ids: ``[B, S]`` int token ids (B <= max_batch).
            start_pos: tokens already cached per sequence: an int (the same for every sequence) or one per
                sequence (a list or a ``[B]`` tensor).
            attention_mask: None (every token real) or ``[B, S]`` of 0/1, left-padded: row b's real tokens go
                to positions ``start_pos[b] ..``.
            logits_to_keep: as transformers' argument: 0 (every position) or n >= 1, the last n positions only
                (a prompt's prefill wants 1: the head then reads n rows, not S, and no ``[B, S, vocab]`` tensor
                is made).

        Returns:
            ``[B, S, vocab]`` logits in the model's dtype (``[B, min(n, S), vocab]`` with ``logits_to_keep=n``;
            rows of pads hold whatever the pads compute).

        Collective over the TP group and the CP group.
        """
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise ValueError(f"Llama: logits_to_keep={logits_to_keep!r} must be an int >= 0 (0: every position)")
        starts, pads = self._lengths("Llama", input_ids, start_pos, attention_mask)
        if input_ids.shape[1] == 1 and not any(starts):  # one-token prompts under CP: new sequences, none cached
            for cache in self.caches:
                if isinstance(cache, CPKVCache):
                    cache._prompt([0] * len(starts), [0] * len(starts))
        B, S = input_ids.shape
        H = self.config.hidden_size
        pos = (torch.tensor(starts)[:, None] + torch.arange(S)[None, :] - torch.tensor(pads)[:, None]).clamp_(min=0)
        full, real = S, None
        if self.cp is not None:  # a CP prompt: this rank's positions only (a rank may get as few as none)
            prompt = S > 1 and not any(starts)  # (else tokens after the rows' prompts: every rank computes them all)
            self.cp.seq_len, self.cp.packed = (S if prompt else 0), None
            if prompt and any(pads):  # ragged: the rows' real tokens packed, this rank's share of each row's
                cu = [0]
                for p in pads:
                    cu.append(cu[-1] + S - p)
                real = torch.cat([torch.arange(b * S + p, (b + 1) * S) for b, p in enumerate(pads)])
                mine = real[self.cp.positions(cu[-1], torch.tensor(cu))]
                self.cp.seq_len, self.cp.packed = cu[-1], (mine // S, pos.reshape(-1)[mine], cu)
                input_ids, pos, S = input_ids.reshape(1, -1)[:, mine], pos.reshape(1, -1)[:, mine], len(mine)
            elif prompt:
                mine = self.cp.positions(S)
                input_ids, pos, S = input_ids[:, mine], pos[:, mine], len(mine)
        pos = pos.to(self.device)
        if full == 1 and not any(pads):  # a token per sequence: the decode step
            return self._decode_step(input_ids[:, 0].to(self.device), pos[:, 0])[:, None]
        cos, sin = self.cos[pos], self.sin[pos]  # (B, S, D)
        x = self.embed[input_ids.to(self.device)]  # (B, S, H)

        def attend(cache, q, k, v, layer):
            q, k = self.ops.rope(q, k, cos, sin)
            return cache.attend(q, k, v, starts, pads, self.ops)

        normed = self._layers(x, attend)
        if real is not None:  # every real token's hidden state, on every CP rank, at its place in the batch
            packed = self.cp.unshard(normed, len(real), torch.tensor(self.cp.packed[2]))
            normed = normed.new_zeros((B * full, H)).index_copy_(0, real.to(self.device), packed[0])
            normed, S = normed.reshape(B, full, H), full
        elif S != full:  # every position's hidden state, on every CP rank
            normed, S = self.cp.unshard(normed, full), full
        if 0 < logits_to_keep < S:
            normed, S = normed[:, S - logits_to_keep:], logits_to_keep
        return self._head(normed.reshape(B * S, H)).reshape(B, S, -1)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits of one token per sequence, its key and value written into the cache: the decode step
        without host synchronization or host-side checks of the values (what ``decode_graph`` captures).

        Args:
            tokens: ``[B]`` int64 token ids on the model's device (B <= max_batch), in ``[0, vocab)``.
            positions: ``[B]`` int64 on the model's device: where each token goes (sequence b's cache must
                hold positions ``0 .. positions[b] - 1``); each below ``max_seq_len``.

        Returns:
            ``[B, vocab]`` logits in the model's dtype.

        Raises:
            ValueError: tensors of the wrong shape, dtype or device. Values are not checked (that would synchronize):
            an id or position out of range is a device-side error (under context parallelism a position must also be
            at least its row's prompt length).

        Collective over the TP group and the CP group.
        """
        fn = "Llama.decode"
        for name, t in (("tokens", tokens), ("positions", positions)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1 or \
                    t.device.type != self.device.type or self.device.index not in (None, t.device.index):
                raise ValueError(f"{fn}: {name} must be a [B] int64 tensor on {self.device}, got "
                                 f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))} on "
                                 f"{getattr(t, 'device', None)}")
        B = tokens.shape[0]
        if not 1 <= B <= self.max_batch or positions.shape[0] != B:
            raise ValueError(f"{fn}: tokens ({B}) and positions ({positions.shape[0]}) must have one entry per "
                             f"sequence, 1..max_batch={self.max_batch}")
        return self._decode_step(tokens, positions)

    def _decode_step(self, tokens, positions):
        """``decode`` after its checks (also the model call's path for one token a sequence)."""
        kv_lens = positions + 1
        x = self.embed[tokens][:, None]  # (B, 1, H)
        normed = self._layers(x, lambda cache, q, k, v, layer: cache.decode(q, k, v, self.cos, self.sin, positions,
                                                                            kv_lens, self.ops, self._o_prefetch(layer)),
                              fold=self._fold_norms(tokens.shape[0]))
        return self._head(normed.reshape(tokens.shape[0], -1))

    def _fold_norms(self, rows: int) -> bool:
        """Whether a decode step of ``rows`` tokens folds each layer's norms into its GEMVs: 1-8 rows, every
        projection tiled W4A16 without a TP sum or bias, the kernel path, and ``kernels.norm_folds`` (the CUDA C++
        kernel serves them in one launch each: ``gemv_norm.CU_FOLD``, off until measured on a GPU). Each layer's two
        norms then need no launch: 63 a Llama-3.1-8B step fewer. Worked out once a setting of the switches."""
        if rows > _GEMV_ROWS:
            return False
        key = (sys.modules[gemv_rms.__module__].CU_FOLD, sys.modules[gemv.__module__].CU_W4)  # (step_ab.py's A/Bs)
        folds = self._folds.get(key)
        if folds is None:
            folds = self._folds[key] = not self.ops.dense_ref and norm_folds(self.device) and all(
                lin.fmt == "w4a16t" and lin.bias is None and lin.reduce is None
                for layer in self.layers for lin in (layer["qkv"], layer["o"], layer["gate_up"], layer["down"]))
        return folds

    @property
    def graph_capturable(self) -> bool:
        """Whether the decode step can be captured in a CUDA graph: on CUDA, on the kernel path (impl "auto"
        or "xelink" in bf16/fp16: the references synchronize)."""
        return self.device.type == "cuda" and not self.ops.dense_ref

    def decode_graph(self, batch: int) -> "DecodeGraph":
        """The decode step for ``batch`` sequences captured in a CUDA graph (made at the first call for that
        batch size, then kept): see :class:`DecodeGraph`. Collective over the TP group (the capture)."""
        g = self._graphs.get(batch)
        if g is None:
            g = self._graphs[batch] = DecodeGraph(self, batch)
        return g

    def _layers(self, x, attend, fold: bool = False):
        """The decoder layers over ``x`` (B, S, H), ``attend(cache, q, k, v, layer)`` (q, k, v before RoPE) for
        each layer's attention; returns the final norm's output. ``fold``: each layer's norms folded into the GEMVs
        (``_fold_norms``; x, the step's own embedding rows, then holds the residual stream, updated in place)."""
        ops, eps = self.ops, self.config.rms_norm_eps
        if fold:
            return self._layers_folded(x, attend)
        residual = None
        for layer, cache in zip(self.layers, self.caches):
            if residual is None:
                normed, residual = ops.rmsnorm(x, layer["attn_norm"], eps), x
            else:
                normed, residual = ops.rmsnorm(x, layer["attn_norm"], eps, residual)
            x = self._attention(layer, cache, normed, attend)
            normed, residual = ops.rmsnorm(x, layer["mlp_norm"], eps, residual)
            x = self._mlp(layer, normed)
        return ops.rmsnorm(x, self.norm, eps, residual)[0] if residual is not None else ops.rmsnorm(x, self.norm, eps)

    def _layers_folded(self, x, attend):
        """``_layers`` with each layer's RMSNorms folded into the GEMVs around them: the O and down projections add
        into the residual ``h`` and return ``h * norm_weight`` of the norm after them (``gemv_residual``), the QKV
        and gate/up projections scale their rows by ``1 / rms(h)`` (``gemv_rms``). The first layer's norm and the
        final one run as they are."""
        ops, eps = self.ops, self.config.rms_norm_eps
        B, S, H = x.shape
        h = x.view(B * S, H)
        z = ops.rmsnorm(h, self.layers[0]["attn_norm"], eps)
        for i, (layer, cache) in enumerate(zip(self.layers, self.caches)):
            qkv = ops.linear(layer["qkv"], z) if i == 0 else ops.gemv_rms(layer["qkv"], z, h, eps)
            a = self._attend(layer, cache, qkv, B, S, attend)
            z = ops.gemv_residual(layer["o"], a, h, layer["mlp_norm"])
            act = ops.gemv_rms(layer["gate_up"], z, h, eps, act="silu_mul")
            z = ops.gemv_residual(layer["down"], act, h,
                                  self.layers[i + 1]["attn_norm"] if i + 1 < len(self.layers) else None)
        return ops.rmsnorm(h, self.norm, eps).view(B, S, H)

    def _o_prefetch(self, layer):
        """The first ``PREFETCH_O_MB`` MiB of ``layer``'s O projection weight (a flat view, made once), which the
        decode step's attention asks L2 for; None where off (or on the reference path)."""
        mb, w = PREFETCH_O_MB, layer["o"].weight
        if not mb or self.ops.ref or not w.is_contiguous():
            return None
        key = (w.data_ptr(), mb)
        view = self._o_views.get(key)
        if view is None:
            view = self._o_views[key] = w.view(-1)[:min(w.numel(), (mb << 20) // w.element_size())]
        return view

    def _head(self, x):
        """``[M, H]`` final hidden states -> ``[M, vocab]`` logits (the TP gather of the vocabulary)."""
        return self.tp.gather_vocab(self.ops.linear(self.head, x))

    def _attention(self, layer, cache, x, attend):
        B, S, H = x.shape
        a = self._attend(layer, cache, self.ops.linear(layer["qkv"], x.reshape(B * S, H)), B, S, attend)
        return self.ops.linear(layer["o"], a).view(B, S, H)

    def _attend(self, layer, cache, qkv, B: int, S: int, attend):
        """``[B * S, (hq + 2 hk) D]`` QKV projection -> ``[B * S, hq D]`` attention output (Qwen3's q/k norms, then
        ``attend``: RoPE and the cache)."""
        hq, hk, D = self.heads, self.kv_heads, self.head_dim
        qkv = qkv.view(B, S, hq + 2 * hk, D)
        if "q_norm" in layer:  # Qwen3: each head's q and k RMS-normalized (before the RoPE), in place
            for lo, hi, w in ((0, hq, layer["q_norm"]), (hq, hq + hk, layer["k_norm"])):
                heads = qkv[:, :, lo:hi].reshape(-1, D)
                qkv[:, :, lo:hi] = self.ops.rmsnorm(heads, w, self.config.rms_norm_eps).view(B, S, hi - lo, D)
        qkv = qkv.transpose(1, 2)
        a = attend(cache, qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:], layer)  # (B, hq, S, D)
        return a.transpose(1, 2).reshape(B * S, hq * D)

    def _mlp(self, layer, x):
        B, S, H = x.shape
        act = self.ops.gate_up(layer["gate_up"], x.reshape(B * S, H))
        return self.ops.linear(layer["down"], act).view(B, S, H)

    def generate(self, input_ids, max_new_tokens: int, *, attention_mask=None, temperature=None, top_p=None,
                 top_k=None, eos_token_id=None, seed=None, cuda_graph=None, repetition_penalty=None, min_p=None,
                 min_new_tokens=None):
        """Greedy or sampled continuation of a (left-padded) batch of prompts; see ``generate.generate``."""
        return generate(self, input_ids, max_new_tokens, attention_mask=attention_mask, temperature=temperature,
                        top_p=top_p, top_k=top_k, eos_token_id=eos_token_id, seed=seed, cuda_graph=cuda_graph,
                        repetition_penalty=repetition_penalty, min_p=min_p, min_new_tokens=min_new_tokens)


class DecodeGraph:
    """One decode step of a model for ``batch`` sequences, captured once in a CUDA graph and replayed.

    ``step(tokens, positions)`` copies the inputs into the graph's buffers, replays it and returns the
    logits (``[batch, vocab]``, a buffer the next replay overwrites); ``next_tokens`` (``[batch]`` int64 on
    the device) holds their argmax, computed in the graph, so a greedy loop copies ``batch`` ints to the
    host instead of the logits. Every kernel, the KV-cache write and the TP collectives are in the graph;
    the host does one replay a token.

    Capture: ``Llama.decode`` runs eagerly twice first on the stream that then captures (compilation,
    launch plans, the split kernels' scratch, the collectives' peer memory: what a capture cannot set
    up), at position ``max_seq_len - 1`` of every sequence; the cache rows it writes there are put back
    after it (a ring cache's row of that position may hold a live one), so a graph made after a prefill leaves
    the caches as they were. The graph then reads the positions
    from its buffer: one graph serves every position. The capture runs with Python's cyclic collector
    paused after a collection (``kernels.common.gc_paused``: a dropped model's graph freed inside it would
    invalidate it).

    Needs a CUDA model on the kernel path (``impl`` "auto" or "xelink", bf16/fp16); under CP the step's cache
    writes, attention and merge across the group are in the graph too (a sliding-window layer's ring is
    attended on every rank alone, as without CP); ``Llama.generate`` uses it where it can. Collective over the
    TP and CP groups (every rank captures and replays the same steps).
    """

    def __init__(self, model: Llama, batch: int):
        fn = "Llama.decode_graph"
        if not model.graph_capturable:
            raise ValueError(f"{fn}: a CUDA graph needs the model on a CUDA device, impl 'auto' or 'xelink', dtype "
                             f"bfloat16 or float16 (got device {model.device}, impl {model.impl!r}, {model.dtype})")
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= model.max_batch:
            raise ValueError(f"{fn}: batch={batch!r} must be an int in 1..max_batch={model.max_batch}")
        dev = model.device
        self.model, self.batch = model, batch
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.positions = torch.full((batch,), model.max_seq_len - 1, dtype=torch.int64, device=dev)
        # what the warm-up writes, put back after it
        restores = [c.hold(batch, model.max_seq_len - 1) for c in model.caches]
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            for _ in range(2):
                model.decode(self.tokens, self.positions)
            for restore in restores:
                restore()
        stream.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA call (a library's) cannot invalidate this capture; gc_paused: nor can
        # a dead graph's destructor run by this thread's cyclic collector (a model dropped with its graphs)
        with torch.cuda.device(dev), gc_paused(), \
                torch.cuda.graph(self.graph, stream=stream, capture_error_mode="thread_local"):
            self.logits = model.decode(self.tokens, self.positions)
            self.next_tokens = self.logits.argmax(dim=-1)
        torch.cuda.current_stream(dev).wait_stream(stream)

    def step(self, tokens, positions) -> torch.Tensor:
        """Replay the step for ``tokens`` at ``positions`` (``[batch]`` ints each: tensors anywhere, or
        lists); returns the logits buffer. Host values are checked (ids in the vocabulary, positions below
        ``max_seq_len``); device tensors are taken as they are."""
        fn = "DecodeGraph.step"
        m = self.model
        for name, v, hi in (("tokens", tokens, m.config.vocab_size), ("positions", positions, m.max_seq_len)):
            t = v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.int64)
            if t.shape != (self.batch,):
                raise ValueError(f"{fn}: {name} must hold {self.batch} values, got shape {tuple(t.shape)}")
            if t.device.type == "cpu" and t.numel() and not (0 <= int(t.min()) and int(t.max()) < hi):
                raise ValueError(f"{fn}: {name} must be in [0, {hi}), got {t.tolist()}")
            (self.tokens if name == "tokens" else self.positions).copy_(t, non_blocking=True)
        self.graph.replay()
        return self.logits

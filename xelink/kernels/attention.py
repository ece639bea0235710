"""Flash attention forward, split-KV decode and the merge of partial results, in Triton; and the flash
attention backward (``flash_attention_backward``: its reference here, its Triton kernels in ``attention_bwd``).

Layout and conventions follow ``DESIGN.md`` ("Contracts"): tensors are ``(batch, heads, seq, head_dim)``
as in torch SDPA; ``causal=True`` aligns the queries to the end of the keys (query ``i`` of ``Sq`` sees
keys ``0 .. i + Sk - Sq``); the log-sum-exp (LSE) is float32, natural log, shape ``(batch, heads, seq_q)``.
A query row that sees no key at all (causal with ``Sq > Sk``, an empty KV shard, a zero KV length) has
output 0 and LSE ``-inf``, so it carries no weight in a merge.

Paths (``impl=``; which each function takes: ``FLASH_IMPLS``, ``DECODE_IMPLS``, ``MERGE_IMPLS``):

- ``"triton"``: the portable kernel, block pointers and plain loads only (features Intel's Triton 3.3
  has too), so the same source serves NVIDIA and Intel GPUs.
- ``"cuda"`` (old name ``"hopper"``; flash attention only): tuned for sm90. Where it applies (head dim
  64, 128 or 256, ``Sk`` a multiple of its key tile (128; 64 at head dim 256), contiguous tensors and output:
  ``flash_ws.py``) the warp-specialized
  Gluon kernel (a TMA producer warp, two consumer warpgroups on asynchronous wgmma); otherwise the Triton
  kernel whose K/V/Q tiles come through TMA tensor descriptors, with tile shapes measured on an H200
  (``benchmarks/results/h200-attention``); and the portable kernel for layouts TMA cannot address (a
  non-contiguous tensor, a base not 16-byte aligned). Decode and merge have one kernel each, the portable
  one.
- ``"reference"``: pure torch in float32 with explicit masking; runs anywhere.
- ``"auto"``: ``"cuda"`` on a compute-capability-9 CUDA device (flash attention), ``"triton"`` on other
  GPUs, ``"reference"`` on the CPU, where Triton is missing, or for a dtype / head dim no kernel takes.

``flash_attention_varlen`` (and its backward) takes packed sequences of different lengths, FlashAttention's
``flash_attn_varlen_func``: q (total_q, Hq, D), k, v (total_k, Hkv, D), ``cu_seqlens`` offsets, the LSE (Hq, total_q);
paths "triton" (the portable forward kernel's ``VARLEN`` mode, one program per (sequence x head, query block)) and
"reference" (``reference_flash_attention`` over each sequence).

``out=`` (each function) writes the attention output into a caller's view, e.g. the ``(B, H, S, D)``
transpose of a ``(B, S, H, D)`` buffer; the LSE is always a new tensor.

Eager calls launch the kernels directly; under ``torch.compile`` each function goes through its
``torch.library`` custom op (``xelink::flash_attention``, ``xelink::decode_attention``,
``xelink::merge_attention``, ``xelink::rope_decode_attention``, each writing its ``out`` argument, the last
its caches too) with a fake implementation, so ``torch.compile`` traces through it; CUDA graphs capture
either. Triton is imported guarded: this module imports and its references run without it. Setting
``TRITON_INTERPRET=1`` before import runs the Triton kernels on CPU tensors (slow; for tests).
"""
import math
import numbers

import torch

# Triton is optional (common.py imports it for every kernel module): without it the references (and
# impl="auto" on any device) still work.
from .common import (IMPL_ALIASES, Paths, TensorDescriptor, auto_takes_triton, capability, check_impl, check_no_overlap,
                     check_out, check_tensor, cdiv, forward_only, host_values, next_power_of_2, path_key,
                     require_triton, sm_count, tl, triton)
from .launcher import Descriptor, Slot, launch, launch_keyed
from .norm import check_rope_kv, rope_kv_rows
from .pdl import pdl_launch, pdl_launch_args, pdl_option, pdl_wait, prefetch_args, prefetch_l2, sm90_kernel
from .flash_ws import ws_applies, ws_plan
from .split import SCRATCH, last_split
from .varlen import packed_strides

__all__ = [
    "DECODE_IMPLS",
    "FLASH_IMPLS",
    "HEAD_DIMS",
    "MERGE_IMPLS",
    "VARLEN_IMPLS",
    "BACKWARD_IMPLS",
    "decode_attention",
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_varlen",
    "flash_attention_varlen_backward",
    "merge_attention",
    "reference_decode_attention",
    "reference_flash_attention",
    "reference_flash_attention_backward",
    "reference_merge_attention",
    "reference_rope_decode_attention",
    "resolve_impl",
    "rope_decode_attention",
]

FLASH_IMPLS = ("auto", "triton", "cuda", "reference")
DECODE_IMPLS = MERGE_IMPLS = ("auto", "triton", "reference")
BACKWARD_IMPLS = ("auto", "triton", "reference")
VARLEN_IMPLS = ("auto", "triton", "reference")  # flash_attention_varlen(_backward): no TMA / Gluon varlen kernel
HEAD_DIMS = (64, 128, 256)
_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453

# Tile shapes (BLOCK_M, BLOCK_N, num_warps, num_stages) per (impl, head_dim), chosen from the sweep in
# `xelink bench attention --sweep` on an H200 (benchmarks/results/h200-attention, B=1, 32 heads, S=8192, bf16):
# HD=128 non-causal, TMA 128x128 (3 stages) 569 TFLOP/s against 490 for the best block-pointer tiles and
# 531 for TMA 128x64; HD=256, TMA 128x64 (2 stages) 479 against 447 block-pointer and 334 for 128x32.
# So the TMA path pays on sm90 and "auto" takes it there. HD=256 needs BLOCK_N=64 and two stages: a
# 128x256 Q tile plus two K/V stages fill most of shared memory (three stages do not fit).
_FWD_CONFIGS = {
    ("triton", 64): (128, 64, 4, 3),
    ("triton", 128): (128, 128, 8, 3),
    ("triton", 256): (128, 64, 8, 2),
    ("cuda", 64): (128, 128, 8, 3),
    ("cuda", 128): (128, 128, 8, 3),
    ("cuda", 256): (128, 64, 8, 2),
}
# Decode: (BLOCK_N, num_warps, num_stages) per head dim, and the programs per multiprocessor the splits aim at,
# in whole waves (the split count rounds down: a partial second wave costs more than fewer, longer splits). H200
# sweeps: 2 per SM with 3 stages of 64-key tiles beat 3-4 per SM or 128-key tiles; at head dim 128, one per SM
# whose long splits take a fourth stage (below) beat that (B=1 32/8 heads: 16 splits against 33 at 8K / 32K /
# 128K 14.9 / 39.0 / 128.1 us against 15.7 / 40.2 / 134.7; B=8 at 32K 2 splits 246.1 against 5 257.6:
# benchmarks/results/h200-issue23/decode_splits_ab.log). HD=256 halves BLOCK_N to keep the same 32 KB K+V tile
# per stage (64 keys x 3 stages overflows smem).
_DECODE_CONFIGS = {64: (64, 4, 3), 128: (64, 4, 3), 256: (32, 4, 3)}
_DECODE_PROGRAMS_PER_SM = {64: 2, 128: 1, 256: 2}
# Keys per split of the cache at least. 64 (one tile): a W4A16 Llama-3.1-8B step on a 1K + 16 cache took 2.33 ms on
# an H200 with 17 splits a KV head against 2.45 with 256 keys' 5 (benchmarks/results/h200-issue26/rope_decode_ab.log);
# caches of 4K and more are split by the programs a multiprocessor first, and do not change.
_DECODE_MIN_CHUNK = 64
# Keys per split of a sequence at least (kv_lens, at run time): the splits of a sequence shorter than the
# cache. 256 there made 1K of an 8K cache 4 splits a KV head, 11.3 us a layer on an H200 against 10.0 us
# with 16 splits of 64 (the bench decode breakdown at 5042570 and before f625022).
_DECODE_SEQ_MIN_CHUNK = 64
# Bytes of keys and values a split prefetches before its PDL wait at most (pdl.py; H200: 32 KB a program over
# the first 8 MB, 534 us a step's attention at 8K against 569 without and 546 / 592 at 64 / 256 KB a program).
_DECODE_PREFETCH = 32 << 10
# Splits of at least this many keys of the cache, all in one wave, take one more pipeline stage (head dim 128, the
# one measured; H200, B=1, 32/8 heads over 16 splits, 3 -> 4 stages: 39.6 -> 39.0 us at 32K, 134.3 -> 128.1 us
# at 128K, B=8 32K over 2 splits 259.7 -> 246.1; at 8K, 512 keys a split, 14.9 -> 15.1: decode_splits_ab.log).
_DECODE_DEEP_KEYS = 1024
# rope_decode_attention's prefetch of the next kernel's weight: asked for by the programs of sequences of at least
# this many keys, after their keys. On an H100 the Llama-3.1-8B step with its O weight asked for so took 0.85% /
# 0.7% less at 8K / 32K and nothing less at 1K (W4A16 1K: 0.3% more); asked for at the kernel's entry it took
# 0.2-1.5% more everywhere, the prefetch slowing the key reads (benchmarks/results/h100-rows/README.md).
NEXT_MIN_KEYS = 4096
# rope_decode_attention's pdl=None (sm90): launched in stream order (placed early behind the QKV GEMV, its waiting
# programs slowed that GEMV) but letting the next kernel (the O GEMV) go once its main loop is done ("release",
# pdl.py). An H200's Llama-3.1-8B step, release against off: bf16 4.104 / 4.385 / 5.139 ms against 4.119 / 4.404 /
# 5.145 at 1K / 8K / 32K, W4A16 1K 2.241 against 2.260 (benchmarks/results/h200-issue26/rope_decode_ab.log).
DECODE_RELEASE = True


# -- argument checks ----------------------------------------------------------------------------

def _check_qkv(fn: str, q, k, v, *, kv_name: str = "k", dims: int = 4) -> None:
    """Shapes, dtypes and devices shared by flash_attention and decode_attention ((B, H, S, D)) and, ``dims=3``,
    flash_attention_varlen ((rows, H, D): no batch dim)."""
    vname = "v" if kv_name == "k" else "v_cache"
    check_tensor(fn, "q", q, dims)
    check_tensor(fn, kv_name, k, dims)
    check_tensor(fn, vname, v, dims)
    if not q.dtype.is_floating_point:
        raise TypeError(f"{fn}: q.dtype={q.dtype} must be a floating-point dtype")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{fn}: dtypes differ: q.dtype={q.dtype}, {kv_name}.dtype={k.dtype}, {vname}.dtype={v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{fn}: devices differ: q on {q.device}, {kv_name} on {k.device}, {vname} on {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"{fn}: {kv_name}.shape={tuple(k.shape)} != {vname}.shape={tuple(v.shape)}")
    if dims == 4 and k.shape[0] != q.shape[0]:
        raise ValueError(f"{fn}: batch differs: q.shape[0]={q.shape[0]} != {kv_name}.shape[0]={k.shape[0]}")
    d = dims - 1
    if k.shape[d] != q.shape[d]:
        raise ValueError(f"{fn}: head_dim differs: q.shape[{d}]={q.shape[d]} != {kv_name}.shape[{d}]={k.shape[d]}")
    hq, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"{fn}: q heads {hq} must be a multiple of {kv_name} heads {hkv} (GQA)")


def _check_flags(fn: str, causal, scale, return_lse, window=None) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{fn}: window={window!r} must be None or an int >= 1 (the keys a query sees, ending at its "
                         f"last visible one)")
    if not isinstance(causal, bool):
        raise TypeError(f"{fn}: causal={causal!r} must be a bool")
    if not isinstance(return_lse, bool):
        raise TypeError(f"{fn}: return_lse={return_lse!r} must be a bool")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):  # numpy floats too
            raise TypeError(f"{fn}: scale={scale!r} must be a float or None")
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"{fn}: scale={scale!r} must be finite and > 0")


def resolve_impl(fn: str, impl, device: torch.device, allowed=FLASH_IMPLS, **inputs) -> str:
    """The path ``impl`` names on ``device``, of the ``allowed`` ones: ``"auto"`` becomes a concrete path,
    the others are checked (old spellings mapped); ``inputs`` as :func:`common.forward_only` reads them.

    Raises:
        TypeError: a non-str impl.
        ValueError: an impl not in ``allowed``, a kernel path for an input that requires grad, a kernel path
            for a CPU tensor (outside
            ``TRITON_INTERPRET=1``), or ``"cuda"`` where its TMA kernel cannot run (a CUDA device that is
            not compute capability 9, an XPU, a Triton without host tensor descriptors).
        RuntimeError: a kernel path named while Triton is not installed.
    """
    impl = forward_only(fn, check_impl(fn, impl, allowed), **inputs)
    if impl == "auto":
        if not auto_takes_triton(device):
            return "reference"
        if "cuda" in allowed and TensorDescriptor is not None and (capability(device) or (0,))[0] == 9:
            return "cuda"
        return "triton"
    if impl == "reference":
        return impl
    require_triton(fn, impl, device)
    if impl == "cuda":
        if TensorDescriptor is None:
            raise ValueError(f"{fn}: impl='cuda' needs Triton's host tensor descriptors "
                             "(triton.tools.tensor_descriptor), which this Triton lacks; use impl='triton'")
        if device.type == "xpu":
            raise ValueError(f"{fn}: impl='cuda' is NVIDIA's (TMA); {device} is an Intel GPU: use impl='triton'")
        cap = capability(device)
        if cap is not None and cap[0] != 9:
            raise ValueError(f"{fn}: impl='cuda' needs a compute-capability-9 GPU (H100/H200), "
                             f"{device} is sm{cap[0]}{cap[1]}; use impl='triton'")
    return impl


def _fit(path: str, impl: str, q) -> str:
    """impl='auto' takes the reference where no kernel fits (dtype, head dim); a named path does not."""
    if impl == "auto" and path != "reference" and (q.dtype not in _KERNEL_DTYPES or q.shape[-1] not in HEAD_DIMS):
        return "reference"
    return path


def _check_kernel_inputs(fn: str, impl: str, q) -> None:
    if q.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"{fn}: q.dtype={q.dtype} is not supported by impl={impl!r} (bfloat16 or float16; "
                        f"impl='reference' takes any floating dtype)")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"{fn}: head_dim={q.shape[-1]} is not supported by impl={impl!r} "
                         f"(one of {HEAD_DIMS}; impl='reference' takes any)")


# -- references ---------------------------------------------------------------------------------

def _ref_core(q, k, v, row_last, scale, window=None):
    """Grouped attention in float32 (float64 for float64 inputs) with an explicit mask.

    q: (B, Hkv, R, D) rows of the q heads sharing one KV head; k, v: (B, Hkv, Sk, D);
    row_last: (R,) long, the last key index each row may see (-1: none); ``window``: each row sees only the
    ``window`` keys ending at its last one. Returns out (B, Hkv, R, D) and lse (B, Hkv, R), computed over row
    chunks so the score matrix stays small.
    """
    ctype = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, Hkv, R, D = q.shape
    Sk = k.shape[2]
    out = torch.zeros((B, Hkv, R, D), dtype=ctype, device=q.device)
    lse = torch.full((B, Hkv, R), float("-inf"), dtype=ctype, device=q.device)
    if Sk == 0 or R == 0 or B == 0:
        return out, lse
    kf, vf = k.to(ctype), v.to(ctype)
    cols = torch.arange(Sk, device=q.device)
    chunk = max(1, (1 << 24) // max(1, B * Hkv * Sk))
    for r0 in range(0, R, chunk):
        r1 = min(R, r0 + chunk)
        s = torch.matmul(q[:, :, r0:r1].to(ctype), kf.transpose(-1, -2)) * scale
        hidden = cols[None, :] > row_last[r0:r1, None]
        if window is not None:
            hidden |= cols[None, :] <= row_last[r0:r1, None] - window
        s = s.masked_fill(hidden, float("-inf"))
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)
        den = p.sum(-1, keepdim=True)
        empty = den == 0
        out[:, :, r0:r1] = torch.matmul(p, vf) / torch.where(empty, torch.ones_like(den), den)
        lse[:, :, r0:r1] = torch.where(empty, torch.full_like(den, float("-inf")), m + torch.log(den)).squeeze(-1)
    return out, lse


def _grouped(q, hkv):
    """(B, Hq, S, D) -> (B, Hkv, G*S, D): the q heads of one KV head become rows (h = kvh*G + g)."""
    B, Hq, S, D = q.shape
    return q.reshape(B, hkv, (Hq // hkv) * S, D)


def reference_flash_attention(q, k, v, causal=False, scale=None, return_lse=False, *, window=None):
    """Pure-torch twin of ``flash_attention``: float32 math (float64 for float64 inputs), explicit mask.

    Args:
        q: (B, Hq, Sq, D); k, v: (B, Hkv, Sk, D), Hq divisible by Hkv; any floating dtype, any device.
        causal: query i sees keys 0 .. i + Sk - Sq (aligned to the end of the keys).
        scale: softmax scale; default 1/sqrt(D).
        return_lse: also return the float32 natural-log LSE (B, Hq, Sq).
        window: None, or an int >= 1: each query sees only the ``window`` keys ending at its last visible one.

    Returns:
        out (B, Hq, Sq, D) in q's dtype, or (out, lse).
    """
    fn = "reference_flash_attention"
    _check_qkv(fn, q, k, v)
    _check_flags(fn, causal, scale, return_lse, window)
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out, lse = _ref_core(_grouped(q, Hkv), k, v, _row_last(Sq, Sk, Hq // Hkv, causal, q.device), scale, window)
    out = out.reshape(B, Hq, Sq, D).to(q.dtype)
    lse = lse.reshape(B, Hq, Sq).to(torch.float32)
    return (out, lse) if return_lse else out


def _row_last(sq: int, sk: int, g: int, causal: bool, device) -> torch.Tensor:
    """The last key each grouped row (``_grouped``: g q heads of one KV head, sq rows each) may see."""
    t = torch.arange(sq, device=device).repeat(g)
    return t + (sk - sq) if causal else torch.full_like(t, sk - 1)


def _ref_core_backward(q, k, v, dout, lse, delta, row_last, scale, window=None):
    """The gradients of ``_ref_core``'s rows, given the forward's LSE and ``delta`` (the rows' dot products of
    output and output gradient): dq (B, Hkv, R, D), dk, dv (B, Hkv, Sk, D), in float32 (float64 for float64),
    over row chunks as ``_ref_core``, masked as it is (``window``: each row sees the ``window`` keys ending at
    ``row_last``). A row's probabilities are ``exp(s - lse)``: with the LSE of attention over
    more keys than ``k`` (context parallelism) these are the block's share of the row's softmax, so the results
    are the block's contributions."""
    ctype = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, Hkv, R, D = q.shape
    Sk = k.shape[2]
    dq = torch.zeros((B, Hkv, R, D), dtype=ctype, device=q.device)
    dk = torch.zeros((B, Hkv, Sk, D), dtype=ctype, device=q.device)
    dv = torch.zeros((B, Hkv, Sk, D), dtype=ctype, device=q.device)
    if Sk == 0 or R == 0 or B == 0:
        return dq, dk, dv
    kf, vf = k.to(ctype), v.to(ctype)
    cols = torch.arange(Sk, device=q.device)
    chunk = max(1, (1 << 24) // max(1, B * Hkv * Sk))
    for r0 in range(0, R, chunk):
        r1 = min(R, r0 + chunk)
        qc, dc = q[:, :, r0:r1].to(ctype), dout[:, :, r0:r1].to(ctype)
        s = torch.matmul(qc, kf.transpose(-1, -2)) * scale
        hidden = cols[None, :] > row_last[r0:r1, None]
        if window is not None:
            hidden |= cols[None, :] <= row_last[r0:r1, None] - window
        s = s.masked_fill(hidden, float("-inf"))
        m = lse[:, :, r0:r1, None].to(ctype)
        seen = torch.isfinite(m)  # a row that sees no key anywhere (LSE -inf) has no gradient
        p = torch.where(seen, torch.exp(s - torch.where(seen, m, torch.zeros_like(m))), torch.zeros_like(s))
        dv += torch.matmul(p.transpose(-1, -2), dc)
        ds = p * (torch.matmul(dc, vf.transpose(-1, -2)) - delta[:, :, r0:r1, None].to(ctype))
        dq[:, :, r0:r1] = torch.matmul(ds, kf) * scale
        dk += torch.matmul(ds.transpose(-1, -2), qc) * scale
    return dq, dk, dv


def _check_backward(fn: str, dout, q, k, v, out, lse, causal, scale, dlse, window=None, varlen: bool = False) -> None:
    """The backward's arguments: of flash_attention ((B, H, S, D), the LSE (B, Hq, Sq)) or, ``varlen``, of
    flash_attention_varlen (packed (rows, H, D), the LSE (Hq, total_q))."""
    dims = 3 if varlen else 4
    _check_qkv(fn, q, k, v, dims=dims)
    _check_flags(fn, causal, scale, False, window)
    for name, t in (("dout", dout), ("out", out)):
        check_tensor(fn, name, t, dims)
        if t.shape != q.shape:
            raise ValueError(f"{fn}: {name}.shape={tuple(t.shape)} != q.shape={tuple(q.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{fn}: {name}.dtype={t.dtype} must be a floating-point dtype")
    check_tensor(fn, "lse", lse, dims - 1)
    want, what = ((q.shape[1], q.shape[0]), "(Hq, total_q)") if varlen else (tuple(q.shape[:3]), "q.shape[:3]")
    if tuple(lse.shape) != want:
        raise ValueError(f"{fn}: lse.shape={tuple(lse.shape)} must be {what}={want}")
    if lse.dtype != torch.float32:
        raise TypeError(f"{fn}: lse.dtype={lse.dtype} must be torch.float32 "
                        f"({'flash_attention_varlen' if varlen else 'flash_attention'}'s return_lse)")
    if dlse is not None:
        check_tensor(fn, "dlse", dlse, dims - 1)
        if dlse.shape != lse.shape or not dlse.dtype.is_floating_point:
            raise ValueError(f"{fn}: dlse (shape {tuple(dlse.shape)}, {dlse.dtype}) must be a floating tensor of "
                             f"lse's shape {tuple(lse.shape)}")
    for name, t in (("dout", dout), ("out", out), ("lse", lse), ("dlse", dlse)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{fn}: {name} is on {t.device}, q on {q.device}")


def reference_flash_attention_backward(dout, q, k, v, out, lse, causal=False, scale=None, *, dlse=None, window=None):
    """Pure-torch gradients of ``flash_attention`` (``flash_attention_backward``'s reference path; ``window``: the
    forward's sliding window, None or an int >= 1)."""
    _check_backward("reference_flash_attention_backward", dout, q, k, v, out, lse, causal, scale, dlse, window)
    return _reference_backward(dout, q, k, v, out, lse, causal, scale, dlse, window)


def _delta(dout, out, dlse, ctype) -> torch.Tensor:
    """The rows' ``delta`` of the backward: dot(dout, out) less the LSE's gradient (d lse / d s = p, so it enters
    as a shift of delta), in ``ctype``."""
    delta = (dout.to(ctype) * out.to(ctype)).sum(-1)
    return delta if dlse is None else delta - dlse.to(ctype)


def _reference_backward(dout, q, k, v, out, lse, causal, scale, dlse, window=None):
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    delta = _delta(dout, out, dlse, torch.float64 if q.dtype == torch.float64 else torch.float32)
    row_last = _row_last(Sq, Sk, Hq // Hkv, causal, q.device)
    dq, dk, dv = _ref_core_backward(_grouped(q, Hkv), k, v, _grouped(dout, Hkv), lse.reshape(B, Hkv, -1),
                                    delta.reshape(B, Hkv, -1), row_last, scale, window)
    return dq.reshape(B, Hq, Sq, D), dk, dv


def _check_merge(fn: str, outs, lses):
    if isinstance(outs, torch.Tensor):
        outs = list(outs.unbind(0))
    if isinstance(lses, torch.Tensor):
        lses = list(lses.unbind(0))
    if not isinstance(outs, (list, tuple)) or not isinstance(lses, (list, tuple)):
        raise TypeError(f"{fn}: outs and lses must be sequences of tensors, got {type(outs).__name__} "
                        f"and {type(lses).__name__}")
    if len(outs) == 0:
        raise ValueError(f"{fn}: outs is empty; give at least one partial result")
    if len(outs) != len(lses):
        raise ValueError(f"{fn}: len(outs)={len(outs)} != len(lses)={len(lses)}")
    for i, (o, s) in enumerate(zip(outs, lses)):
        check_tensor(fn, f"outs[{i}]", o, 4)
        check_tensor(fn, f"lses[{i}]", s, 3)
        if o.shape != outs[0].shape:
            raise ValueError(f"{fn}: outs[{i}].shape={tuple(o.shape)} != outs[0].shape={tuple(outs[0].shape)}")
        if o.dtype != outs[0].dtype or not o.dtype.is_floating_point:
            raise TypeError(f"{fn}: outs[{i}].dtype={o.dtype} must be floating and equal outs[0].dtype={outs[0].dtype}")
        if s.shape != o.shape[:3]:
            raise ValueError(f"{fn}: lses[{i}].shape={tuple(s.shape)} must be outs[{i}].shape[:3]={tuple(o.shape[:3])}")
        if s.dtype != torch.float32:
            raise TypeError(f"{fn}: lses[{i}].dtype={s.dtype} must be torch.float32")
        if o.device != outs[0].device or s.device != outs[0].device:
            raise ValueError(f"{fn}: outs[{i}] on {o.device} / lses[{i}] on {s.device}, outs[0] on {outs[0].device}")
    return list(outs), list(lses)


def reference_merge_attention(outs, lses):
    """Pure-torch twin of ``merge_attention`` (float32 math)."""
    outs, lses = _check_merge("reference_merge_attention", outs, lses)
    L = torch.stack(lses)  # (n, B, H, S)
    m = L.amax(0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(L - m)
    den = w.sum(0)
    acc = torch.zeros(outs[0].shape, dtype=torch.float32, device=outs[0].device)
    for wi, o in zip(w, outs):
        # A shard with no weight contributes nothing, even if its output holds NaN (an empty shard).
        acc += torch.where(wi[..., None] > 0, wi[..., None] * o.float(), torch.zeros_like(acc))
    empty = den == 0
    out = acc / torch.where(empty, torch.ones_like(den), den)[..., None]
    lse = torch.where(empty, torch.full_like(den, float("-inf")), m + torch.log(den))
    return out.to(outs[0].dtype), lse


def _check_decode(fn: str, q, k_cache, v_cache, kv_lens, num_splits):
    _check_qkv(fn, q, k_cache, v_cache, kv_name="k_cache")
    if q.shape[2] < 1:
        raise ValueError(f"{fn}: q.shape={tuple(q.shape)} needs at least one query token (dim 2)")
    if not isinstance(kv_lens, torch.Tensor):
        raise TypeError(f"{fn}: kv_lens must be a torch.Tensor of shape (batch,), got {type(kv_lens).__name__}")
    if kv_lens.dim() != 1 or kv_lens.shape[0] != q.shape[0]:
        raise ValueError(f"{fn}: kv_lens.shape={tuple(kv_lens.shape)} must be (batch,)=({q.shape[0]},)")
    if kv_lens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: kv_lens.dtype={kv_lens.dtype} must be torch.int32 or torch.int64")
    if kv_lens.device != q.device:
        raise ValueError(f"{fn}: kv_lens on {kv_lens.device}, q on {q.device}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"{fn}: num_splits={num_splits!r} must be a positive int or None")


def reference_decode_attention(q, k_cache, v_cache, kv_lens, causal=False, scale=None, return_lse=False, *,
                               window=None):
    """Pure-torch twin of ``decode_attention``: batch b attends to ``k_cache[b, :, :kv_lens[b]]`` (the last
    ``window`` keys of what each query sees, with a window).

    ``kv_lens`` values are clamped to [0, k_cache.shape[2]], as in the kernel.
    """
    fn = "reference_decode_attention"
    _check_decode(fn, q, k_cache, v_cache, kv_lens, None)
    _check_flags(fn, causal, scale, return_lse, window)
    B, Hq, Sq, D = q.shape
    smax = k_cache.shape[2]
    outs, lses = [], []
    for b, n in enumerate(kv_lens.tolist()):
        n = min(max(int(n), 0), smax)
        o, s = reference_flash_attention(q[b:b + 1], k_cache[b:b + 1, :, :n], v_cache[b:b + 1, :, :n],
                                         causal=causal, scale=scale, return_lse=True, window=window)
        outs.append(o)
        lses.append(s)
    out = torch.cat(outs) if outs else q.new_zeros(q.shape)
    lse = torch.cat(lses) if lses else q.new_zeros((0, Hq, Sq), dtype=torch.float32)
    return (out, lse) if return_lse else out


def _check_ring(fn: str, ring, window) -> None:
    if not isinstance(ring, bool):
        raise TypeError(f"{fn}: ring={ring!r} must be a bool")
    if ring and window is not None:
        raise ValueError(f"{fn}: window={window!r} with ring=True: a ring cache's rows are the window (its Smax "
                         f"latest positions); pass window=None")


def reference_rope_decode_attention(q, k, v, cos, sin, k_cache, v_cache, kv_lens, scale=None, *, window=None,
                                    ring=False):
    """Pure-torch twin of ``rope_decode_attention``: ``reference_rope_kv`` at ``kv_lens - 1`` (the caches
    written; ``ring``: at row ``(kv_lens - 1) % Smax``), then ``reference_decode_attention`` of the rotated q
    (over the ``min(kv_lens, Smax)`` rows in use)."""
    fn = "reference_rope_decode_attention"
    _check_flags(fn, False, scale, False, window)
    _check_ring(fn, ring, window)
    pos = kv_lens - 1
    qr = rope_kv_rows(q, k, v, cos, sin, pos, pos % k_cache.shape[2] if ring else pos, k_cache, v_cache)
    return reference_decode_attention(qr, k_cache, v_cache, kv_lens, scale=scale, window=window)


# -- Triton kernels -----------------------------------------------------------------------------

if triton is not None:
    from .varlen import varlen_ids, varlen_sequence

    @triton.jit
    def _attn_tile(acc, l_i, m_i, q, k, v, offs_n, row_last, n_end, qk_scale, MASKED: tl.constexpr,
                   row_first=None, WINDOWED: tl.constexpr = False):
        """One KV tile of the online softmax (log2 domain); MASKED tiles apply the causal/length mask (WINDOWED:
        and each row's first key, a sliding window's)."""
        qk = tl.dot(q, tl.trans(k))
        if MASKED:
            keep = (offs_n[None, :] <= row_last[:, None]) & (offs_n[None, :] < n_end)
            if WINDOWED:
                keep = keep & (offs_n[None, :] >= row_first[:, None])
            s = tl.where(keep, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row with no visible key so far keeps m = -inf; subtract 0 instead so p = 0, not NaN.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
        else:
            # Every key of an unmasked tile is visible to every row, so m_new is finite here.
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        return acc, l_i, m_new

    @triton.jit
    def _attn_finish(acc, l_i, m_i):
        """Normalised output and natural-log LSE; rows that saw no key give 0 and -inf."""
        empty = l_i == 0.0
        inv = 1.0 / tl.where(empty, 1.0, l_i)
        out = acc * inv[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        return out, lse

    @triton.jit
    def _attn_blockptr_loop(q, k_ptr, v_ptr, lo, full, end, row_last, n_end, qk_scale,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                            head=0, row_first=None, WINDOWED: tl.constexpr = False):
        """Online softmax over keys [lo, end) read through block pointers positioned at lo.

        Tiles below ``full`` need no mask and no bounds check; the rest are masked and zero-padded. WINDOWED
        (a sliding window: row r sees keys from ``row_first[r]``): the tiles [lo, head) are masked too.
        Returns the normalised output tile and its LSE.
        """
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        if WINDOWED:
            acc, l_i, m_i, k_ptr, v_ptr = _attn_masked_tiles(acc, l_i, m_i, q, k_ptr, v_ptr, lo, head, row_first,
                                                             row_last, n_end, qk_scale, BLOCK_N, True)
            lo = head
        for start_n in range(lo, full, BLOCK_N):
            k = tl.load(k_ptr)
            v = tl.load(v_ptr)
            acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, k, v, start_n, row_last, n_end, qk_scale, False)
            k_ptr = tl.advance(k_ptr, (BLOCK_N, 0))
            v_ptr = tl.advance(v_ptr, (BLOCK_N, 0))
        acc, l_i, m_i, k_ptr, v_ptr = _attn_masked_tiles(acc, l_i, m_i, q, k_ptr, v_ptr, full, end, row_first,
                                                         row_last, n_end, qk_scale, BLOCK_N, WINDOWED)
        return _attn_finish(acc, l_i, m_i)

    @triton.jit
    def _attn_masked_tiles(acc, l_i, m_i, q, k_ptr, v_ptr, lo, hi, row_first, row_last, n_end, qk_scale,
                           BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr):
        """The masked, zero-padded tiles [lo, hi) of ``_attn_blockptr_loop`` (block pointers at lo): the state
        and the block pointers advanced past them."""
        for start_n in range(lo, hi, BLOCK_N):
            k = tl.load(k_ptr, boundary_check=(0,), padding_option="zero")
            v = tl.load(v_ptr, boundary_check=(0,), padding_option="zero")
            offs_n = start_n + tl.arange(0, BLOCK_N)
            acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, k, v, offs_n, row_last, n_end, qk_scale, True, row_first,
                                       WINDOWED)
            k_ptr = tl.advance(k_ptr, (BLOCK_N, 0))
            v_ptr = tl.advance(v_ptr, (BLOCK_N, 0))
        return acc, l_i, m_i, k_ptr, v_ptr

    @triton.jit
    def _window_bounds(row_first, full, BLOCK_N: tl.constexpr):
        """A sliding window's key tiles for a query block whose rows see keys from ``row_first`` on: (lo, the
        tile of the first row's first key; head, the first tile every row sees whole, at most ``full``)."""
        lo = tl.maximum(tl.min(row_first, 0), 0) // BLOCK_N * BLOCK_N
        head = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(tl.max(row_first, 0), 0), BLOCK_N) * BLOCK_N, lo), full)
        return lo, head

    @triton.jit
    def _causal_bounds(m0, SQ, SK, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
        """Key ranges of a query block: [0, full) needs no mask, [full, end) does."""
        if CAUSAL:
            off = SK - SQ
            full = tl.minimum(m0 + off + 1, SK)
            end = tl.minimum(m0 + BLOCK_M + off, SK)
        else:
            full = SK
            end = SK
        full = tl.maximum(full, 0) // BLOCK_N * BLOCK_N
        return full, end

    @triton.jit(do_not_specialize=["H", "GROUP", "SQ", "SK", "WINDOW"])
    def _flash_fwd_kernel(
        Q, K, V, O, LSE,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_ob, stride_oh, stride_om, stride_od,
        H, GROUP, SQ, SK, qk_scale, WINDOW,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
        PDL: tl.constexpr = 0, WINDOWED: tl.constexpr = False, VARLEN: tl.constexpr = False, CU_Q=None, CU_K=None,
    ):
        """Portable forward: one program per (query block, batch*head), block pointers only. WINDOWED: each row
        sees the WINDOW keys ending at its last visible one (a sliding window), the keys before the block's
        first row's window skipped.

        VARLEN (``flash_attention_varlen``): packed sequences, "batch" b is sequence b, its queries rows
        ``CU_Q[b] .. CU_Q[b + 1]`` of Q (total_q, H, D), its keys rows ``CU_K[b] .. CU_K[b + 1]`` of K and V; the
        batch strides are 0, SQ is total_q (the row stride of LSE, (H, total_q)) and SK unused; the grid is
        (B * H, query blocks of the longest sequence), and a block past its own sequence's queries returns at once.
        The rest runs as for one sequence of those lengths (the block pointers' shapes mask the tails)."""
        pdl_wait(PDL)  # q, k and v may be the previous kernel's output
        pid_m, blocks, bh = varlen_ids(VARLEN)
        if CAUSAL:  # the longest query blocks first, so the short ones fill the tail of the grid
            pid_m = blocks - 1 - pid_m
        b = (bh // H).to(tl.int64)
        h = bh % H
        kvh = (h // GROUP).to(tl.int64)
        m0 = pid_m * BLOCK_M
        if VARLEN:
            q0, k0, sq, sk = varlen_sequence(CU_Q, CU_K, b)
            lse_row = h.to(tl.int64) * SQ + q0
            SQ, SK = sq, sk
            if m0 >= SQ:  # a query block past this sequence's end
                return
            Q += q0 * stride_qm
            K += k0 * stride_kn
            V += k0 * stride_vn
            O += q0 * stride_om
        offs_m = m0 + tl.arange(0, BLOCK_M)
        if CAUSAL:
            row_last = offs_m + (SK - SQ)
        else:
            row_last = offs_m * 0 + (SK - 1)
        full, end = _causal_bounds(m0, SQ, SK, BLOCK_M, BLOCK_N, CAUSAL)
        lo = 0
        head = 0
        row_first = row_last - WINDOW + 1
        if WINDOWED:  # from the tile of the block's first row's first key; masked up to the last row's
            lo, head = _window_bounds(row_first, full, BLOCK_N)
        q_ptr = tl.make_block_ptr(Q + b * stride_qb + h.to(tl.int64) * stride_qh, (SQ, HEAD_DIM),
                                  (stride_qm, stride_qd), (m0, 0), (BLOCK_M, HEAD_DIM), (1, 0))
        k_ptr = tl.make_block_ptr(K + b * stride_kb + kvh * stride_kh, (SK, HEAD_DIM),
                                  (stride_kn, stride_kd), (lo, 0), (BLOCK_N, HEAD_DIM), (1, 0))
        v_ptr = tl.make_block_ptr(V + b * stride_vb + kvh * stride_vh, (SK, HEAD_DIM),
                                  (stride_vn, stride_vd), (lo, 0), (BLOCK_N, HEAD_DIM), (1, 0))
        q = tl.load(q_ptr, boundary_check=(0,), padding_option="zero")
        out, lse = _attn_blockptr_loop(q, k_ptr, v_ptr, lo, full, end, row_last, SK, qk_scale,
                                       BLOCK_M, BLOCK_N, HEAD_DIM, head, row_first, WINDOWED)
        pdl_launch(PDL)
        o_ptr = tl.make_block_ptr(O + b * stride_ob + h.to(tl.int64) * stride_oh, (SQ, HEAD_DIM),
                                  (stride_om, stride_od), (m0, 0), (BLOCK_M, HEAD_DIM), (1, 0))
        tl.store(o_ptr, out.to(O.dtype.element_ty), boundary_check=(0,))
        if VARLEN:
            tl.store(LSE + lse_row + offs_m, lse, mask=offs_m < SQ)
        else:
            tl.store(LSE + bh.to(tl.int64) * SQ + offs_m, lse, mask=offs_m < SQ)

    @triton.jit(do_not_specialize=["H", "HKV", "GROUP", "SQ", "SK", "WINDOW"])
    def _flash_fwd_tma_kernel(
        q_desc, k_desc, v_desc, O, LSE,
        stride_ob, stride_oh, stride_om, stride_od,
        H, HKV, GROUP, SQ, SK, qk_scale, WINDOW,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
        PDL: tl.constexpr = 0, WINDOWED: tl.constexpr = False,
    ):
        """sm90 forward: Q/K/V tiles through TMA descriptors over the (B*H*S, D) row view.

        A tile that runs past its head's last key reads the next head's rows (or TMA's zero fill past
        the tensor): the mask drops those keys and their V rows are zeroed, so they cannot leak in.
        WINDOWED: a sliding window of WINDOW keys, as the portable kernel's.
        """
        pdl_wait(PDL)
        pid_m = tl.program_id(0)
        if CAUSAL:
            pid_m = tl.num_programs(0) - 1 - pid_m
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        kvh = h // GROUP
        m0 = pid_m * BLOCK_M
        q = q_desc.load([bh * SQ + m0, 0])
        kv_row = (b * HKV + kvh) * SK
        offs_m = m0 + tl.arange(0, BLOCK_M)
        if CAUSAL:
            row_last = offs_m + (SK - SQ)
        else:
            row_last = offs_m * 0 + (SK - 1)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        full, end = _causal_bounds(m0, SQ, SK, BLOCK_M, BLOCK_N, CAUSAL)
        head = 0
        row_first = row_last - WINDOW + 1
        if WINDOWED:  # the window's first tiles masked (they lie below full: this head's own rows)
            lo, head = _window_bounds(row_first, full, BLOCK_N)
            for start_n in range(lo, head, BLOCK_N):
                k = k_desc.load([kv_row + start_n, 0])
                v = v_desc.load([kv_row + start_n, 0])
                acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, k, v, start_n + tl.arange(0, BLOCK_N), row_last, SK,
                                           qk_scale, True, row_first, True)
        for start_n in range(head, full, BLOCK_N):
            k = k_desc.load([kv_row + start_n, 0])
            v = v_desc.load([kv_row + start_n, 0])
            acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, k, v, start_n, row_last, SK, qk_scale, False)
        for start_n in range(full, end, BLOCK_N):
            k = k_desc.load([kv_row + start_n, 0])
            v = v_desc.load([kv_row + start_n, 0])
            offs_n = start_n + tl.arange(0, BLOCK_N)
            v = tl.where((offs_n < SK)[:, None], v, 0.0)
            acc, l_i, m_i = _attn_tile(acc, l_i, m_i, q, k, v, offs_n, row_last, SK, qk_scale, True, row_first,
                                       WINDOWED)
        out, lse = _attn_finish(acc, l_i, m_i)
        pdl_launch(PDL)
        o_ptr = tl.make_block_ptr(O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh, (SQ, HEAD_DIM),
                                  (stride_om, stride_od), (m0, 0), (BLOCK_M, HEAD_DIM), (1, 0))
        tl.store(o_ptr, out.to(O.dtype.element_ty), boundary_check=(0,))
        tl.store(LSE + bh.to(tl.int64) * SQ + offs_m, lse, mask=offs_m < SQ)

    @triton.jit
    def _merge_rows(LSEP, OP, OUT, LSE_OUT, b, kvh, rows, n_rows, n_splits, n_used, hq, GROUP, SQ,
                    stride_xb, stride_xh, stride_xs, stride_xd,
                    HEAD_DIM: tl.constexpr, MERGE_ROWS: tl.constexpr, UNROLL: tl.constexpr):
        # The splits' partials of up to MERGE_ROWS rows merged in split order, UNROLL splits a round loaded as
        # one tile (one L2 round trip a round: a round of one split waited 6-7 us over 33 splits on an H200).
        # Only the first n_used splits hold keys (the rest are empty: weight 0, skipped; n_splits is the stride).
        ok_rows = rows < n_rows
        t = rows % SQ
        h = kvh * GROUP + rows // SQ
        part = (b * hq + h).to(tl.int64) * SQ + t
        offs_d = tl.arange(0, HEAD_DIM)
        lp = LSEP + part * n_splits
        op = OP + (part * n_splits)[:, None, None] * HEAD_DIM + offs_d[None, None, :]
        m = tl.full([MERGE_ROWS], float("-inf"), tl.float32)
        den = tl.zeros([MERGE_ROWS], tl.float32)
        acc = tl.zeros([MERGE_ROWS, HEAD_DIM], tl.float32)
        for s0 in range(0, n_used, UNROLL):
            su = s0 + tl.arange(0, UNROLL)
            ok = ok_rows[:, None] & (su < n_used)[None, :]
            ls = tl.load(lp[:, None] + su[None, :], mask=ok, other=float("-inf"), cache_modifier=".cg")
            o = tl.load(op + su[None, :, None] * HEAD_DIM, mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m, tl.max(ls, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_use)
            w = tl.exp(ls - m_use[:, None])
            acc = acc * alpha[:, None] + tl.sum(tl.where(w[:, :, None] > 0, w[:, :, None] * o, 0.0), axis=1)
            den = den * alpha + tl.sum(w, axis=1)
            m = m_new
        empty = den == 0.0
        merged = acc / tl.where(empty, 1.0, den)[:, None]
        x_off = (b.to(tl.int64) * stride_xb + h.to(tl.int64)[:, None] * stride_xh + t[:, None] * stride_xs
                 + offs_d[None, :] * stride_xd)
        tl.store(OUT + x_off, merged.to(OUT.dtype.element_ty), mask=ok_rows[:, None])
        lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, den)))
        tl.store(LSE_OUT + part, lse, mask=ok_rows)

    @triton.jit
    def _split_keys(KV_LENS, b, SMAX, split, n_splits, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr, BACK=0,
                    WINDOWED: tl.constexpr = False):
        """(kv_len, keys a split, this split's first and end key, the sequence's first key) of sequence b: the
        splits share keys [first, kv_len), first = 0, or WINDOWED kv_len - BACK (the first key any query's
        window reaches)."""
        kv_len = tl.minimum(tl.maximum(tl.load(KV_LENS + b).to(tl.int32), 0), SMAX)
        first = kv_len * 0
        if WINDOWED:
            first = tl.maximum(kv_len - BACK, 0)
        chunk = tl.maximum(tl.cdiv(tl.cdiv(kv_len - first, n_splits), BLOCK_N) * BLOCK_N, MIN_CHUNK)
        lo = first + split * chunk
        return kv_len, chunk, lo, tl.minimum(lo + chunk, kv_len), first

    @triton.jit
    def _prefetch_keys(X, lo, hi, stride_n, HEAD_DIM: tl.constexpr, PIECES: tl.constexpr, LIMIT: tl.constexpr):
        """Cache rows [lo, hi) of one (batch, KV head) at X into L2 (pdl.py)."""
        n = tl.where(hi > lo, (hi - lo - 1).to(tl.int64) * stride_n + HEAD_DIM, 0)
        prefetch_l2(X + lo.to(tl.int64) * stride_n + tl.zeros([1], tl.int64),
                    n * (X.dtype.element_ty.primitive_bitwidth // 8), PIECES, LIMIT)

    @triton.jit
    def _prefetch_next(NXT, NEXT_BYTES, PIECES: tl.constexpr):
        """This program's share of the NEXT_BYTES bytes at NXT into L2 (the next kernel's input, which this
        kernel neither reads nor writes: a hint, pdl.py), in PIECES bulk prefetches."""
        p = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
        share = (tl.cdiv(NEXT_BYTES, tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)) + 15) // 16 * 16
        lo = p.to(tl.int64) * share
        prefetch_l2(NXT.to(tl.pointer_type(tl.uint8)) + lo + tl.zeros([1], tl.int64),
                    tl.minimum(share, NEXT_BYTES - lo), PIECES, 1 << 30)

    @triton.jit
    def _rotate_halves(x1, x2, c1, c2, s1, s2):
        """Rotate-half RoPE of a row split in halves, in float32, rounded once to x's dtype: the expressions of
        norm.py's rope kernels, so that the fused decode rounds (and contracts into FMAs) as rope_kv does."""
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        return (x1f * c1 - x2f * s1).to(x1.dtype), (x2f * c2 + x1f * s2).to(x1.dtype)

    @triton.jit
    def _rope_new_token(Q, KN, VN, COS, SIN, k_base, v_base, b, kvh, h, t, row_ok, pos, row, lo, hi,
                        stride_qb, stride_qh, stride_qm, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd,
                        stride_nkb, stride_nkh, stride_nvb, stride_nvh, stride_cos, stride_sin,
                        HEAD_DIM: tl.constexpr):
        """rope_kv inside the decode kernel: q's rows rotated at position ``pos`` (returned, [rows, HEAD_DIM]);
        the split that holds cache row ``row`` (``pos``, or a ring cache's ``pos % SMAX``) also rotates the new
        key and writes it and the new value there, then orders its block after those stores before any thread
        reads the cache."""
        HALF: tl.constexpr = HEAD_DIM // 2
        offs_h = tl.arange(0, HALF)
        p = tl.maximum(pos, 0).to(tl.int64)
        c1 = tl.load(COS + p * stride_cos + offs_h).to(tl.float32)
        c2 = tl.load(COS + p * stride_cos + HALF + offs_h).to(tl.float32)
        s1 = tl.load(SIN + p * stride_sin + offs_h).to(tl.float32)
        s2 = tl.load(SIN + p * stride_sin + HALF + offs_h).to(tl.float32)
        q_row = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64)[:, None] * stride_qh + t[:, None] * stride_qm
        x1 = tl.load(q_row + offs_h[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
        x2 = tl.load(q_row + (HALF + offs_h)[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
        q1, q2 = _rotate_halves(x1, x2, c1[None, :], c2[None, :], s1[None, :], s2[None, :])
        if (row >= lo) & (row < hi):
            kn = KN + b.to(tl.int64) * stride_nkb + kvh.to(tl.int64) * stride_nkh
            k1, k2 = _rotate_halves(tl.load(kn + offs_h), tl.load(kn + HALF + offs_h), c1, c2, s1, s2)
            r = row.to(tl.int64)  # (>= lo >= 0)
            k_row = k_base + r * stride_kn
            tl.store(k_row + offs_h * stride_kd, k1)
            tl.store(k_row + (HALF + offs_h) * stride_kd, k2)
            offs_d = tl.arange(0, HEAD_DIM)
            vn = tl.load(VN + b.to(tl.int64) * stride_nvb + kvh.to(tl.int64) * stride_nvh + offs_d)
            tl.store(v_base + r * stride_vn + offs_d * stride_vd, vn)
            tl.debug_barrier()  # the block's later cache reads (other threads) see the new row
        # [rows, HALF] x 2 -> [rows, HEAD_DIM]: element (r, j * HALF + i) from half j
        return tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (q1.shape[0], HEAD_DIM))

    @triton.jit(do_not_specialize=["HKV", "GROUP", "SQ", "SMAX", "NEXT_BYTES", "WINDOW", "BACK"])
    def _decode_split_kernel(
        Q, K, V, KV_LENS, OP, LSEP, OUT, LSE_OUT, COUNTERS, KN, VN, COS, SIN, NXT,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_xb, stride_xh, stride_xs, stride_xd,
        stride_nkb, stride_nkh, stride_nvb, stride_nvh, stride_cos, stride_sin,
        HKV, GROUP, SQ, SMAX, qk_scale, NEXT_BYTES, WINDOW, BACK,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
        MERGE_ROWS: tl.constexpr, UNROLL: tl.constexpr, MIN_CHUNK: tl.constexpr, PDL: tl.constexpr,
        PREFETCH: tl.constexpr = 0, PIECES: tl.constexpr = 1, LIMIT: tl.constexpr = 0, ROPE: tl.constexpr = False,
        NEXT_PIECES: tl.constexpr = 0, NEXT_MIN_KEYS: tl.constexpr = 0, WINDOWED: tl.constexpr = False,
        RING: tl.constexpr = False,
    ):
        """One KV split of one (batch, KV head) for all its q heads x query tokens, packed as rows.

        ``ROPE`` (one query token a sequence): q and the new key KN come unrotated, and the kernel does
        ``rope_kv``'s work first, at position ``kv_len - 1`` (rows of COS / SIN; KN, VN: (B, HKV, 1, D) views).

        A split covers ``max(ceil(kv_len / splits), MIN_CHUNK)`` keys (whole BLOCK_N blocks): a cache much
        longer than its sequence (a static cache early in a decode) leaves the splits past ``kv_len`` empty
        and the merge reads only the splits that hold keys. (Dealing the tiles out in turn instead, so that
        a head's programs read one stretch of the cache at a time, measured no faster on an H200: 54ccd1c,
        benchmarks/results/h200-issue23.)

        Partial results go to OP (B, Hq, SQ, splits, D) and LSEP (B, Hq, SQ, splits), float32,
        contiguous; an empty split writes 0 and -inf. The last split of a row block to finish (a ticket of
        COUNTERS, one a (batch, KV head, row block): split.py) merges the splits' partials with
        ``_merge_kernel``'s weights (online, in split order) into OUT (strides x) and LSE_OUT (B, Hq, SQ)
        contiguous.

        ``WINDOWED``: each row sees the WINDOW keys ending at its last visible one (a sliding window); the splits
        share the keys from ``kv_len - BACK`` (BACK = WINDOW, plus SQ - 1 when causal).

        ``RING`` (with ``ROPE``): the caches are rings of SMAX rows. A sequence of kv_lens[b] tokens holds its
        latest min(kv_lens[b], SMAX) positions, position p at row p % SMAX (keys stored rotated, so their order
        does not matter to the softmax): the new token (position kv_lens[b] - 1) is written at its row and
        attends to every row in use.

        ``NEXT_PIECES`` > 0: once their keys are read, the programs of a sequence of at least NEXT_MIN_KEYS keys
        ask L2 for their share of the NEXT_BYTES bytes at NXT (the next kernel's weight: HBM is idle while the
        splits end, merge and the next kernel starts).
        """
        split = tl.program_id(0)
        n_splits = tl.num_programs(0)
        bk = tl.program_id(1)
        b = bk // HKV
        kvh = bk % HKV
        rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < GROUP * SQ
        t = rows % SQ
        h = kvh * GROUP + rows // SQ
        offs_d = tl.arange(0, HEAD_DIM)
        k_base = K + b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
        v_base = V + b.to(tl.int64) * stride_vb + kvh.to(tl.int64) * stride_vh
        if PREFETCH:
            # The split's keys and values into L2 while the previous kernel ends (the first PREFETCH
            # programs); kv_lens read before the wait may be stale (the previous kernel may write it): it
            # only moves the hint.
            if split + n_splits * (bk + tl.num_programs(1) * tl.program_id(2)) < PREFETCH:
                _, _, lo, hi, _ = _split_keys(KV_LENS, b, SMAX, split, n_splits, BLOCK_N, MIN_CHUNK, BACK, WINDOWED)
                _prefetch_keys(k_base, lo, hi, stride_kn, HEAD_DIM, PIECES, LIMIT // 2)
                _prefetch_keys(v_base, lo, hi, stride_vn, HEAD_DIM, PIECES, LIMIT // 2)
        pdl_wait(PDL)  # q (and the cache) may be the previous kernel's output
        kv_len, chunk, lo, hi, first = _split_keys(KV_LENS, b, SMAX, split, n_splits, BLOCK_N, MIN_CHUNK, BACK,
                                                   WINDOWED)
        # (Asking L2 for the first key and value tiles here, ahead of the RoPE's loads, made the Llama-3.1-8B step
        # 0.3-2% slower on an H100: benchmarks/results/h100-rows/early_keys_ab.log.)
        if ROPE:
            pos = kv_len - 1
            row = pos
            if RING:  # the position itself, unclamped (kv_len is the rows in use)
                pos = tl.load(KV_LENS + b).to(tl.int32) - 1
                row = pos % SMAX
            q = _rope_new_token(Q, KN, VN, COS, SIN, k_base, v_base, b, kvh, h, t, row_ok, pos, row, lo, hi,
                                stride_qb, stride_qh, stride_qm, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd,
                                stride_nkb, stride_nkh, stride_nvb, stride_nvh, stride_cos, stride_sin, HEAD_DIM)
        else:
            q_off = (b.to(tl.int64) * stride_qb + h.to(tl.int64)[:, None] * stride_qh + t[:, None] * stride_qm
                     + offs_d[None, :] * stride_qd)
            q = tl.load(Q + q_off, mask=row_ok[:, None], other=0.0)
        if CAUSAL:
            row_last = kv_len - SQ + t
            first_last = kv_len - SQ
        else:
            row_last = t * 0 + (kv_len - 1)
            first_last = kv_len - 1
        n_used = tl.maximum(tl.minimum(tl.cdiv(kv_len - first, chunk), n_splits), 1)
        full = lo + tl.maximum(tl.minimum(hi, first_last + 1) - lo, 0) // BLOCK_N * BLOCK_N
        row_first = row_last - WINDOW + 1
        head = lo
        if WINDOWED:  # masked up to the last row's first key (one query token, or no causal mask: none)
            head = tl.minimum(lo + tl.cdiv(tl.maximum(tl.max(row_first, 0) - lo, 0), BLOCK_N) * BLOCK_N, full)
        # The block pointers end at this split's last key: the zero padding then covers the tail.
        k_ptr = tl.make_block_ptr(k_base, (hi, HEAD_DIM), (stride_kn, stride_kd), (lo, 0), (BLOCK_N, HEAD_DIM),
                                  (1, 0))
        v_ptr = tl.make_block_ptr(v_base, (hi, HEAD_DIM), (stride_vn, stride_vd), (lo, 0), (BLOCK_N, HEAD_DIM),
                                  (1, 0))
        out, lse = _attn_blockptr_loop(q, k_ptr, v_ptr, lo, full, hi, row_last, hi, qk_scale,
                                       BLOCK_M, BLOCK_N, HEAD_DIM, head, row_first, WINDOWED)
        if NEXT_PIECES:
            if kv_len >= NEXT_MIN_KEYS:
                _prefetch_next(NXT, NEXT_BYTES, NEXT_PIECES)
        pdl_launch(PDL)
        hq = HKV * GROUP
        part = (b * hq + h).to(tl.int64) * SQ + t  # (b, h, t) row of the partial tensors
        tl.store(OP + (part * n_splits + split)[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_ok[:, None])
        tl.store(LSEP + part * n_splits + split, lse, mask=row_ok)
        # The last split of the block to finish merges its rows, MERGE_ROWS at a time (the block's real rows
        # only: a GQA group of 4 fills 4 of its 16).
        if last_split(COUNTERS, bk * tl.num_programs(2) + tl.program_id(2), n_splits):
            first = tl.program_id(2) * BLOCK_M
            n_rows = tl.minimum(GROUP * SQ, first + BLOCK_M)
            for r0 in range(first, n_rows, MERGE_ROWS):
                _merge_rows(LSEP, OP, OUT, LSE_OUT, b, kvh, r0 + tl.arange(0, MERGE_ROWS), n_rows, n_splits, n_used,
                            HKV * GROUP, GROUP, SQ, stride_xb, stride_xh, stride_xs, stride_xd, HEAD_DIM, MERGE_ROWS,
                            UNROLL)

    @triton.jit(do_not_specialize=["N", "H", "S", "D"])
    def _merge_kernel(
        O, LSE, OUT, LSE_OUT,
        stride_on, stride_ob, stride_oh, stride_os, stride_od,
        stride_ln, stride_lb, stride_lh, stride_ls,
        stride_xb, stride_xh, stride_xs, stride_xd,
        N, H, S, D,
        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
    ):
        """out = sum_i w_i o_i / sum_i w_i with w_i = exp(lse_i - max lse); LSE_OUT is (B, H, S) contiguous."""
        pid_s = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_ok = offs_s < S
        od_ok = s_ok[:, None] & (offs_d[None, :] < D)
        lse_ptr = LSE + b * stride_lb + h * stride_lh + offs_s * stride_ls
        o_ptr = O + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os + offs_d[None, :] * stride_od
        pdl_wait(PDL)  # the partials are the previous kernel's output
        m = tl.full([BLOCK_S], float("-inf"), tl.float32)
        p = lse_ptr
        for _ in range(N):  # pointers step shard by shard: no index product to overflow
            m = tl.maximum(m, tl.load(p, mask=s_ok, other=float("-inf")))
            p += stride_ln
        m_use = tl.where(m == float("-inf"), 0.0, m)
        den = tl.zeros([BLOCK_S], tl.float32)
        acc = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
        for _ in range(N):
            w = tl.exp(tl.load(lse_ptr, mask=s_ok, other=float("-inf")) - m_use)
            o = tl.load(o_ptr, mask=od_ok, other=0.0).to(tl.float32)
            acc += tl.where(w[:, None] > 0, w[:, None] * o, 0.0)
            den += w
            lse_ptr += stride_ln
            o_ptr += stride_on
        empty = den == 0.0
        out = acc / tl.where(empty, 1.0, den)[:, None]
        lse = tl.where(empty, float("-inf"), m_use + tl.log(tl.where(empty, 1.0, den)))
        pdl_launch(PDL)
        x_ptr = OUT + b * stride_xb + h * stride_xh + offs_s[:, None] * stride_xs + offs_d[None, :] * stride_xd
        tl.store(x_ptr, out.to(OUT.dtype.element_ty), mask=od_ok)
        tl.store(LSE_OUT + bh.to(tl.int64) * S + offs_s, lse, mask=s_ok)


# -- host wrappers (the eager calls and the custom ops' bodies) -----------------------------------

def _fwd_config(impl: str, head_dim: int):
    return _FWD_CONFIGS[(impl, head_dim)]


def _tma_ok(*tensors) -> bool:
    # TMA addresses 16-byte-aligned bases with 16-byte-aligned row strides; the (B*H*S, D) row view
    # needs a contiguous tensor.
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors)


class _FlashLaunch:
    """How one flash-attention path launches, worked out from the geometry of q, k, v and out alone (no
    addresses): the kernel (TMA descriptors for ``impl="cuda"`` on contiguous aligned tensors, block
    pointers otherwise), its grid, integer arguments and options, and (``remembered``: a call of
    ``_PATHS``, whose key fixes every argument's class) the launcher slot that skips the launcher's key.
    ``config`` overrides the tile table (tuning); ``pdl``: as ``pdl.pdl_launch_args`` takes it; ``window`` (0:
    none): a sliding window (every kernel takes one)."""

    __slots__ = ("fn", "grid", "views", "ints", "kwargs", "slot", "lse_shape", "keys")

    def __init__(self, q, k, v, out, causal: bool, scale: float, impl: str, pdl: str, config, remembered: bool,
                 window: int = 0):
        B, H, SQ, D = q.shape
        HKV, SK = k.shape[1], k.shape[2]
        self.lse_shape, self.keys = (B, H, SQ), SK
        block_m, block_n, num_warps, num_stages = config or _fwd_config(impl, D)
        self.grid = (cdiv(SQ, block_m), B * H)
        # out: the caller's (any strides: the kernels store through block pointers) or a new contiguous one.
        o_strides = tuple(out.stride()) if out is not None else (H * SQ * D, SQ * D, D, 1)
        qk_scale = scale * _LOG2E
        pdl_args = pdl_launch_args(pdl, self.grid[0] * self.grid[1], q.device)
        self.kwargs = dict(HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, num_warps=num_warps,
                           num_stages=num_stages, **pdl_args)
        if impl == "cuda" and config is None and ws_applies(q, k, v) and (out is None or out.is_contiguous()):
            # the warp-specialized Gluon kernel (flash_ws.py): descriptors with its layouts, then out and lse
            self.fn, self.grid, self.views, self.ints, self.kwargs = ws_plan(q, k, causal, qk_scale, pdl_args,
                                                                             window=window)
        elif impl == "cuda" and _tma_ok(q, k, v):
            # (B*H*S, D) row views of the contiguous q, k, v: the tensors themselves are the bases.
            self.fn = _flash_fwd_tma_kernel
            self.views = (((B * H * SQ, D), (D, 1), (block_m, D)), ((B * HKV * SK, D), (D, 1), (block_n, D)),
                          ((B * HKV * SK, D), (D, 1), (block_n, D)))
            self.ints = o_strides + (H, HKV, H // HKV, SQ, SK, qk_scale, window)
        else:
            self.fn, self.views = _flash_fwd_kernel, None
            self.ints = (*q.stride(), *k.stride(), *v.stride(), *o_strides, H, H // HKV, SQ, SK, qk_scale, window)
        if window:
            self.kwargs["WINDOWED"] = True
        self.slot = Slot(self.fn) if remembered else None

    def __call__(self, q, k, v, out):
        """(out, lse): ``out`` (a new contiguous tensor unless given) and a new float32 LSE."""
        out = q.new_empty(q.shape) if out is None else out
        lse = q.new_empty(self.lse_shape, dtype=torch.float32)
        if out.numel() == 0:
            return out, lse
        if self.keys == 0:
            out.zero_()
            lse.fill_(float("-inf"))
            return out, lse
        # the addresses are all that may differ from call to call (no slot: a plan used once)
        launch_keyed(self.slot, (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()), self.grid,
                     lambda: self._args(q, k, v, out, lse), self.kwargs, self.fn)
        return out, lse

    def _args(self, q, k, v, out, lse) -> tuple:
        if self.views is None:
            return (q, k, v, out, lse) + self.ints
        vq, vk, vv = self.views
        return (Descriptor(q, *vq), Descriptor(k, *vk), Descriptor(v, *vv), out, lse) + self.ints


def _flash_forward(q, k, v, causal: bool, scale: float, impl: str, config=None, out=None, pdl: str = "off"):
    """Launch the forward kernel; returns (out, lse). ``config`` overrides the tile table (tuning)."""
    return _FlashLaunch(q, k, v, out, causal, scale, impl, pdl, config, False)(q, k, v, out)


def _merge_args(shape, out_strides, n, o_strides, lse_strides, pdl, device):
    """(grid, integer arguments, options) of the merge kernel for n partials into an output of ``shape``
    (B, H, S, D): o_strides = (shard, b, h, s, d), lse_strides = (shard, b, h, s); ``pdl``: as
    pdl.pdl_launch_args takes it."""
    B, H, S, D = shape
    block_d = next_power_of_2(D)
    block_s = max(1, min(next_power_of_2(S), max(1, 4096 // block_d)))
    grid = (cdiv(S, block_s), B * H)
    return grid, (*o_strides, *lse_strides, *out_strides, n, H, S, D), dict(
        BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4, **pdl_launch_args(pdl, grid[0] * grid[1], device))


def _merge_launch(o, lse, out, lse_out, n, o_strides, lse_strides, pdl="off"):
    """Merge n partials (strides as :func:`_merge_args` takes them)."""
    if out.numel() == 0:
        return
    grid, ints, kwargs = _merge_args(out.shape, out.stride(), n, o_strides, lse_strides, pdl, out.device)
    launch(_merge_kernel, grid, o, lse, out, lse_out, *ints, **kwargs)


def _merge_forward(outs, lses, out=None, pdl: str = "off"):
    o = torch.stack(outs)
    s = torch.stack(lses)
    out = torch.empty(outs[0].shape, dtype=outs[0].dtype, device=outs[0].device) if out is None else out
    lse = torch.empty(lses[0].shape, dtype=torch.float32, device=outs[0].device)
    if out.numel() == 0:
        lse.fill_(float("-inf"))
        return out, lse
    _merge_launch(o, s, out, lse, len(outs), o.stride(), s.stride(), pdl)
    return out, lse


def _decode_rows_block(rows: int) -> int:
    return max(16, min(128, next_power_of_2(rows)))


def _decode_splits(q, k_cache, block_n: int, per_sm: int | None = None, keys: int | None = None) -> int:
    """Splits so that the grid fills whole waves of ``per_sm`` programs a multiprocessor (the head dim's
    ``_DECODE_PROGRAMS_PER_SM`` unless given), each split >= _DECODE_MIN_CHUNK keys of the most a sequence
    reads (the cache, or ``keys``: a sliding window's)."""
    B, Hq, SQ, D = q.shape
    HKV, SMAX = k_cache.shape[1], min(k_cache.shape[2], keys or k_cache.shape[2])
    row_blocks = cdiv((Hq // HKV) * SQ, _decode_rows_block((Hq // HKV) * SQ))
    programs = max(1, B * HKV * row_blocks)
    want = (per_sm or _DECODE_PROGRAMS_PER_SM[D]) * sm_count(q.device) // programs
    most = max(1, cdiv(SMAX, max(_DECODE_MIN_CHUNK, block_n)))
    return max(1, min(want, most, 256))


class _DecodeLaunch:
    """How one decode-attention path launches, worked out from the geometry alone (as :class:`_FlashLaunch`):
    one kernel (its splits merged by the last of them to finish), its grid, integers and options, where the
    float32 partials lie in the scratch (``split.SCRATCH``), and (``remembered``) a launcher slot."""

    __slots__ = ("grid", "ints", "kwargs", "parts", "lse_at", "out_lse_at", "out_shape", "tiles", "slot")

    def __init__(self, q, k_cache, v_cache, out, causal: bool, scale: float, num_splits: int, config, pdl: str,
                 remembered: bool, keep_lse: bool = True, rope=None, next_bytes: int = 0, window: int = 0,
                 ring: bool = False):
        B, HQ, SQ, D = q.shape
        HKV, SMAX = k_cache.shape[1], k_cache.shape[2]
        block_n, num_warps, num_stages = config or _DECODE_CONFIGS[D]
        # a sliding window (0: none): the keys any query of a sequence reaches, back from its end
        back = window + (SQ - 1 if causal else 0) if window else 0
        # A split of an automatic count covers at least _DECODE_SEQ_MIN_CHUNK keys of the sequence (not only of
        # the cache: kv_lens may be far below Smax); an explicit num_splits is taken as asked.
        min_chunk = block_n
        if num_splits <= 0:
            num_splits = _decode_splits(q, k_cache, block_n, keys=back or None)
            min_chunk = cdiv(_DECODE_SEQ_MIN_CHUNK, block_n) * block_n
        group = HQ // HKV
        block_m = _decode_rows_block(group * SQ)
        self.grid = (num_splits, B * HKV, cdiv(group * SQ, block_m))
        self.tiles = self.grid[1] * self.grid[2]
        programs = num_splits * self.tiles
        if config is None and D == 128 and cdiv(min(SMAX, back or SMAX), num_splits) >= _DECODE_DEEP_KEYS and \
                programs <= _DECODE_PROGRAMS_PER_SM[D] * sm_count(q.device):
            num_stages += 1  # long splits in one wave: one more tile in flight (decode_splits_ab.log)
        self.out_shape = (B, HQ, SQ, D)
        # The float32 scratch: the partials' o (B, HQ, SQ, splits, D), their lse (B, HQ, SQ, splits) and,
        # unless the caller keeps it (``keep_lse``), the result's lse (B, HQ, SQ), each 16-byte aligned. The
        # kernel takes pointers, so the pieces are flat slices.
        n_o = B * HQ * SQ * num_splits * D
        self.lse_at = -(-n_o // 4) * 4
        end = self.lse_at + B * HQ * SQ * num_splits
        self.out_lse_at = None if keep_lse else -(-end // 4) * 4
        self.parts = end if keep_lse else self.out_lse_at + B * HQ * SQ
        o_strides = tuple(out.stride()) if out is not None else (HQ * SQ * D, SQ * D, D, 1)
        # rope: (k, v, cos, sin) of rope_decode_attention, whose strides the kernel takes
        rope_strides = (0,) * 6 if rope is None else (*rope[0].stride()[:2], *rope[1].stride()[:2], rope[2].stride(0),
                                                      rope[3].stride(0))
        self.ints = (*q.stride(), *k_cache.stride(), *v_cache.stride(), *o_strides, *rope_strides, HKV, group, SQ,
                     SMAX, scale * _LOG2E, next_bytes, window, back)
        # The merge: rows MERGE_ROWS at a time (at most 16, no more than the block's real rows), UNROLL splits
        # a round, so that a round's partials are at most 64 floats a thread (2048 a warp).
        merge_rows = min(16, block_m, next_power_of_2(group * SQ))
        unroll = max(2, min(16, 2048 * min(num_warps, 4) // (merge_rows * D)))
        self.kwargs = dict(HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, MERGE_ROWS=merge_rows,
                           UNROLL=unroll, MIN_CHUNK=min_chunk, ROPE=rope is not None, num_warps=num_warps,
                           num_stages=num_stages, **pdl_launch_args(pdl, programs, q.device))
        if window:
            self.kwargs["WINDOWED"] = True
        if ring:
            self.kwargs["RING"] = True
        if k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and self.kwargs.get("launch_pdl"):
            # placed early: the first programs' keys and values (32 KB each at most), a piece a thread each
            self.kwargs.update(prefetch_args(self.kwargs["PDL"], q.device, 1, _DECODE_PREFETCH, num_warps))
        if next_bytes:  # (the caller checked for sm90: the bulk prefetch)
            self.kwargs.update(NEXT_PIECES=32 * num_warps, NEXT_MIN_KEYS=NEXT_MIN_KEYS)
        self.slot = Slot(_decode_split_kernel) if remembered else None

    def __call__(self, q, k_cache, v_cache, kv_lens, out, rope=(), nxt=None):
        """(out, lse): ``out`` (a new tensor unless given) and the float32 LSE (a new tensor with
        ``keep_lse``, else a flat scratch slice). ``rope``: (k, v, cos, sin) where the plan was made with them;
        ``nxt``: the tensor to prefetch where it was made with ``next_bytes``."""
        out = q.new_empty(self.out_shape) if out is None else out
        if out.numel() == 0:
            return out, q.new_empty(self.out_shape[:3], dtype=torch.float32)
        counters, part_o = SCRATCH.get(q.device, self.tiles, self.parts)
        lse = q.new_empty(self.out_shape[:3], dtype=torch.float32) if self.out_lse_at is None else None
        # the addresses are all that may differ from call to call (no slot: a plan used once)
        key = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), kv_lens.data_ptr(), out.data_ptr(),
               part_o.data_ptr(), counters.data_ptr(), 0 if lse is None else lse.data_ptr(),
               *(t.data_ptr() for t in rope), 0 if nxt is None else nxt.data_ptr())
        launch_keyed(self.slot, key, self.grid,
                     lambda: self._args(q, k_cache, v_cache, kv_lens, out, part_o, counters, lse, rope, nxt),
                     self.kwargs, _decode_split_kernel)
        return out, lse  # (lse None where the plan does not keep it: a remembered call without return_lse)

    def _args(self, q, k_cache, v_cache, kv_lens, out, part_o, counters, lse, rope, nxt) -> tuple:
        lse = part_o[self.out_lse_at:] if lse is None else lse
        return (q, k_cache, v_cache, kv_lens, part_o, part_o[self.lse_at:], out, lse, counters, *(rope or (q,) * 4),
                q if nxt is None else nxt, *self.ints)


def _decode_forward(q, k_cache, v_cache, kv_lens, causal: bool, scale: float, num_splits: int, config=None,
                    pdl: str = "off", out=None):
    return _DecodeLaunch(q, k_cache, v_cache, out, causal, scale, num_splits, config, pdl, False)(
        q, k_cache, v_cache, kv_lens, out)


def _into(out, got):
    """A reference's (result, lse) with the result copied into ``out`` when given."""
    o, lse = got
    return (o if out is None else out.copy_(o)), lse


def _flash_run(q, k, v, causal: bool, scale: float, impl: str, out=None, pdl: str = "off", plan=None,
               window: int = 0):
    """The eager call (also the custom op's body); ``plan``: the remembered path's :class:`_FlashLaunch`;
    ``window``: 0 (none) or the sliding window's keys."""
    if out is not None:
        check_no_overlap("flash_attention", out, q=q, k=k, v=v)
    if impl == "reference":
        return _into(out, reference_flash_attention(q, k, v, causal=causal, scale=scale, return_lse=True,
                                                    window=window or None))
    if plan is None:
        plan = _FlashLaunch(q, k, v, out, causal, scale, impl, pdl, None, False, window)
    return plan(q, k, v, out)


def _decode_run(q, k_cache, v_cache, kv_lens, causal: bool, scale: float, num_splits: int, impl: str, pdl: str,
                out=None, plan=None, window: int = 0):
    """The eager call (also the custom op's body); ``plan``: the remembered path's :class:`_DecodeLaunch`;
    ``window``: 0 (none) or the sliding window's keys."""
    if out is not None:
        check_no_overlap("decode_attention", out, q=q, k_cache=k_cache, v_cache=v_cache, kv_lens=kv_lens)
    if impl == "reference":
        return _into(out, reference_decode_attention(q, k_cache, v_cache, kv_lens, causal=causal, scale=scale,
                                                     return_lse=True, window=window or None))
    if plan is None:
        plan = _DecodeLaunch(q, k_cache, v_cache, out, causal, scale, num_splits, None, pdl, False, window=window)
    return plan(q, k_cache, v_cache, kv_lens, out)


def _rope_decode_run(q, k, v, cos, sin, k_cache, v_cache, kv_lens, scale: float, impl: str, pdl: str, out=None,
                     plan=None, prefetch=None, window: int = 0, ring: bool = False):
    """rope_decode_attention's call; ``plan``: the remembered path's :class:`_DecodeLaunch`; ``prefetch``: the
    checked hint (None where it does not apply); ``window``: 0 (none) or the sliding window's keys; ``ring``: the
    caches are rings."""
    if out is not None:
        check_no_overlap("rope_decode_attention", out, q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache,
                         kv_lens=kv_lens)
    if impl == "reference":
        o = reference_rope_decode_attention(q, k, v, cos, sin, k_cache, v_cache, kv_lens, scale, window=window or None,
                                            ring=ring)
        return o if out is None else out.copy_(o)
    rope = (k, v, cos, sin)
    if plan is None:
        plan = _DecodeLaunch(q, k_cache, v_cache, out, False, scale, 0, None, pdl, False, False, rope,
                             _next_bytes(prefetch), window, ring)
    return plan(q, k_cache, v_cache, kv_lens, out, rope, prefetch)[0]


def _check_prefetch(fn: str, prefetch, q, path: str):
    """rope_decode_attention's ``prefetch`` hint: the tensor, or None where the kernel cannot use it (the reference
    path, below sm90's bulk prefetch)."""
    if prefetch is None:
        return None
    if not isinstance(prefetch, torch.Tensor) or prefetch.device != q.device or not prefetch.is_contiguous():
        what = (f"a tensor on {prefetch.device}{'' if prefetch.is_contiguous() else ', not contiguous'}"
                if isinstance(prefetch, torch.Tensor) else type(prefetch).__name__)
        raise ValueError(f"{fn}: prefetch must be a contiguous tensor on q's device {q.device}, got {what}")
    return prefetch if sm90_kernel(path, q.device) and prefetch.numel() else None


def _next_bytes(prefetch) -> int:
    """The bytes of the hint the kernel asks for: all of it up to 1 GiB (a 32-bit kernel argument)."""
    return 0 if prefetch is None else min(prefetch.numel() * prefetch.element_size(), 1 << 30)


def _merge_run(outs, lses, impl: str, out=None, pdl: str = "off"):
    # No overlap check: the kernel reads stacked copies of the partials, so out may even be one of them.
    if impl == "reference":  # contiguous, as the kernel's results and the fake implementation
        return _into(out, tuple(t.contiguous() for t in reference_merge_attention(outs, lses)))
    return _merge_forward(outs, lses, out, pdl)


# -- custom ops (traced calls) --------------------------------------------------------------------

@torch.library.custom_op("xelink::flash_attention", mutates_args=("out",),
                         schema="(Tensor q, Tensor k, Tensor v, bool causal, float scale, str impl, str pdl, "
                                "Tensor(a!) out, int window) -> Tensor")
def _flash_attention_op(q, k, v, causal, scale, impl, pdl, out, window):
    return _flash_run(q, k, v, causal, scale, impl, out, pdl, window=window)[1]


@_flash_attention_op.register_fake
def _(q, k, v, causal, scale, impl, pdl, out, window):
    B, H, S, _ = q.shape
    return q.new_empty((B, H, S), dtype=torch.float32)


@torch.library.custom_op("xelink::decode_attention", mutates_args=("out",),
                         schema="(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_lens, bool causal, float scale, "
                                "int num_splits, str impl, str pdl, Tensor(a!) out, int window) -> Tensor")
def _decode_attention_op(q, k_cache, v_cache, kv_lens, causal, scale, num_splits, impl, pdl, out, window):
    return _decode_run(q, k_cache, v_cache, kv_lens, causal, scale, num_splits, impl, pdl, out, window=window)[1]


@_decode_attention_op.register_fake
def _(q, k_cache, v_cache, kv_lens, causal, scale, num_splits, impl, pdl, out, window):
    B, H, S, _ = q.shape
    return q.new_empty((B, H, S), dtype=torch.float32)


@torch.library.custom_op("xelink::merge_attention", mutates_args=("out",),
                         schema="(Tensor[] outs, Tensor[] lses, str impl, str pdl, Tensor(a!) out) -> Tensor")
def _merge_attention_op(outs, lses, impl, pdl, out):
    return _merge_run(list(outs), list(lses), impl, out, pdl)[1]


@_merge_attention_op.register_fake
def _(outs, lses, impl, pdl, out):
    return lses[0].new_empty(lses[0].shape)  # contiguous, as the kernel's and the reference's


@torch.library.custom_op("xelink::rope_decode_attention", mutates_args=("k_cache", "v_cache", "out"),
                         schema="(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
                                "Tensor(b!) v_cache, Tensor kv_lens, float scale, str impl, str pdl, Tensor(c!) out, "
                                "int window, bool ring) -> ()")
def _rope_decode_attention_op(q, k, v, cos, sin, k_cache, v_cache, kv_lens, scale, impl, pdl, out, window, ring):
    _rope_decode_run(q, k, v, cos, sin, k_cache, v_cache, kv_lens, scale, impl, pdl, out, window=window, ring=ring)


@_rope_decode_attention_op.register_fake
def _(q, k, v, cos, sin, k_cache, v_cache, kv_lens, scale, impl, pdl, out, window, ring):
    return None


# -- public API --------------------------------------------------------------------------------

def _no_out_with_grad(fn: str, out) -> None:
    """A differentiable call refuses ``out=`` (what autograd records is the returned tensor)."""
    if out is not None:
        raise ValueError(f"{fn}: out= is not differentiable, and an input requires grad; drop out= or call it under "
                         f"torch.no_grad()")


def _check_out_like(fn: str, out, like):
    """``out`` (if given) checked for an output shaped like ``like`` (B, H, S, D), in its dtype and on its
    device."""
    if out is not None:
        check_out(fn, out, like.shape, like.dtype, like.device)


def _traced_out(out, like):
    return torch.empty_like(like, memory_format=torch.contiguous_format) if out is None else out


# flash_attention()'s and decode_attention()'s checks, remembered by everything they read
# (``common.path_key``): the op, impl, pdl, the flags, the geometry of every tensor and of out. The value
# is (path, pdl option, scale[, splits], the launch plan: None for the reference); what reads addresses (out
# overlapping an input) runs every call.
_PATHS = Paths()
def flash_attention(q, k, v, causal=False, scale=None, return_lse=False, impl="auto", *, out=None, pdl=None,
                    window=None):
    """Attention forward, ``softmax(q k^T * scale) v``, with GQA, causal masking and the LSE.

    Args:
        q: (B, Hq, Sq, D) query; k, v: (B, Hkv, Sk, D) keys and values, Hq divisible by Hkv (GQA:
            q head h reads KV head h // (Hq // Hkv)). Kernels take bfloat16/float16 and D in 64/128/256;
            any lengths (tails are masked), any strides.
        causal: query i sees keys 0 .. i + Sk - Sq (aligned to the end of the keys; SDPA's is_causal
            when Sq == Sk). Rows that see no key (Sq > Sk) give 0 and LSE -inf.
        scale: softmax scale, > 0; default 1/sqrt(D).
        return_lse: also return the float32 natural-log LSE, (B, Hq, Sq).
        impl: "auto", "triton" (portable), "cuda" (sm90 TMA; old name "hopper") or "reference" (pure
            torch); see the module.
        out: optional (B, Hq, Sq, D) tensor of q's dtype and device for the output: any view with unit
            stride along D (e.g. ``buf.transpose(1, 2)`` of a (B, Sq, Hq, D) buffer) sharing no memory with
            q, k or v (address ranges compared). The LSE is a new tensor either way.
        pdl: programmatic dependent launch (pdl.py; a Triton path on CUDA sm90+): None or False (off: the
            forward kernel is compute-bound and launched as it always was), True, "early" or "late".
        window: None, or an int >= 1: a sliding window, each query sees only the ``window`` keys ending at its
            last visible one (Mistral's and Phi-3's ``sliding_window``: with causal, query i sees keys
            ``i + Sk - Sq - window + 1 .. i + Sk - Sq``). Every path takes it (``"cuda"``: the Gluon kernel where
            it applies, else the TMA one; each query block starts at its first row's window); with grad as without
            (the backward takes the window too).

    Autograd: where grad mode is on and q, k or v requires grad, the call (any ``impl``) is the forward of an
    autograd node that keeps q, k, v, the output and the LSE, and whose backward is ``flash_attention_backward``
    (so memory stays O(S), not the score matrix); the LSE is differentiable too. ``out=`` is then refused. Under
    ``torch.compile`` such a call takes the reference's torch ops instead (the custom op has no formula).

    Returns:
        ``out`` (a new contiguous tensor unless given) in q's dtype; or (out, lse) with ``return_lse=True``.

    Raises:
        TypeError / ValueError: bad tensors, dtypes, shapes, devices, flags or out, before anything runs.
    """
    key = path_key(("flash", impl, pdl, causal, scale, return_lse, window), (q, k, v), (out,))
    hit = _PATHS.get(key) if key is not None else None
    if hit is not None:
        out, lse = _flash_run(q, k, v, causal, hit[2], hit[0], out, hit[1], hit[3], window or 0)
        return (out, lse) if return_lse else out
    grad_key = None
    if key is None and out is None:  # a differentiable call's remembered path (its key is None when none is)
        grad_key = path_key(("flash-grad", impl, pdl, causal, scale, window), (q, k, v), grad_ok=True)
        hit = _PATHS.get(grad_key) if grad_key is not None else None
        if hit is not None and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            out, lse = _FlashAttention.apply(q, k, v, causal, hit[2], hit[0], hit[1], hit[3], window or 0)
            return (out, lse) if return_lse else out
    fn = "flash_attention"
    _check_qkv(fn, q, k, v)
    _check_flags(fn, causal, scale, return_lse, window)
    # With grad (eager), any path runs as the forward of an autograd node whose backward is
    # flash_attention_backward; traced, the custom op has no formula, so grad takes the reference's torch ops.
    grad = not torch.compiler.is_compiling() and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    path = _fit(resolve_impl(fn, impl, q.device, **({} if grad else dict(q=q, k=k, v=v))), impl, q)
    if path != "reference":
        _check_kernel_inputs(fn, path, q)
    _check_out_like(fn, out, q)
    pdl = "off" if pdl is None else pdl_option(fn, pdl, path, q.device)
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    if grad:
        _no_out_with_grad(fn, out)
        plan = None if path == "reference" else _FlashLaunch(q, k, v, None, causal, scale, path, pdl, None,
                                                             grad_key is not None, window or 0)
        if grad_key is not None:
            _PATHS.remember(grad_key, (path, pdl, scale, plan))
        out, lse = _FlashAttention.apply(q, k, v, causal, scale, path, pdl, plan, window or 0)
        return (out, lse) if return_lse else out
    if key is not None:
        _PATHS.remember(key, (path, pdl, scale, None if path == "reference" else
                              _FlashLaunch(q, k, v, out, causal, scale, path, pdl, None, True, window or 0)))
    if torch.compiler.is_compiling():  # traced: the custom op with its fake implementation
        out = _traced_out(out, q)
        lse = torch.ops.xelink.flash_attention(q, k, v, causal, scale, path, pdl, out, window or 0)
    else:  # eager (CUDA graph capture included): launch directly, no custom-op dispatch
        out, lse = _flash_run(q, k, v, causal, scale, path, out, pdl, window=window or 0)
    return (out, lse) if return_lse else out


def flash_attention_backward(dout, q, k, v, out, lse, causal=False, scale=None, impl="auto", *, dlse=None,
                             dtype=None, window=None):
    """Gradients of ``flash_attention``'s output with respect to q, k and v (FlashAttention's backward
    contract: the forward's output and LSE are given, the probabilities recomputed from them).

    Args:
        dout: (B, Hq, Sq, D) gradient of the output; q, k, v: the forward's inputs (shapes as
            ``flash_attention``); out: its output; lse: its float32 LSE (``return_lse=True``).
            ``out`` and ``lse`` may be those of attention over more keys than ``k`` (one key block of a longer
            sequence, as context parallelism splits it): the results are then this block's contributions, which
            sum over the blocks to the gradients of the whole attention.
        causal, scale: as the forward's call over this block.
        window: None, or an int >= 1: the forward's sliding window (each query sees only the ``window`` keys
            ending at its last visible one: ``i + Sk - Sq`` with causal, else ``Sk - 1``); both paths take it, the
            kernel visiting only the tiles some row's window reaches.
        dlse: the gradient of the LSE, (B, Hq, Sq), where a loss used it too (None: zero).
        dtype: the results' floating dtype (None: float32, float64 for float64 inputs). The kernel stores it
            directly (no cast pass); a block's contributions to be summed over blocks want the float32 default.
        impl: "auto", "triton" or "reference" (``BACKWARD_IMPLS``). "triton": FlashAttention-2's two passes
            (``attention_bwd``: bfloat16 / float16, head dim 64 / 128 / 256, any lengths and strides); "reference":
            torch ops in float32 over row chunks (memory O(chunk x Sk), not O(Sq x Sk)), any dtype and device;
            "auto": the kernel on GPUs where it applies, else the reference (also where grad mode is on and an
            input requires grad: a double backward).

    Returns:
        (dq (B, Hq, Sq, D), dk, dv (B, Hkv, Sk, D), summed over the q heads of each KV head), in ``dtype``, new
        tensors.

    Raises:
        TypeError / ValueError: bad tensors, shapes, dtypes, devices, flags or impl, before anything runs.
    """
    fn = "flash_attention_backward"
    _check_backward(fn, dout, q, k, v, out, lse, causal, scale, dlse, window)
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"{fn}: dtype={dtype!r} must be None or a floating torch.dtype")
    path = _fit(resolve_impl(fn, impl, q.device, BACKWARD_IMPLS, dout=dout, q=q, k=k, v=v, out=out, lse=lse,
                             dlse=dlse), impl, q)
    if path == "reference":
        grads = _reference_backward(dout, q, k, v, out, lse, causal, scale, dlse, window)
        return grads if dtype is None else tuple(g.to(dtype) for g in grads)
    _check_kernel_inputs(fn, path, q)
    if dout.dtype != q.dtype:
        raise TypeError(f"{fn}: dout.dtype={dout.dtype} != q.dtype={q.dtype} (impl={path!r} takes them alike)")
    from .attention_bwd import flash_backward

    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    return flash_backward(dout, q, k, v, out, lse.contiguous(), dlse, causal, scale, dtype or torch.float32,
                          window or 0)


class _FlashAttention(torch.autograd.Function):
    """flash_attention with grad: the forward of the path chosen, the backward ``flash_attention_backward``
    (from the saved inputs, output and LSE: no score matrix kept), the LSE's gradient included; ``window``: 0
    (none) or the sliding window's keys, given to both."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, path, pdl, plan, window):
        out, lse = _flash_run(q, k, v, causal, scale, path, None, pdl, plan, window=window)
        ctx.flags = (causal, scale, window)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.set_materialize_grads(False)  # an unused LSE's gradient comes as None, not a tensor of zeros
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale, window = ctx.flags
        if dout is None:  # only the LSE was used
            dout = torch.zeros_like(out)
        dq, dk, dv = flash_attention_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, dlse=dlse,
                                              dtype=q.dtype, window=window or None)
        return dq, dk, dv, None, None, None, None, None, None


# -- variable-length (packed) sequences: flash_attention_varlen ------------------------------------

def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()



def _check_max_seqlen(fn: str, max_q, max_k) -> None:
    """max_seqlen_q / max_seqlen_k: None or ints >= 0 (a traced call's may be SymInts)."""
    for name, m in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
        integral = isinstance(m, (numbers.Integral, torch.SymInt)) and not isinstance(m, bool)
        if m is not None and (not integral or m < 0):
            raise (ValueError if integral else TypeError)(
                f"{fn}: {name}={m!r} must be None or an int >= 0 (the longest sequence)")


def _check_cu_seqlens(fn: str, q, k, cu_q, cu_k, max_q, max_k):
    """The sequences' offsets and longest lengths: (max_q, max_k, offsets), ``offsets`` the host lists of both
    offsets (``common.host_values``: read once a tensor and version), or None inside CUDA-graph capture (where the
    values cannot be read; max_q and max_k must be given, and are the ones returned). Outside capture the lengths
    returned are the longest read, a larger max_seqlen only checked."""
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        check_tensor(fn, name, cu, 1)
        if cu.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{fn}: {name}.dtype={cu.dtype} must be torch.int32 or torch.int64")
        if cu.device != q.device:
            raise ValueError(f"{fn}: {name} on {cu.device}, q on {q.device}")
        if cu.shape[0] < 2:
            raise ValueError(f"{fn}: {name}.shape={tuple(cu.shape)} must hold B + 1 >= 2 offsets (0, then the end "
                             f"of each sequence)")
    if cu_q.shape[0] != cu_k.shape[0]:
        raise ValueError(f"{fn}: cu_seqlens_q has {cu_q.shape[0]} offsets, cu_seqlens_k {cu_k.shape[0]}: both must "
                         f"be B + 1 for the same B")
    _check_max_seqlen(fn, max_q, max_k)
    if _capturing(q.device):
        if max_q is None or max_k is None:
            raise ValueError(f"{fn}: max_seqlen_q={max_q!r}, max_seqlen_k={max_k!r}: inside CUDA-graph capture both "
                             f"must be given (the cu_seqlens values cannot be read on the host there)")
        return int(max_q), int(max_k), None
    offsets = []
    for side, cu, total, m in (("q", cu_q, q.shape[0], max_q), ("k", cu_k, k.shape[0], max_k)):
        name, mname = f"cu_seqlens_{side}", f"max_seqlen_{side}"
        vals = host_values(cu)
        if vals[0] != 0:
            raise ValueError(f"{fn}: {name}[0]={vals[0]} must be 0")
        lens = [b - a for a, b in zip(vals, vals[1:])]
        if min(lens) < 0:
            i = min(range(len(lens)), key=lens.__getitem__)
            raise ValueError(f"{fn}: {name} must be nondecreasing: {name}[{i}]={vals[i]} > {name}[{i + 1}]="
                             f"{vals[i + 1]}")
        if vals[-1] != total:
            raise ValueError(f"{fn}: {name}[-1]={vals[-1]} must equal the packed rows {total} ({side}.shape[0])")
        if m is not None and m < max(lens):
            raise ValueError(f"{fn}: {mname}={m} is less than the longest sequence's {max(lens)} ({name})")
        offsets.append((vals, max(lens)))  # read: the grids cover it, not a larger m (tiles that would all return)
    (oq, mq), (ok, mk) = offsets
    return mq, mk, (oq, ok)


def _refuse_cuda(fn: str, impl) -> None:
    if isinstance(impl, str) and IMPL_ALIASES.get(impl, impl) == "cuda":
        raise ValueError(f"{fn}: impl={impl!r} has no kernel here (no TMA / Gluon varlen kernel); use impl='triton' "
                         f"or 'auto'")


def _seq_view(t, a: int, b: int):
    """Rows a..b of a packed (rows, heads, D) tensor as flash_attention's (1, heads, b - a, D)."""
    return t[a:b].transpose(0, 1).unsqueeze(0)


def _varlen_reference(q, k, v, offsets, causal: bool, scale: float, window: int):
    """``reference_flash_attention`` over each sequence: (out (total_q, Hq, D) in q's dtype, lse (Hq, total_q))."""
    oq, ok = offsets
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(len(oq) - 1):
        q0, q1, k0, k1 = oq[b], oq[b + 1], ok[b], ok[b + 1]
        if q1 == q0:
            continue
        o, s = reference_flash_attention(_seq_view(q, q0, q1), _seq_view(k, k0, k1), _seq_view(v, k0, k1),
                                         causal=causal, scale=scale, return_lse=True, window=window or None)
        out[q0:q1] = o[0].transpose(0, 1)
        lse[:, q0:q1] = s[0]
    return out, lse


def _varlen_forward(q, k, v, cu_q, cu_k, max_q: int, causal: bool, scale: float, window: int):
    """The portable kernel's VARLEN mode: (out (total_q, Hq, D) contiguous, lse (Hq, total_q) float32)."""
    total_q, H, D = q.shape
    out = q.new_empty(q.shape)
    lse = torch.empty((H, total_q), dtype=torch.float32, device=q.device)
    if total_q == 0:
        return out, lse
    if k.shape[0] == 0:  # no sequence has keys
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    block_m, block_n, num_warps, num_stages = _fwd_config("triton", D)
    cu_q, cu_k = cu_q.contiguous(), cu_k.contiguous()  # the kernel reads offset b at CU + b: no strided view
    kwargs = dict(HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, VARLEN=True, CU_Q=cu_q, CU_K=cu_k,
                  num_warps=num_warps, num_stages=num_stages)
    if window:
        kwargs["WINDOWED"] = True
    launch(_flash_fwd_kernel, ((cu_q.shape[0] - 1) * H, cdiv(max(max_q, 1), block_m)), q, k, v, out, lse,
           *packed_strides(q), *packed_strides(k), *packed_strides(v), *packed_strides(out), H, H // k.shape[1],
           total_q, k.shape[0], scale * _LOG2E, window, **kwargs)
    return out, lse


# CUDA's limit on a grid's second dimension, where the varlen kernels put a sequence's tiles
_GRID_TILES = 65535


def _check_varlen_grid(fn: str, path: str, D: int, max_q: int, max_k: int, forward: bool, backward: bool) -> None:
    """A kernel path's tiles of the longest sequence fit the grid (the forward's and, with ``backward``, the
    backward's passes), or a ValueError before anything runs."""
    if path == "reference":
        return
    from .attention_bwd import varlen_tiles

    tiles = max(cdiv(max(max_q, 1), _fwd_config("triton", D)[0]) if forward else 0,
                varlen_tiles(D, max(max_q, 1), max(max_k, 1)) if backward else 0)
    if tiles > _GRID_TILES:
        raise ValueError(f"{fn}: the longest sequence (max_seqlen_q={max_q}, max_seqlen_k={max_k}) needs {tiles} "
                         f"tiles on the kernel's grid, more than CUDA's {_GRID_TILES}: split it, or use "
                         f"impl='reference'")


def _varlen_run(q, k, v, cu_q, cu_k, max_q, offsets, causal, scale, path, window):
    if path == "reference":
        return _varlen_reference(q, k, v, offsets, causal, scale, window)
    return _varlen_forward(q, k, v, cu_q, cu_k, max_q, causal, scale, window)


def _varlen_backward_run(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, offsets, causal, scale, path, dlse,
                         dtype, window):
    """(dq, dk, dv) of packed sequences: the Triton kernels' VARLEN mode, or ``_reference_backward`` over each
    sequence; ``dtype`` None: float32 (float64 for float64 inputs) on the reference path, float32 on the kernel's."""
    if path != "reference":
        from .attention_bwd import flash_backward_varlen

        return flash_backward_varlen(dout, q, k, v, out, lse.contiguous(), dlse, cu_q, cu_k, max_q, max_k, causal,
                                     scale, dtype or torch.float32, window)
    ctype = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=ctype, device=q.device)
    dk = torch.zeros(k.shape, dtype=ctype, device=q.device)
    dv = torch.zeros(k.shape, dtype=ctype, device=q.device)
    oq, ok = offsets
    for b in range(len(oq) - 1):
        q0, q1, k0, k1 = oq[b], oq[b + 1], ok[b], ok[b + 1]
        if q1 == q0 or k1 == k0:  # nothing attends: zero gradients
            continue
        g = _reference_backward(_seq_view(dout, q0, q1), _seq_view(q, q0, q1), _seq_view(k, k0, k1),
                                _seq_view(v, k0, k1), _seq_view(out, q0, q1), lse[None, :, q0:q1], causal, scale,
                                None if dlse is None else dlse[None, :, q0:q1], window or None)
        dq[q0:q1] = g[0][0].transpose(0, 1)
        dk[k0:k1] = g[1][0].transpose(0, 1)
        dv[k0:k1] = g[2][0].transpose(0, 1)
    return (dq, dk, dv) if dtype is None else (dq.to(dtype), dk.to(dtype), dv.to(dtype))


class _FlashAttentionVarlen(torch.autograd.Function):
    """flash_attention_varlen with grad: the forward of the path chosen, the backward ``_varlen_backward_run`` of
    the same path (from the saved inputs, output and LSE, and the offsets: no score matrix kept), the LSE's gradient
    included."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, offsets, causal, scale, path, window):
        out, lse = _varlen_run(q, k, v, cu_q, cu_k, max_q, offsets, causal, scale, path, window)
        ctx.flags = (max_q, max_k, offsets, causal, scale, path, window)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.set_materialize_grads(False)  # an unused LSE's gradient comes as None, not a tensor of zeros
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, offsets, causal, scale, path, window = ctx.flags
        if dout is None:  # only the LSE was used
            dout = torch.zeros_like(out)
        if torch.is_grad_enabled() and path != "reference":  # a double backward: the kernels have no formula
            if offsets is None:
                offsets = tuple(cu.tolist() for cu in (cu_q, cu_k))
            path = "reference"
        dq, dk, dv = _varlen_backward_run(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, offsets, causal, scale,
                                          path, dlse, q.dtype, window)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


def _varlen_path(fn: str, impl, x, offsets, **inputs) -> str:
    """The path of a varlen call of q ``x`` (``inputs`` as ``resolve_impl`` reads them), its kernel inputs checked."""
    path = _fit(resolve_impl(fn, impl, x.device, VARLEN_IMPLS, **inputs), impl, x)
    if path != "reference":
        _check_kernel_inputs(fn, path, x)
    elif offsets is None:
        raise ValueError(f"{fn}: impl={impl!r} takes the reference path here (q.dtype={x.dtype}, head_dim="
                         f"{x.shape[-1]}), which reads cu_seqlens on the host and so cannot run inside CUDA-graph "
                         f"capture; capture a bfloat16 / float16 call of head dim {'/'.join(map(str, HEAD_DIMS))}")
    return path


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, causal=False,
                           scale=None, return_lse=False, impl="auto", *, window=None):
    """Attention over packed sequences of different lengths (FlashAttention's ``flash_attn_varlen_func``).

    Sequence b's queries are rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]`` of q, its keys and values rows
    ``cu_seqlens_k[b] .. cu_seqlens_k[b + 1]`` of k and v; each sequence is attended as ``flash_attention`` attends
    it alone (GQA, end-aligned causal mask: query i of Sq sees keys 0 .. i + Sk - Sq, FlashAttention 2.1+'s
    bottom-right alignment; ``window``; rows that see no key give 0 and LSE -inf).

    Args:
        q: (total_q, Hq, D); k, v: (total_k, Hkv, D), Hq divisible by Hkv; any strides. Kernels take bfloat16 /
            float16 and D in 64/128/256.
        cu_seqlens_q, cu_seqlens_k: (B + 1,) int32/int64 on q's device, B >= 1: 0, then nondecreasing, ending at
            total_q / total_k (zero-length sequences allowed on either side). On a GPU their values are read on
            the host once a tensor and version (a sync saved where the layers of a step pass one tensor): write
            them through torch ops (in place is fine) or pass a new tensor, not through ``.data`` or a kernel of
            your own, which torch does not count as writes.
        max_seqlen_q, max_seqlen_k: ints, at least the longest sequence's lengths, or None. Outside CUDA-graph
            capture the offsets are read on the host and the kernels' grids cover the longest sequence read (a
            larger value is only checked); inside capture both must be given, the grids cover them (the values
            are then not checked: they cannot be read there).
        causal, scale, window: as ``flash_attention``'s (scale default 1/sqrt(D)).
        return_lse: also return the float32 LSE, (Hq, total_q) (FlashAttention 2's varlen layout).
        impl: "auto" (the Triton kernel on GPUs where it applies, else the reference), "triton" (the portable
            forward kernel's VARLEN mode) or "reference" (``reference_flash_attention`` over each sequence, any
            dtype / device; reads the offsets on the host). No "cuda": no TMA / Gluon varlen kernel.

    Autograd: with grad mode on and q, k or v requiring grad, the call is the forward of an autograd node that keeps
    q, k, v, the output, the LSE and the offsets (no score matrix), whose backward is
    ``flash_attention_varlen_backward``'s of the same path; the LSE is differentiable too. Under ``torch.compile``
    the call is the custom op ``xelink::flash_attention_varlen`` (its body this eager call; its backward
    ``xelink::flash_attention_varlen_backward``), so a compiled function traces through it, grad included.

    Returns:
        out (total_q, Hq, D) in q's dtype (a new tensor), or (out, lse) with ``return_lse=True``.

    Raises:
        TypeError / ValueError: bad tensors, shapes, dtypes, devices, offsets, lengths, flags or impl, before
            anything runs.
    """
    fn = "flash_attention_varlen"
    if torch.compiler.is_compiling():  # traced: the custom op (its body is this call, checks and all)
        # the scalars first: the op would take bad ones as its sentinels (-1 lengths, window 0) or cast them
        _check_flags(fn, causal, scale, return_lse, window)
        _refuse_cuda(fn, impl)
        check_impl(fn, impl, VARLEN_IMPLS)
        _check_max_seqlen(fn, max_seqlen_q, max_seqlen_k)
        out, lse = torch.ops.xelink.flash_attention_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, -1 if max_seqlen_q is None else max_seqlen_q,
            -1 if max_seqlen_k is None else max_seqlen_k, causal, None if scale is None else float(scale), impl,
            window or 0)
        return (out, lse) if return_lse else out
    _check_qkv(fn, q, k, v, dims=3)
    _check_flags(fn, causal, scale, return_lse, window)
    _refuse_cuda(fn, impl)
    check_impl(fn, impl, VARLEN_IMPLS)
    max_q, max_k, offsets = _check_cu_seqlens(fn, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    path = _varlen_path(fn, impl, q, offsets, **({} if grad else dict(q=q, k=k, v=v)))
    _check_varlen_grid(fn, path, q.shape[2], max_q, max_k, True, grad)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    window = window or 0
    if grad:
        out, lse = _FlashAttentionVarlen.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, offsets, causal,
                                               scale, path, window)
    else:
        out, lse = _varlen_run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, offsets, causal, scale, path, window)
    return (out, lse) if return_lse else out


def flash_attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                                    max_seqlen_k=None, causal=False, scale=None, impl="auto", *, dlse=None, dtype=None,
                                    window=None):
    """Gradients of ``flash_attention_varlen``'s output with respect to q, k and v (``flash_attention_backward`` of
    packed sequences: each sequence's as that function gives them for it alone).

    Args:
        dout: (total_q, Hq, D), the output's gradient; q, k, v, cu_seqlens_*, max_seqlen_*, causal, scale, window:
            the forward's; out: its output; lse: its float32 LSE (Hq, total_q).
        dlse: the LSE's gradient, (Hq, total_q), where a loss used it too (None: zero).
        dtype: the results' floating dtype (None: float32, float64 for float64 inputs on the reference path).
        impl: "auto", "triton" (``attention_bwd``'s passes in their VARLEN mode: bfloat16 / float16, head dim 64 /
            128 / 256) or "reference" (``reference_flash_attention_backward``'s torch ops over each sequence); no
            "cuda".

    Returns:
        (dq (total_q, Hq, D), dk, dv (total_k, Hkv, D), summed over the q heads of each KV head), new tensors.

    Raises:
        TypeError / ValueError: as ``flash_attention_varlen``, and for dout, out, lse, dlse or dtype.
    """
    fn = "flash_attention_varlen_backward"
    _check_backward(fn, dout, q, k, v, out, lse, causal, scale, dlse, window, varlen=True)
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"{fn}: dtype={dtype!r} must be None or a floating torch.dtype")
    _refuse_cuda(fn, impl)
    check_impl(fn, impl, VARLEN_IMPLS)
    max_q, max_k, offsets = _check_cu_seqlens(fn, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    path = _varlen_path(fn, impl, q, offsets, dout=dout, q=q, k=k, v=v, out=out, lse=lse, dlse=dlse)
    _check_varlen_grid(fn, path, q.shape[2], max_q, max_k, False, True)
    if path != "reference" and dout.dtype != q.dtype:
        raise TypeError(f"{fn}: dout.dtype={dout.dtype} != q.dtype={q.dtype} (impl={path!r} takes them alike)")
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    return _varlen_backward_run(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_q, max_k, offsets, causal,
                                scale, path, dlse, dtype, window or 0)


# flash_attention_varlen traced: a custom op whose body is the eager call (checks, the host read of the offsets and
# all: opaque to the tracer, which cannot follow a host read), its backward the backward op's; max lengths -1 for None.
@torch.library.custom_op("xelink::flash_attention_varlen", mutates_args=())
def _varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
               max_k: int, causal: bool, scale: float | None, impl: str,
               window: int) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return flash_attention_varlen(q, k, v, cu_q, cu_k, None if max_q < 0 else max_q, None if max_k < 0 else max_k,
                                      causal, scale, True, impl, window=window or None)


@_varlen_op.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, impl, window):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("xelink::flash_attention_varlen_backward", mutates_args=())
def _varlen_backward_op(dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                        max_q: int, max_k: int, causal: bool, scale: float | None, impl: str,
                        window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return flash_attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, None if max_q < 0 else max_q,
                                           None if max_k < 0 else max_k, causal, scale, impl, dlse=dlse, dtype=q.dtype,
                                           window=window or None)


@_varlen_backward_op.register_fake
def _(dout, dlse, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, impl, window):
    # contiguous, as the real results (empty_like would keep a dense permuted q's strides: inductor asserts them)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *ctx.flags = inputs
    ctx.save_for_backward(q, k, v, *output, cu_q, cu_k)


def _varlen_traced_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    if dout is None:  # only the LSE was used
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.xelink.flash_attention_varlen_backward(dout, dlse, q, k, v, out, lse, cu_q, cu_k,
                                                                  *ctx.flags)
    return dq, dk, dv, None, None, None, None, None, None, None, None


_varlen_op.register_autograd(_varlen_traced_backward, setup_context=_varlen_setup_context)


def merge_attention(outs, lses, impl="auto", *, out=None, pdl=None):
    """Combine attention results over disjoint KV shards into the result over all of them.

    With ``w_i = exp(lse_i - max_j lse_j)``: ``out = sum_i w_i out_i / sum_i w_i`` and
    ``lse = max_j lse_j + log(sum_i w_i)``; exact up to rounding, in float32. Shards whose LSE is -inf
    (no visible key) weigh nothing; if all are, the row is 0 with LSE -inf.

    Args:
        outs: sequence of n >= 1 tensors (B, H, S, D) of one floating dtype (or one (n, B, H, S, D) tensor).
        lses: sequence of n float32 tensors (B, H, S) (or one (n, B, H, S) tensor).
        impl: "auto", "triton" (one Triton kernel) or "reference" (no "cuda": no NVIDIA-specific kernel).
        out: optional (B, H, S, D) tensor of the outs' dtype and device for the merged output: any view
            with unit stride along D; it may be one of ``outs`` (the partials are read from a stacked copy).
        pdl: programmatic dependent launch of the merge kernel (pdl.py; CUDA sm90+): None (on where it
            exists, as decode_attention's merge), True, False, "early" or "late".

    Returns:
        (out (B, H, S, D) in the outs' dtype, lse (B, H, S) float32, a new tensor).
    """
    fn = "merge_attention"
    outs, lses = _check_merge(fn, outs, lses)
    path = resolve_impl(fn, impl, outs[0].device, MERGE_IMPLS, **{f"outs[{i}]": o for i, o in enumerate(outs)})
    _check_out_like(fn, out, outs[0])
    pdl = pdl_option(fn, pdl, path, outs[0].device)
    if torch.compiler.is_compiling():
        out = _traced_out(out, outs[0])
        return out, torch.ops.xelink.merge_attention(outs, lses, path, pdl, out)
    return _merge_run(outs, lses, path, out, pdl)


def _checked_decode(fn: str, q, k_cache, v_cache, kv_lens, num_splits, causal, scale, return_lse, impl, pdl, out,
                    window=None, **inputs):
    """decode_attention's checks (rope_decode_attention's too, its other ``inputs`` for autograd): (path, pdl
    option, scale)."""
    _check_decode(fn, q, k_cache, v_cache, kv_lens, num_splits)
    _check_flags(fn, causal, scale, return_lse, window)
    path = _fit(resolve_impl(fn, impl, q.device, DECODE_IMPLS, **inputs, q=q, k_cache=k_cache, v_cache=v_cache), impl,
                q)
    pdl = pdl_option(fn, pdl, path, q.device)
    if path != "reference":
        _check_kernel_inputs(fn, path, q)
    _check_out_like(fn, out, q)
    return path, pdl, 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)


def decode_attention(q, k_cache, v_cache, kv_lens, causal=False, scale=None, return_lse=False, num_splits=None,
                     impl="auto", pdl=None, *, out=None, window=None):
    """Attention of a few new query tokens over a long KV cache, split along the keys and then merged.

    Batch b attends to ``k_cache[b, :, :kv_lens[b]]``. The work is split into ``num_splits`` pieces of the
    KV range per (batch, KV head), all q heads of a KV head packed into one tile (one read of the cache for
    the group); the last split of a block to finish merges the partials as ``merge_attention`` does, in the
    same launch (split.py). ``kv_lens`` stays on the device (no host synchronisation), so the call can be
    captured in a CUDA graph and replayed as lengths change.

    Args:
        q: (B, Hq, Sq, D), Sq new tokens per sequence (designed for 1-16).
        k_cache, v_cache: (B, Hkv, Smax, D), Hq divisible by Hkv, q's dtype and device.
        kv_lens: (B,) int32/int64 on q's device: valid keys per sequence (clamped to [0, Smax]).
        causal: new token i sees keys 0 .. kv_lens[b] - Sq + i (the new tokens are the last Sq in the cache).
        scale: softmax scale, > 0; default 1/sqrt(D).
        return_lse: also return the float32 LSE (B, Hq, Sq).
        num_splits: KV splits per (batch, KV head); None picks from the device size and Smax.
        impl: "auto", "triton" (one split kernel whose last split merges) or "reference" (no "cuda": no
            NVIDIA-specific kernel).
        pdl: programmatic dependent launch of the split kernel (pdl.py; CUDA sm90+): None
            (on where it exists), True (the same, required), False, "early" or "late".
        out: optional (B, Hq, Sq, D) tensor of q's dtype and device for the output (the merge writes it):
            any view with unit stride along D sharing no memory with q, the caches or kv_lens.
        window: None, or an int >= 1: a sliding window, each new token sees only the ``window`` keys ending at its
            last visible one (token i of a causal call: keys ``kv_lens[b] - Sq + i - window + 1 ..``); the splits
            then share those keys alone.

    Returns:
        ``out`` (a new tensor unless given) in q's dtype, or (out, lse).
    """
    key = path_key(("decode", impl, pdl, causal, scale, return_lse, num_splits, window), (q, k_cache, v_cache,
                                                                                         kv_lens), (out,))
    hit = _PATHS.get(key) if key is not None else None
    if hit is not None:
        out, lse = _decode_run(q, k_cache, v_cache, kv_lens, causal, hit[2], hit[3], hit[0], hit[1], out, hit[4],
                               window or 0)
        return (out, lse) if return_lse else out
    fn = "decode_attention"
    path, pdl, scale = _checked_decode(fn, q, k_cache, v_cache, kv_lens, num_splits, causal, scale, return_lse, impl,
                                       pdl, out, window)
    num_splits, window = num_splits or 0, window or 0
    if key is not None:
        _PATHS.remember(key, (path, pdl, scale, num_splits, None if path == "reference" else
                              _DecodeLaunch(q, k_cache, v_cache, out, causal, scale, num_splits, None, pdl, True,
                                            return_lse, window=window)))
    if torch.compiler.is_compiling():
        out = _traced_out(out, q)
        lse = torch.ops.xelink.decode_attention(q, k_cache, v_cache, kv_lens, causal, scale, num_splits, path, pdl,
                                                out, window)
    else:
        out, lse = _decode_run(q, k_cache, v_cache, kv_lens, causal, scale, num_splits, path, pdl, out, window=window)
    return (out, lse) if return_lse else out


def rope_decode_attention(q, k, v, cos, sin, k_cache, v_cache, kv_lens, scale=None, impl="auto", pdl=None, *,
                          out=None, prefetch=None, window=None, ring=False):
    """One decode step's attention with the new token's RoPE and KV-cache write in the same launch:
    ``rope_kv(q, k, v, cos, sin, kv_lens - 1, k_cache, v_cache)`` then ``decode_attention`` of the rotated q.

    Sequence b's new token sits at position ``p = kv_lens[b] - 1``: q and k are rotated with rows ``p`` of
    ``cos`` / ``sin`` (rotate-half, float32, rounded once, as :func:`xelink.kernels.rope_kv`), the rotated k
    and v are written to cache row ``p``, and the rotated q attends to rows ``0 .. p``. The kernel is
    decode_attention's split kernel: the split that holds row ``p`` writes it before it reads the cache.

    Args:
        q: (B, Hq, 1, D) unrotated; k, v: (B, Hkv, 1, D), the new token's unrotated key and its value (views
            such as a fused QKV projection's columns are fine: unit stride along D).
        cos, sin: (max_positions, D) float tables, unit stride along D.
        k_cache, v_cache: (B, Hkv, Smax, D) in q's dtype, unit stride along D.
        kv_lens: (B,) int32/int64 on q's device, each in [1, min(Smax, max_positions)] (``ring``: [1,
            max_positions]) (not checked: that would synchronize).
        scale: softmax scale, > 0; default 1/sqrt(D).
        impl: "auto", "triton" or "reference" (as ``decode_attention``).
        pdl: as ``decode_attention``, but None is not placed early: behind the QKV GEMV that precedes it in a
            decode step, its waiting programs slowed that GEMV (a Llama-3.1-8B step on an H200: 5.15 ms at 32K
            without, 5.37 with; benchmarks/results/h200-issue26/rope_decode_ab.log); on sm90 it lets the next
            kernel go once its main loop is done (``DECODE_RELEASE``: the O GEMV's launch overlaps its end).
        out: optional (B, Hq, 1, D) tensor of q's dtype and device for the output, sharing no memory with
            the inputs or caches.
        prefetch: optional contiguous tensor on q's device that the next kernel reads (a decode step: the O
            projection's weight): once their keys are read, the programs of sequences of at least
            ``NEXT_MIN_KEYS`` (4096) keys ask L2 for its bytes between them, so that HBM streams the weight while
            the splits merge and the next kernel starts. A hint: it changes no value; the Triton path on sm90+
            only (the bulk prefetch), ignored elsewhere and where traced.
        window: None, or an int >= 1: a sliding window (as ``decode_attention``'s): the new token sees rows
            ``p - window + 1 .. p``.
        ring: the caches are rings holding each sequence's latest ``Smax`` positions (a sliding-window layer's
            cache of ``window`` rows, whatever the context): position ``p`` sits at row ``p % Smax``; the new
            token is written at row ``p % Smax`` and sees the ``min(p + 1, Smax)`` rows in use (keys are stored
            rotated, so their order in the ring does not matter). ``window`` must then be None.

    Returns:
        ``out`` (a new tensor unless given) in q's dtype.

    Raises:
        TypeError / ValueError: before anything runs, naming the bad argument.
    """
    key = path_key(("rope_decode", impl, pdl, scale, window, ring), (q, k, v, cos, sin, k_cache, v_cache, kv_lens),
                   (out, prefetch))
    hit = _PATHS.get(key) if key is not None else None
    if hit is not None:
        return _rope_decode_run(q, k, v, cos, sin, k_cache, v_cache, kv_lens, hit[2], hit[0], hit[1], out, hit[3],
                                prefetch if hit[4] else None, window or 0, ring)
    fn = "rope_decode_attention"
    check_rope_kv(fn, q, k, v, cos, sin, k_cache, v_cache)
    _check_ring(fn, ring, window)
    path, option, scale = _checked_decode(fn, q, k_cache, v_cache, kv_lens, None, False, scale, False, impl,
                                          False if pdl is None else pdl, out, window, k=k, v=v, cos=cos, sin=sin)
    release = pdl is None and DECODE_RELEASE and sm90_kernel(path, q.device)
    pdl = "release" if release else option
    window = window or 0
    if path != "reference" and any(t.stride(-1) != 1 for t in (q, k, v, cos, sin, k_cache, v_cache)):
        raise ValueError(f"{fn}: q, k, v, cos, sin and the caches need unit stride along D")
    prefetch = _check_prefetch(fn, prefetch, q, path)
    if key is not None:
        _PATHS.remember(key, (path, pdl, scale, None if path == "reference" else
                              _DecodeLaunch(q, k_cache, v_cache, out, False, scale, 0, None, pdl, True, False,
                                            (k, v, cos, sin), _next_bytes(prefetch), window, ring),
                              prefetch is not None))
    if torch.compiler.is_compiling():  # traced: the custom op writes out and the caches (no prefetch hint)
        out = _traced_out(out, q)
        torch.ops.xelink.rope_decode_attention(q, k, v, cos, sin, k_cache, v_cache, kv_lens, scale, path, pdl, out,
                                               window, ring)
        return out
    return _rope_decode_run(q, k, v, cos, sin, k_cache, v_cache, kv_lens, scale, path, pdl, out, prefetch=prefetch,
                            window=window, ring=ring)

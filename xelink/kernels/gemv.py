"""Split-K GEMV ``y = x @ W^T`` for 1-8 activation rows: bf16/fp16, W8A16 and W4A16 weights.

Weights are ``W [N, K]`` (one output feature a row), activations ``x [M, K]`` with ``1 <= M <= 8``
(decode). Formats (DESIGN.md, "Contracts"):

- ``"bf16"`` / ``"fp16"``: ``W`` in the activation dtype.
- ``"w8a16"``: ``W`` int8 ``[N, K]``, ``scales [N]`` in the activation dtype; value = q * scale[n].
- ``"w4a16"``: ``W`` uint8 ``[N, K/2]``, low nibble = even k, high nibble = odd k; ``scales [N, K/128]``
  in the activation dtype; value = (nibble - 8) * scale[n, k // 128]. K must be a multiple of 128.

Three Triton kernels stream W once (a fourth, ``tc``, below); each program owns ``BLOCK_N`` rows of W
and one of ``SPLIT_K`` slices of K (with ``SPLIT_K > 1`` the slices write fp32 partial sums, and the
last split of each tile to finish adds them in split order, in the same launch: ``split.py``). A split
is a whole number of ``BLOCK_K`` tiles, so the compiler sees the tile alignment and keeps the loads 16
bytes wide.

- ``fma`` (1-4 rows, dense and W8A16): CUDA-core FMAs into per-row fp32 accumulators reduced once at
  the end; small tiles, many programs resident per multiprocessor. Quantized weights become exact
  fp32 with integer bit tricks instead of int->float conversions (1/4 rate on Hopper): a byte or
  nibble OR-ed under the exponent of 2^23 is 2^23 + value exactly; one subtraction leaves the value.
- ``words`` (1-4 rows, W4A16; W8A16 on large matrices): the quantized weights read as 32-bit words,
  one word of a row a thread, one-warp programs; a word's activations are one load by the same thread,
  so no data moves between threads. W4: a nibble AND-ed into the mantissa of 1.0f is 1 + n/256 (or
  1 + n/16) exactly, one lop3 a weight; the constant parts are removed once per word with the sums
  of its activations (fp32 throughout, exact up to fp32 rounding).
- ``mma`` (5-8 rows): a tensor-core dot of the (dequantized) weight tile with the activations padded
  to 16 rows. With ``impl="cuda"`` the dequantization is inline PTX (prmt/lop3 into the 16-bit magic
  128.0 / 1024.0, one packed fma to remove the offset: 1.5 instructions a weight, exact);
  ``impl="triton"`` uses plain Triton ops and one exact 16-bit subtraction a weight. (It used to
  remove the offset as a dot with a constant tile: -1032 * sum(x) in fp32 cost fp16 activations 7 bits
  where the result cancels, which a GPU stress run caught as a 1.8e-3 relative error on one output.)
  ``FOLD`` (W4A16 with fewer than 8192 rows) multiplies the scales into the tile, each weight
  ``(n - 8) * scale`` rounded once to the activation dtype, and does one dot a ``BLOCK_K`` tile.
- ``tc`` (``impl="cuda"``, quantized weights: the default at 5-8 rows, at 1-4 rows from 8192 rows,
  and for W4A16 where K <= N):
  a fourth kernel, in Gluon (``gemv_tc.py``), that loads weights and activations straight into the
  ``mma.sync`` fragments (no shared memory in its loop) and splits K among the warps of a program.
- ``cu`` (``impl="cuda"``, fmt ``"w4a16t"``: the default there where NVRTC is, ``CU_W4``): the same fragments in
  CUDA C++ (``gemv_cu.py``, NVRTC), its loads batched in registers or copied into shared memory by ``cp.async``.

With ``impl="cuda"`` on sm90+ every kernel is launched with programmatic dependent launch (``pdl=``,
on by default there; ``pdl.py``): it waits for the previous kernel before it touches
memory, and lets the next one be placed early, so back-to-back GEMVs overlap one's launch with the
other's tail (2-10% on 4096-row matrices). ``out=`` writes y into a caller's ``[M, N]`` view.

H200 results against torch's bf16 GEMV: benchmarks/results/h200-kernels.
``pack_w8a16`` / ``pack_w4a16`` quantize a float weight to these formats (symmetric, per row / per
128 columns) and ``unpack_w8a16`` / ``unpack_w4a16`` return the exact float32 values the kernels use.
"""
from __future__ import annotations

import functools
import warnings

import torch

from .common import (Paths, auto_takes_triton, capability, cdiv, check_impl, check_no_overlap, check_out,
                     check_same_device, check_tensor, forward_only, interpreting, path_key, require_triton, sm_count,
                     tl, triton)
from .gemv_cu import CuLaunch, check_cu_config, cu_available, cu_config
from .gemv_tc import TC_AVAILABLE, W4_EXACT, W8_PTX, tc_config, tc_fuses_act, tc_launch_args, w4_ptx
from .launcher import Slot, launch_plan
from .norm import reference_silu_mul, silu_mul
from .pdl import PDL_MODES, pdl_launch, pdl_option, pdl_wait, prefetch_args, prefetch_bytes, prefetch_l2
from .split import SCRATCH, last_split

__all__ = ["GEMV_ACTS", "GEMV_FORMATS", "GEMV_IMPLS", "W4_GROUP", "W4_TILE_ROWS", "gemv", "pack_w4a16", "pack_w8a16",
           "reference_gemv", "tile_w4a16", "tiled_w4a16_native", "unpack_w4a16", "unpack_w8a16", "untile_w4a16"]

GEMV_FORMATS = ("bf16", "fp16", "w8a16", "w4a16", "w4a16t")
GEMV_IMPLS = ("auto", "triton", "cuda", "reference")
GEMV_ACTS = ("silu_mul",)  # act=: an activation applied to the output at the store
W4_GROUP = 128  # columns of W sharing one W4A16 scale
W4_TILE_ROWS = 16  # rows of a "w4a16t" tile (its columns: one scale group)
MAX_ROWS = 8
_FLOAT16 = {"bf16": torch.bfloat16, "fp16": torch.float16}
_FMT_CODE = {"bf16": 0, "fp16": 0, "w8a16": 1, "w4a16": 2, "w4a16t": 2}
# pdl="auto": a launch of at most this many rows of W lets the next kernel go early, a larger one late (the H200
# sweep in _GemvLaunch); an A/B switch (benchmarks/scripts/rope_decode_ab.py), read when a launch is planned.
PDL_EARLY_MAX_ROWS = 8192
# act="silu_mul" on the tensor-core kernel: TC_ACT_FUSED applies it at the store where a program's rows pair (gate, up)
# halves (tc_fuses_act; tiled W4A16 at 1-4 rows then takes TC_ACT_TILES, a (gate, up) pair of 16-row blocks a
# program), one launch; off, the kernel's GEMV then silu_mul (two launches). Off: on an H100 the fused tiles were no
# faster in the Llama-3.1-8B gate_up chain (25.07 us a call against the two launches' 24.98; 2 x 4 warps x 1 step
# 28.34; benchmarks/results/h100-rows, twenty-seventh session); an A/B switch (step_ab.py, gemv_chain_sweep.py),
# read when a launch is planned, for the H200 A/B still to run (h200_pending.sh s27).
TC_ACT_FUSED = False
TC_ACT_TILES = dict(ROW_TILES=2, num_warps=4, UNROLL=2)
# Tiled W4A16 ("w4a16t") at 1-8 rows with impl="cuda" on the CUDA C++ kernel (gemv_cu, KERNEL="cu") instead of the
# tensor-core one: the Llama-3.1-8B W4A16 step 2.409 -> 2.209 ms on an H100 (step_ab.py gemv.CU_W4=False,True,
# benchmarks/results/h100-gpu-tests/s37b_cu_step_ab.log; not yet on an H200); an A/B switch, read when a launch is
# planned (False: the tensor-core kernel, as before). Where NVRTC or the driver cannot build it, a RuntimeWarning and
# the tensor-core kernel.
CU_W4 = True


# -- packing --------------------------------------------------------------------------------------

_BITS_OF = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _scale_up(fn: str, amax: torch.Tensor, qmax: int, dtype: torch.dtype) -> torch.Tensor:
    """amax / qmax rounded to ``dtype``, the next value of ``dtype`` up where rounding went down (so |w| / scale
    never exceeds qmax and the largest weight is not clipped; one bit pattern up, as a relative bump is lost among
    float16's subnormals, where a scale rounded down to 2^-24, or to 0); 1 where amax is 0. A scale past ``dtype``'s
    largest (float16 scales of weights over 65504 * qmax) is a ValueError naming ``fn``, not an inf scale whose
    weights dequantize to NaN."""
    exact = amax.float() / qmax
    scale = exact.to(dtype).contiguous()
    up = (scale.view(_BITS_OF[scale.element_size()]) + 1).view(dtype)  # (scale >= 0: the next value up)
    scale = torch.where(scale.float() < exact, up, scale)
    if bool(torch.isinf(scale).any()):
        raise ValueError(f"{fn}: the weights' largest magnitude {amax.max().item():g} needs a scale over "
                         f"{dtype}'s largest ({torch.finfo(dtype).max:g}); pack with dtype=torch.bfloat16")
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def _check_float_weight(fn: str, w) -> None:
    check_tensor(fn, "w", w)
    if w.dim() != 2:
        raise ValueError(f"{fn}: w must be 2-D [N, K], got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise TypeError(f"{fn}: w.dtype={w.dtype} must be a floating dtype")


def pack_w8a16(w: torch.Tensor, dtype: torch.dtype | None = None, amax: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w [N, K]`` to int8 with one symmetric scale per row.

    Args:
        w: ``[N, K]`` float weight.
        dtype: dtype of the scales (the activation dtype); default ``w.dtype`` (bf16/fp16), else bf16.
        amax: ``[N]`` the rows' largest magnitudes to scale by, at least ``w``'s (None: ``w``'s own): where ``w`` is
            a slice of columns of a whole weight (a row-parallel projection's), the whole rows', so that every
            slice takes the scale the whole weight would.

    Returns:
        ``(q, scales)``: ``q`` int8 ``[N, K]`` in [-127, 127], ``scales [N]`` with
        ``scale = max|w[n]| / 127`` in ``dtype`` (rounded up; 1 for an all-zero row); q is rounded against
        the stored scale, so ``unpack_w8a16(q, scales)`` is the value the kernel multiplies.
    """
    _check_float_weight("pack_w8a16", w)
    dtype = dtype or (w.dtype if w.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16)
    wf = w.float()
    own = wf.abs().amax(dim=1)
    if amax is not None:
        check_tensor("pack_w8a16", "amax", amax, 1)
        if amax.shape[0] != w.shape[0] or bool((amax.float() < own).any()):
            raise ValueError(f"pack_w8a16: amax (shape {tuple(amax.shape)}) must give each of w's {w.shape[0]} rows "
                             f"a magnitude at least its own largest")
        own = amax.float().to(own.device)
    scales = _scale_up("pack_w8a16", own, 127, dtype)
    q = torch.round(wf / scales.float()[:, None]).clamp_(-128, 127).to(torch.int8)
    return q, scales


def _check_packed(fn: str, q, scales, dtype: torch.dtype, scale_shape) -> None:
    """A quantized pair as ``pack_*`` returns it: ``q`` 2-D of ``dtype``, ``scales`` of ``scale_shape(q)``."""
    check_tensor(fn, "q", q, 2)
    check_tensor(fn, "scales", scales)
    if q.dtype != dtype:
        raise TypeError(f"{fn}: the packed weight's dtype is {q.dtype}, not {dtype} (see pack_{fn[7:]})")
    want = scale_shape(q)
    if tuple(scales.shape) != want:
        raise ValueError(f"{fn}: scales.shape={tuple(scales.shape)} must be {want} for a packed weight of shape "
                         f"{tuple(q.shape)}")


def unpack_w8a16(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The exact float32 weight ``q[n, k] * scales[n]`` of a W8A16 pair."""
    _check_packed("unpack_w8a16", q, scales, torch.int8, lambda t: (t.shape[0],))
    return q.float() * scales.float()[:, None]


def pack_w4a16(w: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``w [N, K]`` (K a multiple of 128) to 4 bits with one symmetric scale per 128 columns.

    Args:
        w: ``[N, K]`` float weight.
        dtype: dtype of the scales (the activation dtype); default ``w.dtype`` (bf16/fp16), else bf16.

    Returns:
        ``(packed, scales)``: ``packed`` uint8 ``[N, K/2]`` (low nibble = even k, high nibble = odd k,
        nibble = q + 8 with q in [-7, 7]), ``scales [N, K/128]`` with ``scale = max|w[group]| / 7``
        in ``dtype`` (rounded up; 1 for an all-zero group).
    """
    _check_float_weight("pack_w4a16", w)
    n, k = w.shape
    if k % W4_GROUP:
        raise ValueError(f"pack_w4a16: K={k} must be a multiple of {W4_GROUP} (one scale per {W4_GROUP} columns)")
    dtype = dtype or (w.dtype if w.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16)
    groups = w.float().reshape(n, k // W4_GROUP, W4_GROUP)
    amax = groups.abs().amax(dim=2)
    scales = _scale_up("pack_w4a16", amax, 7, dtype)
    q = torch.round(groups / scales.float()[:, :, None]).clamp_(-8, 7).to(torch.int16).reshape(n, k) + 8
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
    return packed, scales


def unpack_w4a16(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The exact float32 weight ``(nibble - 8) * scale`` of a W4A16 pair, ``[N, K]``."""
    _check_packed("unpack_w4a16", packed, scales, torch.uint8, lambda t: (t.shape[0], 2 * t.shape[1] // W4_GROUP))
    n, half = packed.shape
    if 2 * half % W4_GROUP:
        raise ValueError(f"unpack_w4a16: K={2 * half} must be a multiple of {W4_GROUP}")
    p = packed.to(torch.int16)
    q = torch.stack(((p & 0xF) - 8, (p >> 4) - 8), dim=2).reshape(n, 2 * half)
    return (q.float().reshape(n, -1, W4_GROUP) * scales.float()[:, :, None]).reshape(n, 2 * half)


def _tiles_view(fn: str, packed: torch.Tensor) -> tuple[int, int, int]:
    """(row blocks, groups, bytes a group row) of a W4A16 weight ``[N, K/2]`` cut into "w4a16t" tiles."""
    check_tensor(fn, "packed", packed, 2)
    if packed.dtype != torch.uint8:
        raise TypeError(f"{fn}: packed.dtype={packed.dtype} must be torch.uint8 (see pack_w4a16)")
    n, half = packed.shape
    if n % W4_TILE_ROWS or 2 * half % W4_GROUP:
        raise ValueError(f"{fn}: packed.shape={tuple(packed.shape)} must be [N, K/2] with N a multiple of "
                         f"{W4_TILE_ROWS} and K of {W4_GROUP}")
    return n // W4_TILE_ROWS, 2 * half // W4_GROUP, W4_GROUP // 2


def tile_w4a16(packed: torch.Tensor) -> torch.Tensor:
    """A W4A16 weight (``pack_w4a16``'s ``[N, K/2]``) in the ``"w4a16t"`` layout: the same bytes, stored as tiles
    of 16 rows x 128 columns (one scale group: 64 bytes a row), each tile contiguous, a block of 16 rows' tiles
    in column order, blocks in row order. The shape stays ``[N, K/2]`` (a new contiguous tensor); the scales are
    unchanged. ``gemv`` reads it in place on the tensor-core kernel (``tiled_w4a16_native``), where a warp's
    step is then one contiguous 1 KB piece instead of 16 rows' 64 bytes (HBM reads them faster: Llama-3.1-8B's
    one-row gate/up and O GEMVs 14% and 18% on an H100, benchmarks/results/h100-rows); ``qgemm`` reads it in place
    too.

    Args:
        packed: uint8 ``[N, K/2]``, N a multiple of 16, K of 128.

    Returns:
        uint8 ``[N, K/2]``, contiguous.
    """
    blocks, groups, width = _tiles_view("tile_w4a16", packed)
    return (packed.reshape(blocks, W4_TILE_ROWS, groups, width).permute(0, 2, 1, 3).contiguous()
            .reshape(packed.shape))


def untile_w4a16(tiled: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`tile_w4a16`: a ``"w4a16t"`` weight back in ``pack_w4a16``'s row layout
    (``[N, K/2]``, contiguous)."""
    blocks, groups, width = _tiles_view("untile_w4a16", tiled)
    if not tiled.is_contiguous():
        raise ValueError(f"untile_w4a16: a tiled weight is contiguous (stride {tiled.stride()})")
    return (tiled.reshape(blocks, groups, W4_TILE_ROWS, width).permute(0, 2, 1, 3).contiguous()
            .reshape(tiled.shape))


def _dequantize(w: torch.Tensor, scales, fmt: str) -> torch.Tensor:
    if fmt == "w8a16":
        return unpack_w8a16(w, scales)
    if fmt == "w4a16t":
        return unpack_w4a16(untile_w4a16(w), scales)
    if fmt == "w4a16":
        return unpack_w4a16(w, scales)
    return w.float()


def reference_gemv(w: torch.Tensor, x: torch.Tensor, scales: torch.Tensor | None = None,
                   fmt: str = "bf16") -> torch.Tensor:
    """``x @ W^T`` with W dequantized exactly, computed in float32 and rounded once to ``x.dtype``.

    Args and Returns: as ``gemv``.
    """
    x2 = x.reshape(1, -1) if x.dim() == 1 else x
    y = (x2.float() @ _dequantize(w, scales, fmt).T).to(x.dtype)
    return y.reshape(-1) if x.dim() == 1 else y


# -- kernels --------------------------------------------------------------------------------------

if triton is not None:

    # PTX dequantizers (impl="cuda"): four bytes a call, results packed two to a register as the
    # tensor-core operands take them. W4: prmt spreads two bytes into the low byte of each 16-bit half,
    # one lop3 ((a & b) | c) puts a nibble under the magic exponent (B + nibble exactly), and one packed
    # fma subtracts B + 8: 1.5 instructions a weight, exact.
    _W4_PTX = """{
        .reg .b32 z, m, one, off, u0, u1, u2, u3;
        mov.b32 z, 0;
        mov.b32 m, MAGIC2;
        mov.b32 one, ONE2;
        mov.b32 off, OFF2;
        prmt.b32 u0, $4, z, 0x4140;
        prmt.b32 u1, $4, z, 0x4342;
        shr.b32 u2, u0, 4;
        shr.b32 u3, u1, 4;
        lop3.b32 u0, u0, 0x000F000F, m, 0xEA;
        lop3.b32 u1, u1, 0x000F000F, m, 0xEA;
        lop3.b32 u2, u2, 0x000F000F, m, 0xEA;
        lop3.b32 u3, u3, 0x000F000F, m, 0xEA;
        FINISH
    }"""
    # u0 / u1: the low nibbles of bytes 0, 1 / 2, 3; u2 / u3: their high nibbles. Exact finish:
    # gemv_tc.W4_EXACT. The same with the scale applied: (nibble - 8) exactly, then one packed multiply
    # by the scale pair ($5, $6: the group's scale twice), rounded once: 2 instructions a weight.
    _W4_SCALED = """fma.rn.TY u0, u0, one, off;
        mul.rn.TY $0, u0, $5;
        fma.rn.TY u1, u1, one, off;
        mul.rn.TY $1, u1, $6;
        fma.rn.TY u2, u2, one, off;
        mul.rn.TY $2, u2, $5;
        fma.rn.TY u3, u3, one, off;
        mul.rn.TY $3, u3, $6;"""

    def _w4_ptx(finish: str, ty: str):
        return tl.constexpr(w4_ptx(_W4_PTX, finish, ty))

    _W4_PTX_BF16, _W4_PTX_FP16 = _w4_ptx(W4_EXACT, "bf16"), _w4_ptx(W4_EXACT, "fp16")
    _W4S_PTX_BF16, _W4S_PTX_FP16 = _w4_ptx(_W4_SCALED, "bf16"), _w4_ptx(_W4_SCALED, "fp16")
    # W8 to bf16 / fp16, exact (gemv_tc.W8_PTX).
    _W8_PTX_BF16, _W8_PTX_FP16 = tl.constexpr(W8_PTX["bf16"]), tl.constexpr(W8_PTX["fp16"])

    @triton.jit
    def _q8_float(u):
        """q as an exact float32 from u = q + 128 (0..255): u in the low byte of the float 2^23 is exactly
        2^23 + u; one subtraction leaves q."""
        return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0

    @triton.jit
    def _mantissa_float(bits, mask):
        """1.0f with ``bits & mask`` ORed into its mantissa (mask within bits 0-22): exactly 1 + field / 2^23."""
        return ((bits & mask) | 0x3F800000).to(tl.float32, bitcast=True)

    @triton.jit
    def _dequant_w8(w, x_dtype: tl.constexpr, PTX: tl.constexpr):
        """int8 tile -> exactly equal tile of x_dtype."""
        if PTX:
            if x_dtype == tl.bfloat16:
                return tl.inline_asm_elementwise(_W8_PTX_BF16, "=r,=r,r", [w], dtype=tl.bfloat16, is_pure=False,
                                                 pack=4)
            else:
                return tl.inline_asm_elementwise(_W8_PTX_FP16, "=r,=r,r", [w], dtype=tl.float16, is_pure=False,
                                                 pack=4)
        else:
            return _q8_float(w.to(tl.uint8, bitcast=True).to(tl.int32) ^ 0x80).to(x_dtype)

    @triton.jit
    def _dequant_w4(p, x_dtype: tl.constexpr, MAGIC: tl.constexpr, BIAS: tl.constexpr, PTX: tl.constexpr):
        """Packed uint8 tile -> (low, high) nibble - 8 in x_dtype, exactly (PTX: a packed fma; else
        B + nibble with B = 128 (bf16) or 1024 (fp16) minus BIAS = B + 8, exact: both lie in [B, B + 16))."""
        if PTX:
            if x_dtype == tl.bfloat16:
                lo, hi = tl.inline_asm_elementwise(_W4_PTX_BF16, "=r,=r,=r,=r,r", [p],
                                                   dtype=(tl.bfloat16, tl.bfloat16), is_pure=False, pack=4)
            else:
                lo, hi = tl.inline_asm_elementwise(_W4_PTX_FP16, "=r,=r,=r,=r,r", [p],
                                                   dtype=(tl.float16, tl.float16), is_pure=False, pack=4)
        else:
            # MAGIC | nibble is the 16-bit float B + nibble, exactly.
            q = p.to(tl.int16)
            lo = ((q & 0xF) | MAGIC).to(x_dtype, bitcast=True) - BIAS
            hi = ((q >> 4) | MAGIC).to(x_dtype, bitcast=True) - BIAS
        return lo, hi

    @triton.jit
    def _dequant_w4_scaled(p, s, x_dtype: tl.constexpr, PTX: tl.constexpr):
        """Packed uint8 tile and its scales (same shape) -> (low, high) (nibble - 8) * scale in x_dtype,
        rounded once."""
        if PTX:
            if x_dtype == tl.bfloat16:
                lo, hi = tl.inline_asm_elementwise(_W4S_PTX_BF16, "=r,=r,=r,=r,r,r,r", [p, s],
                                                   dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
            else:
                lo, hi = tl.inline_asm_elementwise(_W4S_PTX_FP16, "=r,=r,=r,=r,r,r,r", [p, s],
                                                   dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:
            q = p.to(tl.int32)
            sf = s.to(tl.float32)
            lo = (((q & 0xF).to(tl.float32) - 8.0) * sf).to(x_dtype)
            hi = (((q >> 4).to(tl.float32) - 8.0) * sf).to(x_dtype)
        return lo, hi

    @triton.jit
    def _prefetch_rows(w_ptr, rows, stride_wn, k_lo, k_hi, FMT: tl.constexpr, PIECES: tl.constexpr,
                       LIMIT: tl.constexpr):
        """Before the PDL wait: this program's weights (``rows`` x columns [k_lo, k_hi)) into L2 (pdl.py)."""
        if FMT == 2:  # packed: two weights a byte
            first = k_lo // 2
            n = (k_hi - k_lo) // 2
        else:
            first = k_lo
            n = (k_hi - k_lo) * (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
        prefetch_l2(w_ptr + rows * stride_wn + first, n, PIECES, LIMIT)

    @triton.jit(do_not_specialize=["M", "K_STEPS"])
    def _gemv_kernel(w_ptr, x_ptr, s_ptr, y_ptr, o_ptr, cnt_ptr, M, N, K, K_STEPS,
                     stride_wn, stride_xm, stride_sn, stride_ym, stride_ys, stride_om,
                     FMT: tl.constexpr, EVEN_K: tl.constexpr, PARTIAL: tl.constexpr,
                     MAGIC: tl.constexpr, BIAS: tl.constexpr, PTX: tl.constexpr, FOLD: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr,
                     ACT: tl.constexpr = False):
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        # Rows past N read row N-1 (results dropped at the store): no mask, so loads stay 16 bytes wide.
        rn, rn_safe = _tile_rows(pid_n, N, BLOCK_N, ACT, PARTIAL)
        rm = tl.arange(0, BLOCK_M)
        m_ok = rm < M
        # A split is K_STEPS whole BLOCK_K tiles: k_lo is then a multiple of BLOCK_K that the compiler can
        # see, so the loads stay 16 bytes wide (a split length passed as an unspecialized integer made
        # every load scalar).
        k_lo = pid_s * K_STEPS * BLOCK_K
        k_hi = tl.minimum(K, k_lo + K_STEPS * BLOCK_K)
        pdl_wait(PDL)
        x_dtype = x_ptr.dtype.element_ty
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if FMT == 2 and FOLD:
            # W4A16, scales folded into the weights: a [BLOCK_N, BLOCK_K] tile of (nibble - 8) * scale
            # (one rounding, as a bf16/fp16 weight would carry) and one dot a tile.
            G: tl.constexpr = BLOCK_K // 128
            rg = tl.arange(0, G)
            rj = tl.arange(0, 64)
            p_ptrs = w_ptr + rn_safe[:, None, None] * stride_wn + rg[None, :, None] * 64 + rj[None, None, :]
            s_ptrs = s_ptr + rn_safe[:, None] * stride_sn + rg[None, :]
            rk = tl.arange(0, BLOCK_K)
            x_ptrs = x_ptr + rm[None, :] * stride_xm + rk[:, None]
            for k0 in range(k_lo, k_hi, BLOCK_K):
                p = tl.load(p_ptrs + k0 // 2)
                s = tl.broadcast_to(tl.load(s_ptrs + k0 // 128)[:, :, None], (BLOCK_N, G, 64))
                lo, hi = _dequant_w4_scaled(p, s, x_dtype, PTX)
                w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))
                xt = tl.load(x_ptrs + k0, mask=m_ok[None, :], other=0.0)
                acc = tl.dot(w, xt, acc)
        elif FMT == 2:
            # W4A16: one 128-column scale group per step; the packed tile is 64 bytes wide.
            rj = tl.arange(0, 64)
            re = tl.arange(0, 2)
            x_base = x_ptr + rm[:, None, None] * stride_xm + 2 * rj[None, :, None] + re[None, None, :]
            for kg in range(k_lo, k_hi, 128):
                p = tl.load(w_ptr + rn_safe[:, None] * stride_wn + (kg // 2 + rj)[None, :])
                lo, hi = _dequant_w4(p, x_dtype, MAGIC, BIAS, PTX)
                # x[m, kg + 2j + e] loaded contiguously, then split into the even (e=0) and odd (e=1) columns.
                xt = tl.load(x_base + kg, mask=m_ok[:, None, None], other=0.0)
                xe, xo = tl.split(xt)
                xe = tl.trans(xe)
                xo = tl.trans(xo)
                part = tl.dot(hi, xo, tl.dot(lo, xe))
                s = tl.load(s_ptr + rn_safe * stride_sn + kg // 128).to(tl.float32)
                acc += part * s[:, None]
        else:
            rk = tl.arange(0, BLOCK_K)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                kk = k0 + rk
                w_ptrs = w_ptr + rn_safe[:, None] * stride_wn + kk[None, :]
                x_ptrs = x_ptr + rm[None, :] * stride_xm + kk[:, None]
                if EVEN_K:
                    w = tl.load(w_ptrs)
                    xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
                else:
                    k_ok = kk < k_hi
                    w = tl.load(w_ptrs, mask=k_ok[None, :], other=0)
                    xt = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
                if FMT == 1:
                    w = _dequant_w8(w, x_dtype, PTX)
                acc = tl.dot(w, xt, acc)
            if FMT == 1:
                acc = acc * tl.load(s_ptr + rn_safe * stride_sn).to(tl.float32)[:, None]
        pdl_launch(PDL)
        if ACT:  # [BLOCK_N, BLOCK_M] of (gate, up) row pairs -> [BLOCK_N // 2, BLOCK_M]
            g, u = tl.split(tl.permute(tl.reshape(acc, (BLOCK_N // 2, 2, BLOCK_M)), (0, 2, 1)))
            acc = _silu_mul(g, u, y_ptr.dtype.element_ty)
        y_ptrs = y_ptr + pid_s * stride_ys + rm[None, :] * stride_ym + rn[:, None]
        y_ok = (rn < N)[:, None] & m_ok[None, :]
        if PARTIAL:
            tl.store(y_ptrs, acc, mask=y_ok)
            if last_split(cnt_ptr, pid_n, tl.num_programs(1)):
                _sum_splits(y_ptr, o_ptr, rn, N, M, stride_ys, stride_ym, stride_om, BLOCK_M)
        else:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_ok)

    @triton.jit
    def _tile_rows(pid_n, N, BLOCK_N: tl.constexpr, ACT: tl.constexpr, PARTIAL: tl.constexpr):
        """(the tile's output columns, the rows of W it reads, clamped to the last one): BLOCK_N rows from
        pid_n * BLOCK_N; with ACT, W is [gate; up] (2N rows) and the tile reads BLOCK_N // 2 (gate, up)
        row pairs, n and N + n, interleaved, for outputs pid_n * BLOCK_N // 2 + j."""
        if ACT:
            tl.static_assert(not PARTIAL, "gemv: act= runs without a K split")
            tl.static_assert(BLOCK_N % 2 == 0, "gemv: act= needs an even BLOCK_N")
            i = tl.arange(0, BLOCK_N)
            rows = tl.minimum(pid_n * (BLOCK_N // 2) + i // 2, N - 1) + (i % 2) * N
            return pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2), rows
        else:
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            return rn, tl.minimum(rn, N - 1)

    @triton.jit
    def _silu_mul(g, u, dtype: tl.constexpr):
        # silu(gate) * up of the two sums, each rounded to the output dtype first: what a GEMV into that
        # dtype followed by silu_mul (norm.py, the same formula) computes.
        g = g.to(dtype).to(tl.float32)
        u = u.to(dtype).to(tl.float32)
        return g / (1.0 + tl.exp(-g)) * u

    @triton.jit
    def _x_row(x_ptr, m, stride_xm, offs, ROWS: tl.constexpr):
        # Row m of x as fp32; rows past the real ones (never read) are zeros.
        if m < ROWS:
            return tl.load(x_ptr + m * stride_xm + offs).to(tl.float32)
        else:
            return tl.zeros(offs.shape, dtype=tl.float32)

    @triton.jit
    def _store_row(y_ptr, m, acc, rn, N, stride_ym, stride_ys, pid_s, scale, PARTIAL: tl.constexpr,
                   ROWS: tl.constexpr, ACT: tl.constexpr):
        if m < ROWS:
            total = tl.sum(acc, axis=1) * scale
            if ACT:  # (gate, up) pairs -> one output each
                g, u = tl.split(tl.reshape(total, (total.shape[0] // 2, 2)))
                total = _silu_mul(g, u, y_ptr.dtype.element_ty)
            ptrs = y_ptr + pid_s * stride_ys + m * stride_ym + rn
            if PARTIAL:
                tl.store(ptrs, total, mask=rn < N)
            else:
                tl.store(ptrs, total.to(y_ptr.dtype.element_ty), mask=rn < N)

    @triton.jit
    def _store_rows(y_ptr, a0, a1, a2, a3, a4, a5, a6, a7, rn, N, stride_ym, stride_ys, pid_s, scale,
                    PARTIAL: tl.constexpr, ROWS: tl.constexpr, ACT: tl.constexpr):
        # One accumulator tensor per activation row (a 3-D accumulator makes Triton shuffle layouts).
        _store_row(y_ptr, 0, a0, rn, N, stride_ym, stride_ys, pid_s, scale, PARTIAL, ROWS, ACT)
        _store_row(y_ptr, 1, a1, rn, N, stride_ym, stride_ys, pid_s, scale, PARTIAL, ROWS, ACT)
        _store_row(y_ptr, 2, a2, rn, N, stride_ym, stride_ys, pid_s, scale, PARTIAL, ROWS, ACT)
        _store_row(y_ptr, 3, a3, rn, N, stride_ym, stride_ys, pid_s, scale, PARTIAL, ROWS, ACT)
        _store_row(y_ptr, 4, a4, rn, N, stride_ym, stride_ys, pid_s, scale, PARTIAL, ROWS, ACT)
        _store_row(y_ptr, 5, a5, rn, N, stride_ym, stride_ys, pid_s, scale, PARTIAL, ROWS, ACT)
        _store_row(y_ptr, 6, a6, rn, N, stride_ym, stride_ys, pid_s, scale, PARTIAL, ROWS, ACT)
        _store_row(y_ptr, 7, a7, rn, N, stride_ym, stride_ys, pid_s, scale, PARTIAL, ROWS, ACT)

    @triton.jit(do_not_specialize=["K_STEPS"])
    def _gemv_fma_kernel(w_ptr, x_ptr, s_ptr, y_ptr, o_ptr, cnt_ptr, N, K, K_STEPS,
                         stride_wn, stride_xm, stride_sn, stride_ym, stride_ys, stride_om,
                         FMT: tl.constexpr, EVEN_K: tl.constexpr, PARTIAL: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                         ACT: tl.constexpr = False):
        # CUDA-core path for dense and W8A16 weights: one [BLOCK_N, BLOCK_K] fp32 accumulator per
        # activation row (ROWS <= 8, unrolled by hand), reduced once at the end. Small tiles keep many
        # programs, and their loads, in flight per SM.
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        rn, rn_safe = _tile_rows(pid_n, N, BLOCK_N, ACT, PARTIAL)  # past N: row N-1 again, loads stay wide
        # A split is K_STEPS whole BLOCK_K tiles: k_lo is then a multiple of BLOCK_K that the compiler can
        # see, so the loads stay 16 bytes wide (a split length passed as an unspecialized integer made
        # every load scalar).
        k_lo = pid_s * K_STEPS * BLOCK_K
        k_hi = tl.minimum(K, k_lo + K_STEPS * BLOCK_K)
        pdl_wait(PDL)
        a0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        a1 = a0
        a2 = a0
        a3 = a0
        a4 = a0
        a5 = a0
        a6 = a0
        a7 = a0
        rk = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + rn_safe[:, None] * stride_wn
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kk = k0 + rk
            if EVEN_K:
                w = tl.load(w_rows + kk[None, :])
            else:
                w = tl.load(w_rows + kk[None, :], mask=(kk < k_hi)[None, :], other=0)
                # Tail: masked columns load as 0 and their x is never read past K (index clamped).
                kk = tl.minimum(kk, K - 1)
            if FMT == 1:
                wf = _q8_float(w.to(tl.uint8, bitcast=True).to(tl.int32) ^ 0x80)
                if not EVEN_K:
                    wf = tl.where((k0 + rk < k_hi)[None, :], wf, 0.0)
            else:
                wf = w.to(tl.float32)
            a0 += wf * _x_row(x_ptr, 0, stride_xm, kk, ROWS)[None, :]
            if ROWS > 1:
                a1 += wf * _x_row(x_ptr, 1, stride_xm, kk, ROWS)[None, :]
            if ROWS > 2:
                a2 += wf * _x_row(x_ptr, 2, stride_xm, kk, ROWS)[None, :]
                a3 += wf * _x_row(x_ptr, 3, stride_xm, kk, ROWS)[None, :]
            if ROWS > 4:
                a4 += wf * _x_row(x_ptr, 4, stride_xm, kk, ROWS)[None, :]
                a5 += wf * _x_row(x_ptr, 5, stride_xm, kk, ROWS)[None, :]
                a6 += wf * _x_row(x_ptr, 6, stride_xm, kk, ROWS)[None, :]
                a7 += wf * _x_row(x_ptr, 7, stride_xm, kk, ROWS)[None, :]
        pdl_launch(PDL)
        if FMT == 1:
            scale = tl.load(s_ptr + rn_safe * stride_sn).to(tl.float32)
        else:
            scale = 1.0
        _store_rows(y_ptr, a0, a1, a2, a3, a4, a5, a6, a7, rn, N, stride_ym, stride_ys, pid_s, scale, PARTIAL,
                    ROWS, ACT)
        if PARTIAL:
            if last_split(cnt_ptr, pid_n, tl.num_programs(1)):
                _sum_splits(y_ptr, o_ptr, rn, N, ROWS, stride_ys, stride_ym, stride_om, 8)

    @triton.jit
    def _w4_words_row(acc, m: tl.constexpr, w, s, x_ptr, stride_xm, offs, ROWS: tl.constexpr):
        """acc [BLOCK_N, T] += scale * sum((nibble - 8) * x) over each thread's word (8 weights), row m of x.

        ``w`` holds the nibbles of each word as floats ``1 + n/256`` (low) and ``1 + n/16`` (high); with e/o
        the even/odd-k activations and o' = o/16: sum (n - 8) x = 256 * sum(w_lo e + w_hi o')
        - (264 sum e + 384 sum o'). A word's 8 activations are one 16-byte load by the thread that has the
        word (no exchange between threads)."""
        if m < ROWS:
            xt = tl.load(x_ptr + m * stride_xm + offs).to(tl.float32)  # [T, 8]: the word's activations
            e, o = tl.split(tl.reshape(xt, (xt.shape[0], 4, 2)))  # [T, 4]: byte b's even / odd k
            o = o * 0.0625
            e02, e13 = tl.split(tl.reshape(e, (e.shape[0], 2, 2)))
            o02, o13 = tl.split(tl.reshape(o, (o.shape[0], 2, 2)))
            e0, e2 = tl.split(e02)
            e1, e3 = tl.split(e13)
            o0, o2 = tl.split(o02)
            o1, o3 = tl.split(o13)
            l0, h0, l1, h1, l2, h2, l3, h3 = w
            t = l0 * e0[None, :]
            t += h0 * o0[None, :]
            t += l1 * e1[None, :]
            t += h1 * o1[None, :]
            t += l2 * e2[None, :]
            t += h2 * o2[None, :]
            t += l3 * e3[None, :]
            t += h3 * o3[None, :]
            c = 264.0 * (e0 + e1 + e2 + e3) + 384.0 * (o0 + o1 + o2 + o3)  # [T]
            return acc + s * (256.0 * t - c[None, :])
        else:
            return acc

    # Byte b of a word shifted to bits 15-22 puts its low nibble in mantissa bits 15-18 and its high
    # nibble in bits 19-22; one lop3 ((a & mask) | 1.0f) each gives 1 + n/256 and 1 + n/16, exactly.
    _W4_WORD_PTX = tl.constexpr("""{
        .reg .b32 c, b0, b1, b2, b3;
        mov.b32 c, 0x3F800000;
        shl.b32 b0, $8, 15;
        shl.b32 b1, $8, 7;
        shr.u32 b2, $8, 1;
        shr.u32 b3, $8, 9;
        lop3.b32 $0, b0, 0x00078000, c, 0xEA;
        lop3.b32 $1, b0, 0x00780000, c, 0xEA;
        lop3.b32 $2, b1, 0x00078000, c, 0xEA;
        lop3.b32 $3, b1, 0x00780000, c, 0xEA;
        lop3.b32 $4, b2, 0x00078000, c, 0xEA;
        lop3.b32 $5, b2, 0x00780000, c, 0xEA;
        lop3.b32 $6, b3, 0x00078000, c, 0xEA;
        lop3.b32 $7, b3, 0x00780000, c, 0xEA;
    }""")

    @triton.jit
    def _w4_word_floats(p, PTX: tl.constexpr):
        """int32 words of packed W4 -> the 8 nibble floats (low, high of bytes 0..3): 1 + n/256, 1 + n/16."""
        if PTX:
            return tl.inline_asm_elementwise(_W4_WORD_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [p],
                                             dtype=(tl.float32,) * 8, is_pure=True, pack=1)
        else:
            u = p.to(tl.uint32, bitcast=True)
            b0 = u << 15
            b1 = u << 7
            b2 = u >> 1
            b3 = u >> 9
            return (_mantissa_float(b0, 0x78000), _mantissa_float(b0, 0x780000),
                    _mantissa_float(b1, 0x78000), _mantissa_float(b1, 0x780000),
                    _mantissa_float(b2, 0x78000), _mantissa_float(b2, 0x780000),
                    _mantissa_float(b3, 0x78000), _mantissa_float(b3, 0x780000))

    # W8: flip the sign bits (q + 128 in each byte), prmt each byte under the fp32 2^23, subtract 2^23 + 128:
    # q exactly, 2.25 instructions a weight.
    _W8_WORD_PTX = tl.constexpr("""{
        .reg .b32 v, m;
        xor.b32 v, $4, 0x80808080;
        mov.b32 m, 0x4B000000;
        prmt.b32 $0, v, m, 0x7440;
        prmt.b32 $1, v, m, 0x7441;
        prmt.b32 $2, v, m, 0x7442;
        prmt.b32 $3, v, m, 0x7443;
        sub.f32 $0, $0, 0f4B000080;
        sub.f32 $1, $1, 0f4B000080;
        sub.f32 $2, $2, 0f4B000080;
        sub.f32 $3, $3, 0f4B000080;
    }""")

    @triton.jit
    def _w8_word_floats(p, PTX: tl.constexpr):
        """int32 words of 4 int8 weights -> the 4 weights (bytes 0..3) as exact floats."""
        if PTX:
            return tl.inline_asm_elementwise(_W8_WORD_PTX, "=r,=r,=r,=r,r", [p], dtype=(tl.float32,) * 4,
                                             is_pure=True, pack=1)
        else:
            u = p.to(tl.uint32, bitcast=True) ^ 0x80808080
            return _q8_float(u & 0xFF), _q8_float((u >> 8) & 0xFF), _q8_float((u >> 16) & 0xFF), _q8_float(u >> 24)

    @triton.jit
    def _w8_words_row(acc, m: tl.constexpr, w, x_ptr, stride_xm, offs, ROWS: tl.constexpr):
        """acc [BLOCK_N, T] += sum(q * x) over each thread's word (4 weights), row m of x."""
        if m < ROWS:
            xt = tl.load(x_ptr + m * stride_xm + offs).to(tl.float32)  # [T, 4]: the word's activations
            x02, x13 = tl.split(tl.reshape(xt, (xt.shape[0], 2, 2)))  # byte b = 2i + j: split on j
            x0, x2 = tl.split(x02)
            x1, x3 = tl.split(x13)
            f0, f1, f2, f3 = w
            t = f0 * x0[None, :]
            t += f1 * x1[None, :]
            t += f2 * x2[None, :]
            t += f3 * x3[None, :]
            return acc + t
        else:
            return acc

    @triton.jit
    def _words_row(acc, m: tl.constexpr, w, s, x_ptr, stride_xm, offs, FMT: tl.constexpr, ROWS: tl.constexpr):
        if FMT == 2:
            return _w4_words_row(acc, m, w, s, x_ptr, stride_xm, offs, ROWS)
        else:
            return _w8_words_row(acc, m, w, x_ptr, stride_xm, offs, ROWS)

    @triton.jit(do_not_specialize=["K_STEPS", "WORDS_N"])
    def _gemv_words_kernel(w_ptr, x_ptr, s_ptr, y_ptr, o_ptr, cnt_ptr, N, K, K_STEPS, WORDS_N,
                           stride_xm, stride_sn, stride_ym, stride_ys, stride_om,
                           FMT: tl.constexpr, PARTIAL: tl.constexpr, ROWS: tl.constexpr, PTX: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                           ACT: tl.constexpr = False, PREFETCH: tl.constexpr = 0, PIECES: tl.constexpr = 1,
                           LIMIT: tl.constexpr = 0):
        # Quantized weights on CUDA cores, read as 32-bit words (4 int8 or 8 uint4 weights): one word of
        # a row a thread a step, BLOCK_N rows a program, so a word's activations (one 8- or 16-byte load)
        # serve BLOCK_N rows. WORDS_N (the row stride in words) is not specialized: unable to prove 16-byte
        # alignment, the compiler keeps one word a thread, the layout of the word's activations, so
        # nothing is exchanged through shared memory (wider weight loads would need that every step).
        # W4: a nibble ANDed into the mantissa of the float 1.0 is exactly 1 + n/256 (or 1 + n/16), one
        # lop3 a weight plus a shift a byte; the constant parts go once per word with its activation
        # sums (_w4_words_row). W8: prmt under 2^23 and one subtraction (_w8_word_floats).
        # No K masks: BLOCK_K is a multiple of 128 and K a whole number of tiles (_gemv_triton sees to it).
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        PER: tl.constexpr = 8 if FMT == 2 else 4  # weights a word
        T: tl.constexpr = BLOCK_K // PER
        rn, rn_safe = _tile_rows(pid_n, N, BLOCK_N, ACT, PARTIAL)
        k_lo = pid_s * K_STEPS * BLOCK_K
        k_hi = tl.minimum(K, k_lo + K_STEPS * BLOCK_K)
        if PREFETCH:
            if pid_n + pid_s * tl.num_programs(0) < PREFETCH:  # the first PREFETCH programs
                _prefetch_rows(w_ptr, rn_safe, WORDS_N * 4, k_lo, k_hi, FMT, PIECES, LIMIT)
        pdl_wait(PDL)
        rt = tl.arange(0, T)
        w_ptrs = w_ptr.to(tl.pointer_type(tl.int32)) + rn_safe[:, None] * WORDS_N + rt[None, :]
        s_ptrs = s_ptr + rn_safe[:, None] * stride_sn + (rt // 16)[None, :]  # W4: the word's scale group
        x_offs = rt[:, None] * PER + tl.arange(0, PER)[None, :]
        a0 = tl.zeros((BLOCK_N, T), dtype=tl.float32)
        a1 = a0
        a2 = a0
        a3 = a0
        a4 = a0
        a5 = a0
        a6 = a0
        a7 = a0
        for k0 in range(k_lo, k_hi, BLOCK_K):
            p = tl.load(w_ptrs + k0 // PER)
            if FMT == 2:
                s = tl.load(s_ptrs + k0 // 128).to(tl.float32)
                w = _w4_word_floats(p, PTX)
            else:
                s = 1.0
                w = _w8_word_floats(p, PTX)
            xo = x_offs + k0
            a0 = _words_row(a0, 0, w, s, x_ptr, stride_xm, xo, FMT, ROWS)
            a1 = _words_row(a1, 1, w, s, x_ptr, stride_xm, xo, FMT, ROWS)
            a2 = _words_row(a2, 2, w, s, x_ptr, stride_xm, xo, FMT, ROWS)
            a3 = _words_row(a3, 3, w, s, x_ptr, stride_xm, xo, FMT, ROWS)
            a4 = _words_row(a4, 4, w, s, x_ptr, stride_xm, xo, FMT, ROWS)
            a5 = _words_row(a5, 5, w, s, x_ptr, stride_xm, xo, FMT, ROWS)
            a6 = _words_row(a6, 6, w, s, x_ptr, stride_xm, xo, FMT, ROWS)
            a7 = _words_row(a7, 7, w, s, x_ptr, stride_xm, xo, FMT, ROWS)
        pdl_launch(PDL)
        if FMT == 2:
            scale = 1.0
        else:
            scale = tl.load(s_ptr + rn_safe * stride_sn).to(tl.float32)
        _store_rows(y_ptr, a0, a1, a2, a3, a4, a5, a6, a7, rn, N, stride_ym, stride_ys, pid_s, scale, PARTIAL,
                    ROWS, ACT)
        if PARTIAL:
            if last_split(cnt_ptr, pid_n, tl.num_programs(1)):
                _sum_splits(y_ptr, o_ptr, rn, N, ROWS, stride_ys, stride_ym, stride_om, 8)

    @triton.jit
    def _sum_splits(part_ptr, o_ptr, rn, N, rows, stride_ps, stride_pm, stride_om, RB: tl.constexpr):
        # The last split of a BLOCK_N-row tile: the splits' float32 partials [rows, rn] added in split order.
        rm = tl.arange(0, RB)
        ok = (rm < rows)[:, None] & (rn < N)[None, :]
        offs = rm[:, None] * stride_pm + rn[None, :]
        splits = tl.num_programs(1)
        total = tl.zeros((RB, rn.shape[0]), tl.float32)
        for s0 in range(0, splits, 4):  # four independent loads a step (one a step waits an L2 round trip each)
            for j in tl.static_range(4):
                total += tl.load(part_ptr + (s0 + j) * stride_ps + offs, mask=ok & (s0 + j < splits), other=0.0,
                                 cache_modifier=".cg")
        tl.store(o_ptr + rm[:, None] * stride_om + rn[None, :], total.to(o_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _splitk_sum_kernel(part_ptr, y_ptr, MN, N, stride_ym, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                           PDL: tl.constexpr):
        # The tensor-core (Gluon) kernel's K split: its partial sums added by a second launch.
        pdl_wait(PDL)  # the partial sums are the previous kernel's output
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < MN
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            total += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
        # y's rows may be apart (out= a block of a wider buffer); the partial sums are contiguous.
        tl.store(y_ptr + offs // N * stride_ym + offs % N, total.to(y_ptr.dtype.element_ty), mask=ok)


# -- host side ------------------------------------------------------------------------------------

def split_k(N: int, K: int, block_n: int, block_k: int, sms: int, num_warps: int = 4) -> int:
    """The smallest power-of-two K split giving 8 warps a multiprocessor while each split keeps at least
    4 tiles of K (a split's partial sums cost one more pass over [split, M, N] floats)."""
    programs, split = -(-N // block_n), 1
    while programs * split * num_warps < 8 * sms and K // (block_k * split) >= 4:
        split *= 2
    return split


@functools.lru_cache(maxsize=1024)
def _default_config(M: int, N: int, K: int, fmt: str, sms: int, ptx: bool) -> tuple:
    """:func:`_gemv_config` remembered (items: the callers pop from their own dict copy)."""
    return tuple(_gemv_config(M, N, K, fmt, sms, ptx).items())


def _gemv_config(M: int, N: int, K: int, fmt: str, sms: int, ptx: bool) -> dict:
    """Kernel, tile and split for W [N, K] and M activation rows: the tiles fastest across the four shapes
    of the H200 sweeps (benchmarks/results/h200-kernels, runs 5 and 6).

    "fma" (CUDA cores, dense and W8A16 tiles) and "words" (CUDA cores, quantized weights read as 32-bit
    words, one-warp programs) stream W with many resident programs; "mma" (tensor cores, activations
    padded to 16 rows) keeps the multiply off the ALUs, which pays once FMAs would bound the kernel
    (5-8 rows). A K split (split_k) is finished in the same launch (split.py); the tc kernel's adds a
    second one.
    """
    if ptx and TC_AVAILABLE and (fmt == "w4a16t" or fmt in ("w8a16", "w4a16") and (M > 4 or N >= 8192 or
                                                                                   fmt == "w4a16" and K <= N)):
        # Quantized weights on the tensor cores with the operands loaded into the mma fragments (gemv_tc):
        # fastest at 5-8 rows on every shape, at 1 row from 8192 rows up, and for W4A16 at 1 row on
        # 4096x4096 too (runs 12, 13; the word kernel stays ahead where K is long against N).
        return dict(KERNEL="tc", **tc_config(M, N, K, fmt, sms))
    if M <= 4:
        if fmt == "w4a16":
            cfg = dict(KERNEL="words", BLOCK_N=8, BLOCK_K=512, num_warps=1, num_stages=1)
        elif fmt == "w8a16" and N * K >= 1 << 28:
            cfg = dict(KERNEL="words", BLOCK_N=16, BLOCK_K=1024, num_warps=2, num_stages=1)
        else:
            # Warps side by side along K (BLOCK_K = warps x one 16-byte load a thread): each thread's slice
            # of x is its own, so x needs no shuffle between warps.
            block_n = 4 if fmt == "w8a16" else 2
            cfg = dict(KERNEL="fma", BLOCK_N=block_n, BLOCK_K=1024, num_warps=4, num_stages=3)
    elif fmt == "w4a16":
        if N >= 8192:
            cfg = dict(KERNEL="mma", BLOCK_N=128, BLOCK_K=512, num_warps=4, num_stages=1 if ptx else 3)
        else:  # fewer rows: the scales folded into the tile, one dot a 512-column tile
            cfg = dict(KERNEL="mma", BLOCK_N=64, BLOCK_K=512, num_warps=4, num_stages=3, FOLD=True)
    elif fmt == "w8a16":
        cfg = dict(KERNEL="mma", BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    else:
        cfg = dict(KERNEL="mma", BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3)
    cfg["SPLIT_K"] = split_k(N, K, cfg["BLOCK_N"], cfg["BLOCK_K"], sms, cfg["num_warps"])
    return cfg


def pdl_mode(pdl: str, N: int) -> int:
    """The kernels' PDL constexpr for a launch over ``N`` rows of W with ``pdl`` option ``pdl`` ("auto", "off",
    "early", "late"). "auto": the H200 sweep (benchmarks/results/h200-kernels run 15): the next GEMV's programs placed
    early gain where a grid is about one wave (4096 rows: 2-10%) but crowd larger ones (14336 rows: up to 20% slower,
    where a late go gains 0-5%); from 128256 rows either is within 1-3%. So early up to ``PDL_EARLY_MAX_ROWS``."""
    if pdl == "auto":
        pdl = "early" if N <= PDL_EARLY_MAX_ROWS else "late"
    return PDL_MODES[False if pdl == "off" else pdl]


def aligned16(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy where its address is off 16 bytes (the CUDA C++ kernel's 16-byte loads)."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


class _GemvLaunch:
    """How one gemv path launches, worked out from the shapes and strides alone (no addresses): the kernel
    and its tiles (``config`` or the tuned table, checked), the grid, the integer arguments and options,
    the K split (and, for the tc kernel, its sum kernel's launch), and (``remembered``: a call of ``_PATHS``,
    whose key fixes every argument's class) a launcher slot for each kernel."""

    __slots__ = ("fn", "grid", "ints", "kwargs", "split", "shape", "sum", "slots", "tiles", "tc", "unfused", "cu")

    def __init__(self, w, x, scales, fmt: str, cfg: dict | None, ptx: bool, pdl: str, out, remembered: bool,
                 act: bool = False):
        M, K = x.shape
        N = w.shape[0]  # rows of W; with act, [gate; up]: N // 2 outputs
        self.shape = (M, N // 2 if act else N)  # (int8 weights go to the kernels as they are: raw bits)
        if fmt == "w4a16t" and not _tiles_in_place(ptx):
            fmt = "w4a16"  # the other kernels read a row-layout copy (_gemv_run)
        pdl = pdl_mode(pdl, N)
        sms = sm_count(x.device)
        given = cfg
        cfg = dict(cfg or _default_config(M, N, K, fmt, sms, ptx))  # popped below: a copy
        if act and given is None and fmt == "w4a16t" and M <= 4 and TC_ACT_FUSED:
            cfg.update(TC_ACT_TILES)
        if given is None and fmt == "w4a16t" and CU_W4 and cu_available(x.device) and not (act and N % 32):
            try:
                self._cu_plan(w, x, scales, fmt, dict(KERNEL="cu", **cu_config(M, N, K, act)), ptx, pdl, out, act)
                return
            except (RuntimeError, OSError) as exc:  # NVRTC or the driver could not build it: the kernel below
                warnings.warn(f"gemv: the CUDA C++ W4A16 kernel (gemv.CU_W4) could not be built on {x.device}, the "
                              f"tensor-core kernel runs instead: {str(exc)[:300]}", RuntimeWarning, stacklevel=2)
        kernel = cfg.get("KERNEL", "mma")
        if kernel not in ("fma", "mma", "words", "tc", "cu"):
            raise ValueError(f"gemv: config KERNEL={kernel!r} must be 'fma', 'words', 'mma', 'tc' or 'cu'")
        self.cu = None
        if kernel == "cu":
            self._cu_plan(w, x, scales, fmt, cfg, ptx, pdl, out, act)
            return
        missing = [k for k in ("BLOCK_N", "BLOCK_K", "SPLIT_K") if kernel != "tc" and k not in cfg]
        if missing:  # (a KeyError from the launch before)
            raise ValueError(f"gemv: config {given!r} lacks {', '.join(missing)}: KERNEL={kernel!r} takes BLOCK_N, "
                             f"BLOCK_K and SPLIT_K (num_warps, num_stages optional)")
        if kernel == "words" and fmt not in ("w8a16", "w4a16"):
            raise ValueError(f"gemv: config KERNEL='words' is for quantized weights, got fmt={fmt!r}")
        if kernel == "fma" and fmt == "w4a16":
            raise ValueError("gemv: config KERNEL='fma' takes dense and w8a16 weights; w4a16 runs on 'words' or 'mma'")
        if kernel == "words" and cfg["BLOCK_K"] % 128:
            raise ValueError(f"gemv: BLOCK_K={cfg['BLOCK_K']} must be a multiple of 128 for KERNEL='words'")
        if kernel == "words" and (w.stride(0) % 4 or (fmt == "w8a16" and K % cfg["BLOCK_K"])):
            # The word kernel reads whole 32-bit words and has no K masks: a W8A16 K that is not whole tiles
            # goes to the byte kernel (same tiles), a row stride off 4 bytes to the tensor-core kernel.
            cfg = dict(cfg, KERNEL="fma") if fmt == "w8a16" and w.stride(0) % 4 == 0 else \
                _gemv_config(MAX_ROWS, N, K, fmt, sms, ptx)
            kernel = cfg["KERNEL"]
        if kernel == "tc" and not ptx:
            raise ValueError("gemv: config KERNEL='tc' (Gluon, inline PTX) runs with impl='cuda' only")
        if kernel != "tc" and fmt == "w4a16t":
            raise ValueError(f"gemv: fmt='w4a16t' runs on KERNEL='tc' (impl='cuda'), not config KERNEL={kernel!r}")
        if kernel != "tc" and fmt == "w4a16" and cfg["BLOCK_K"] % W4_GROUP:
            raise ValueError(f"gemv: BLOCK_K={cfg['BLOCK_K']} must be a multiple of {W4_GROUP} for w4a16")
        if kernel == "tc":
            cfg = {**tc_config(M, N, K, fmt, sms, cfg.get("ROW_TILES"), cfg.get("num_warps"), cfg.get("UNROLL")),
                   **cfg, "PDL": pdl}
            cfg.pop("KERNEL")
        # act on the tensor-core kernel unless TC_ACT_FUSED and its tiles pair (gate, up) rows (tc_fuses_act): its
        # [M, N] into a temporary, then silu_mul (two launches).
        self.unfused = act and kernel == "tc" and not (TC_ACT_FUSED and tc_fuses_act(cfg, N, fmt == "w4a16t"))
        if act and kernel != "tc" and cfg["BLOCK_N"] % 2:
            raise ValueError(f"gemv: act='silu_mul' needs an even BLOCK_N (it takes (gate, up) row pairs), "
                             f"got config BLOCK_N={cfg['BLOCK_N']}")
        # y's row stride: out's, else a new contiguous one's (the unfused act's temporary: [M, N])
        y_stride = N if self.unfused else out.stride(0) if out is not None else self.shape[1]
        if kernel == "tc":
            self.fn, self.grid, self.ints, self.kwargs, self.split = tc_launch_args(
                w, x, scales, _FMT_CODE[fmt], cfg, y_stride, fmt == "w4a16t", act and not self.unfused)
        else:
            self._triton(w, x, scales, fmt, cfg, ptx, pdl, y_stride, act)
        self.sum, self.tiles, self.tc = None, 0, kernel == "tc"
        if not self.tc:
            # The Triton kernels finish a K split in the same launch (split.py): the last split of each tile
            # adds the partials; the tile counters and partials come from SCRATCH at each call.
            self.tiles = self.grid[0] if self.split > 1 else 0
        elif self.split > 1:
            block = 1024
            self.sum = ((cdiv(M * N, block),), (M * N, N, y_stride),
                        dict(SPLIT=self.split, BLOCK=block, PDL=pdl, num_warps=4, launch_pdl=pdl > 0))
        self.slots = (Slot(self.fn), Slot(_splitk_sum_kernel)) if remembered else None

    def _cu_plan(self, w, x, scales, fmt, cfg, ptx, pdl, out, act):
        """The CUDA C++ kernel's launch (gemv_cu): tiled W4A16 only, impl="cuda", one launch (act in it)."""
        if fmt != "w4a16t" or not ptx:
            raise ValueError(f"gemv: config KERNEL='cu' takes fmt='w4a16t' with impl='cuda', got fmt={fmt!r}"
                             f"{'' if ptx else ' and impl triton'}")
        if not cu_available(x.device):
            raise ValueError(f"gemv: config KERNEL='cu' needs torch.cuda._compile_kernel (NVRTC) and a CUDA GPU of "
                             f"compute capability >= 8.0, got device {x.device}")
        M, K = x.shape
        N = w.shape[0]
        if act and N % 32:
            raise ValueError(f"gemv: config KERNEL='cu' with act='silu_mul' takes the gate and up halves in whole "
                             f"16-row tiles (N a multiple of 32), got N={N}")
        cfg = check_cu_config({k: v for k, v in cfg.items() if k != "KERNEL"}, M, N, K, act)
        ldy = out.stride(0) if out is not None else self.shape[1]
        launch = CuLaunch(x.device, N, K, M, cfg, act, x.dtype == torch.float16, pdl, ldy, scales.stride(0),
                          prefetch_bytes(pdl, x.device, gemv=True))  # (compiled first: a failure leaves self as it was)
        self.fn = self.grid = self.ints = self.kwargs = self.sum = self.slots = None
        self.split, self.tiles, self.tc, self.unfused = 1, 0, False, False
        self.cu = launch

    def _triton(self, w, x, scales, fmt, cfg, ptx, pdl, y_stride, act):
        """The Triton kernels' launch (``cfg`` checked, a copy); ``act``: silu_mul of row pairs, unsplit."""
        M, K = x.shape
        N = w.shape[0] // 2 if act else w.shape[0]  # outputs
        kernel = cfg.pop("KERNEL", "mma")
        block_k, split = cfg.pop("BLOCK_K"), cfg.pop("SPLIT_K")
        if act:
            split = 1  # the pairs are combined at the store: no partial sums
        k_blocks = -(-K // block_k)
        split = max(1, min(split, k_blocks))
        per_split = -(-k_blocks // split) * block_k
        split = -(-K // per_split)
        even_k = K % block_k == 0 and per_split % block_k == 0
        if fmt == "w4a16" and not even_k:
            # Groups are whole 128-column blocks, so a tile may run past K only by whole groups: shrink it.
            block_k = W4_GROUP
            per_split = -(-K // (split * W4_GROUP)) * W4_GROUP
            split = -(-K // per_split)
            even_k = True
        self.split = split
        x_stride = x.stride(0) if x.is_contiguous() else K  # the kernels read x.contiguous()
        stride_sn = scales.stride(0) if scales is not None else 0
        strides = (w.stride(0), x_stride, stride_sn, N if split > 1 else y_stride, M * N if split > 1 else 0,
                   y_stride)
        steps = per_split // block_k
        self.grid = (cdiv(N, cfg["BLOCK_N"] // 2 if act else cfg["BLOCK_N"]), split)
        common = dict(FMT=_FMT_CODE[fmt], PARTIAL=split > 1, PDL=pdl, launch_pdl=pdl > 0)
        if act:
            common["ACT"] = True
        if kernel == "words":
            cfg.pop("FOLD", None)
            self.fn = _gemv_words_kernel
            self.ints = (N, K, steps, w.stride(0) // 4, *strides[1:])
            self.kwargs = dict(common, ROWS=M, PTX=ptx, BLOCK_K=block_k, **cfg)
            # The first programs' weights into L2 before the PDL wait, a piece a thread (H200, prefetch_ab.py:
            # the W4A16 step 5% faster with this and the tc kernel's; the dense fma kernel lost 10-15% with it,
            # so it and the mma kernel do without).
            row_bytes = per_split * w.element_size() // (2 if fmt == "w4a16" else 1)
            self.kwargs.update(prefetch_args(pdl, x.device, cfg["BLOCK_N"], row_bytes, cfg["num_warps"], gemv=True))
        elif kernel == "fma":
            cfg.pop("FOLD", None)
            self.fn = _gemv_fma_kernel
            self.ints = (N, K, steps, *strides)
            self.kwargs = dict(common, EVEN_K=even_k, ROWS=M, BLOCK_K=block_k, **cfg)
        else:
            cfg.setdefault("FOLD", False)
            if x.dtype == torch.bfloat16:
                magic, bias = 0x4300, 136.0  # bf16 0x4300 = 128.0, mantissa step 1 up to 256
            else:
                magic, bias = 0x6400, 1032.0  # fp16 0x6400 = 1024.0, mantissa step 1 up to 2048
            self.fn = _gemv_kernel
            self.ints = (M, N, K, steps, *strides)
            self.kwargs = dict(common, EVEN_K=even_k, MAGIC=magic, BIAS=bias, PTX=ptx, BLOCK_K=block_k, BLOCK_M=16,
                               **cfg)

    def __call__(self, w, x, scales, out) -> torch.Tensor:
        M, N = self.shape
        y = x.new_empty(self.shape) if out is None else out
        if M == 0 or N == 0:
            return y
        if x.shape[1] == 0:
            return y.zero_()  # (silu(0) * 0 = 0 too)
        x = x.contiguous()
        if self.cu is not None:
            # (its 16-byte loads: a view of W or x off 16 bytes is read from an aligned copy)
            return self.cu(aligned16(w), aligned16(x), scales, y)
        if self.unfused:
            full = x.new_empty((M, w.shape[0]))
            self._tc(w, x, scales, full)
            return silu_mul(full, impl="triton", out=y)
        if self.tc:
            return self._tc(w, x, scales, y)
        s = scales if scales is not None else w  # unused by the dense kernels; any pointer does
        # (w, x, scales, partials or y, y, tile counters): unsplit, y stands for the last two
        counters, dst = SCRATCH.get(x.device, self.tiles, self.split * M * N) if self.tiles else (y, y)
        launch_plan(self.slots[0] if self.slots else None, self.fn, self.grid, (w, x, s, dst, y, counters, *self.ints),
                    self.kwargs)
        return y

    def _tc(self, w, x, scales, y) -> torch.Tensor:
        """The tensor-core kernel's launch into y ([M, rows of W]), and its sum launch where K is split."""
        main, summed = self.slots or (None, None)
        M, N = y.shape
        s = scales if scales is not None else w
        dst = x.new_empty((self.split, M, N), dtype=torch.float32) if self.split > 1 else y
        launch_plan(main, self.fn, self.grid, (w, x, s, dst, *self.ints), self.kwargs)
        if self.sum is not None:
            grid, ints, kwargs = self.sum
            launch_plan(summed, _splitk_sum_kernel, grid, (dst, y, *ints), kwargs)
        return y


def _gemv_run(w, x, scales, fmt: str, impl: str, pdl: str, out=None, cfg: dict | None = None,
              plan=None, act: str | None = None) -> torch.Tensor:
    """The eager call (also the custom op's body): ``out`` checked against the inputs, then the launch
    (``plan``: the remembered path's :class:`_GemvLaunch`, else one worked out for this call)."""
    if out is not None:
        check_no_overlap("gemv", out, w=w, x=x, scales=scales)
    if fmt == "w4a16t" and not _tiles_in_place(impl == "cuda"):
        w, fmt = untile_w4a16(w), "w4a16"
    if impl == "reference":
        y = reference_gemv(w, x, scales, fmt)
        y = reference_silu_mul(y) if act else y
        return y if out is None else out.copy_(y)
    if plan is None:
        plan = _GemvLaunch(w, x, scales, fmt, cfg, impl == "cuda", pdl, out, False, act is not None)
    return plan(w, x, scales, out)


@torch.library.custom_op("xelink::gemv", mutates_args=("out",))
def _gemv_op(w: torch.Tensor, x: torch.Tensor, scales: torch.Tensor | None, fmt: str, impl: str, pdl: str,
             act: str | None, out: torch.Tensor) -> None:
    _gemv_run(w, x, scales, fmt, impl, pdl, out, act=act)


@_gemv_op.register_fake
def _gemv_fake(w, x, scales, fmt, impl, pdl, act, out):
    return None


def _pdl_alias(pdl, config):
    """``config["PDL"]`` is the old spelling of ``pdl``: (pdl, config without it, the name the value came
    by, for errors); both given must agree."""
    if not config or "PDL" not in config:
        return pdl, config, "pdl"
    alias = config["PDL"]
    if pdl is not None and (pdl != alias or type(pdl) is not type(alias)):
        raise ValueError(f"gemv: pdl={pdl!r} and config['PDL']={alias!r} differ; pass one (config['PDL'] is the "
                         "old spelling of pdl)")
    return alias, {k: v for k, v in config.items() if k != "PDL"} or None, "config['PDL']"


def _check_gemv(w, x, scales, fmt, impl, out, pdl, config, act=None, *, fn="gemv", formats=GEMV_FORMATS,
                impls=GEMV_IMPLS, max_rows=MAX_ROWS):
    """Every check before a launch; returns (impl resolved, x as [M, K], out as [M, N] or None, pdl option,
    config without its PDL key). ``fn``, ``formats``, ``impls``, ``max_rows`` (None: any): the caller's
    (``qgemm`` shares the checks)."""
    impl = check_impl(fn, impl, impls)
    if not isinstance(fmt, str) or fmt not in formats:
        raise ValueError(f"{fn}: fmt={fmt!r} is not one of {', '.join(formats)}")
    if act is not None and act not in GEMV_ACTS:
        raise ValueError(f"{fn}: act={act!r} is not None or one of {', '.join(GEMV_ACTS)}")
    check_tensor(fn, "w", w)
    check_tensor(fn, "x", x)
    impl = forward_only(fn, impl, w=w, x=x, scales=scales)
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"{fn}: x.dtype={x.dtype} must be torch.bfloat16 or torch.float16")
    one_row = x.dim() == 1
    if one_row:
        x = x.reshape(1, -1)
    if x.dim() != 2:
        raise ValueError(f"{fn}: x must be [K] or [M, K], got shape {tuple(x.shape)}")
    M, K = x.shape
    if M < 1 or max_rows is not None and M > max_rows:
        most = f"1 to {max_rows} (use gemm for more, qgemm for quantized weights)" if max_rows else "at least 1"
        raise ValueError(f"{fn}: x has M={M} rows; {fn} takes {most}")
    if w.dim() != 2:
        raise ValueError(f"{fn}: w must be 2-D, got shape {tuple(w.shape)}")
    if w.stride(1) != 1 and w.shape[1] > 1:
        raise ValueError(f"{fn}: w must be contiguous along K (w.stride()={w.stride()}); pass w.contiguous()")
    N = w.shape[0]
    if fmt in _FLOAT16:
        if w.dtype != _FLOAT16[fmt] or x.dtype != w.dtype:
            raise TypeError(f"{fn}: fmt={fmt!r} needs w and x in {_FLOAT16[fmt]}, got w.dtype={w.dtype}, "
                            f"x.dtype={x.dtype}")
        if w.shape[1] != K:
            raise ValueError(f"{fn}: w.shape[1]={w.shape[1]} != K={K} (x is [M, K], w is [N, K])")
        if scales is not None:
            raise ValueError(f"{fn}: fmt={fmt!r} takes no scales")
    else:
        want_w = torch.int8 if fmt == "w8a16" else torch.uint8
        if w.dtype != want_w:
            raise TypeError(f"{fn}: fmt={fmt!r} needs w.dtype={want_w}, got {w.dtype} (see pack_{fmt})")
        check_tensor(fn, "scales", scales)
        if scales.dtype != x.dtype:
            raise TypeError(f"{fn}: scales.dtype={scales.dtype} must equal x.dtype={x.dtype}")
        if fmt == "w8a16":
            if w.shape[1] != K:
                raise ValueError(f"{fn}: w.shape[1]={w.shape[1]} != K={K} (x is [M, K], w is [N, K])")
            if tuple(scales.shape) != (N,):
                raise ValueError(f"{fn}: w8a16 scales.shape={tuple(scales.shape)} must be ({N},)")
        else:
            if K % W4_GROUP:
                raise ValueError(f"{fn}: w4a16 needs K={K} to be a multiple of {W4_GROUP}")
            if 2 * w.shape[1] != K:
                raise ValueError(f"{fn}: w4a16 w.shape[1]={w.shape[1]} != K/2={K // 2} (w is packed [N, K/2])")
            if tuple(scales.shape) != (N, K // W4_GROUP):
                raise ValueError(f"{fn}: w4a16 scales.shape={tuple(scales.shape)} must be ({N}, {K // W4_GROUP})")
            if scales.stride(1) != 1 and scales.shape[1] > 1:
                raise ValueError(f"{fn}: scales must be contiguous along groups (stride {scales.stride()})")
            if fmt == "w4a16t" and (N % W4_TILE_ROWS or not w.is_contiguous()):
                raise ValueError(f"{fn}: fmt='w4a16t' takes tile_w4a16's weight: contiguous, N a multiple of "
                                 f"{W4_TILE_ROWS} (got shape {tuple(w.shape)}, stride {w.stride()})")
    check_same_device(fn, w=w, x=x, scales=scales)
    if act is not None:
        if N % 2:
            raise ValueError(f"{fn}: act={act!r} takes w as [gate; up], an even number of rows, got N={N}")
        N //= 2
    if out is not None:
        check_out(fn, out, (N,) if one_row else (M, N), x.dtype, x.device)
        out = out.unsqueeze(0) if one_row else out
    if impl == "auto":
        if not auto_takes_triton(x.device):
            impl = "reference"
        else:
            impl = "cuda" if "cuda" in impls and _cuda_ptx_ok(x.device) else "triton"
    if impl in ("triton", "cuda"):
        require_triton(fn, impl, x.device)
    if impl == "cuda" and not _cuda_ptx_ok(x.device):
        raise ValueError(f"{fn}: impl='cuda' needs a CUDA GPU of compute capability >= 8.0 (its PTX uses "
                         f"bf16x2 instructions), got device {x.device}; use impl='triton'")
    pdl, config, name = _pdl_alias(pdl, config)
    option = pdl_option(fn, pdl, impl, x.device, name=name)
    if pdl is None and impl != "cuda":
        option = "off"  # on by default only where it was measured: the CUDA kernels
    return impl, x, out, option, config


# gemv()'s checks, remembered by everything they read (``common.path_key``): fmt, impl, pdl, the geometry
# of x, w, scales and out; calls with a config (benchmarks) are not remembered. The value is (impl, pdl
# option, the launch plan: None for the reference); what reads addresses (out overlapping an input) runs
# every call.
_PATHS = Paths()


def _cuda_ptx_ok(device: torch.device) -> bool:
    cap = capability(device)
    return cap is not None and cap >= (8, 0)


def _tiles_in_place(ptx: bool) -> bool:
    """Whether a gemv path (``ptx``: impl "cuda") reads "w4a16t" weights in place: the tensor-core kernel alone;
    the others take a row-layout copy. One rule for the launch plan and the call (``_GemvLaunch``, ``_gemv_run``)."""
    return ptx and TC_AVAILABLE


def tiled_w4a16_native(device) -> bool:
    """Whether ``gemv(impl="auto")`` reads ``"w4a16t"`` weights (``tile_w4a16``) in place on ``device``: the
    tensor-core kernel, on a CUDA GPU of compute capability >= 8.0 with Triton's Gluon. Elsewhere gemv takes a
    row-layout copy a call (correct, slower: keep ``"w4a16"`` there); ``qgemm`` reads tiles in place wherever
    its Triton kernel runs."""
    device = torch.device(device)
    return (TC_AVAILABLE and device.type == "cuda" and auto_takes_triton(device) and not interpreting()
            and _cuda_ptx_ok(device))


def gemv(w: torch.Tensor, x: torch.Tensor, scales: torch.Tensor | None = None, fmt: str = "bf16",
         impl: str = "auto", *, out: torch.Tensor | None = None, pdl=None, config: dict | None = None,
         act: str | None = None) -> torch.Tensor:
    """``y = x @ W^T`` for 1-8 rows of activations, W dense or quantized (split-K over K).

    Args:
        w: ``[N, K]`` in the activation dtype (fmt ``"bf16"``/``"fp16"``), int8 ``[N, K]`` (``"w8a16"``)
            or packed uint8 ``[N, K/2]`` (``"w4a16"``; ``"w4a16t"``: in ``tile_w4a16``'s layout, contiguous,
            N a multiple of 16); contiguous along K.
        x: ``[K]`` or ``[M, K]`` with ``1 <= M <= 8``, bf16 or fp16.
        scales: None for dense; ``[N]`` (w8a16) or ``[N, K/128]`` (w4a16, w4a16t) in ``x.dtype``.
        fmt: ``"bf16"``, ``"fp16"``, ``"w8a16"``, ``"w4a16"`` or ``"w4a16t"`` (the same weights tiled: read in
            place by the tensor-core kernel, ``impl="cuda"``; the other paths untile a copy a call,
            ``tiled_w4a16_native``).
        impl: ``"auto"`` (``"cuda"`` on a CUDA GPU of compute capability >= 8.0, ``"triton"`` on other
            GPUs, else the reference), ``"triton"`` (portable Triton ops), ``"cuda"`` (inline-PTX
            dequantization, the Gluon tensor-core kernel; otherwise the same) or ``"reference"``.
        out: optional tensor of y's shape (``[M, N]``, ``[N]`` for a 1-D x) in ``x.dtype`` on x's device to
            write y into: any view with unit stride along N (a row or column block of a larger buffer)
            sharing no memory with w, x or scales (address ranges compared).
        pdl: programmatic dependent launch (``pdl.py``; CUDA sm90+): None (on with ``impl="cuda"`` there,
            the measured default; off for the portable kernels), True (on; the next kernel's go "early" up
            to 8192 rows of W, "late" above), False, ``"early"`` or ``"late"``. ``config["PDL"]`` is its
            old spelling, still taken (both given must agree).
        config: tuning override: ``KERNEL`` ("fma", "words" or "mma"), ``BLOCK_N``, ``BLOCK_K``,
            ``SPLIT_K`` (these three required), ``num_warps``, ``num_stages``, ``FOLD`` (mma, w4a16: scales folded
            into the tile);
            ``KERNEL="tc"`` takes ``ROW_TILES``, ``num_warps``, ``SPLIT``, ``UNROLL`` (1, 2, 4, 8), ``PIPE``,
            ``STAGES`` (0 or 2-8: cp.async stages in shared memory), and ``BIASED``; ``KERNEL="cu"`` (fmt
            ``"w4a16t"``, CUDA C++ through NVRTC, ``gemv_cu``) takes ``num_warps`` (1, 2, 4, 8, 16; 2 or more with
            ``act``), ``UNROLL`` (1, 2, 4, 8 tiles a warp a batch), ``PIPE`` (registers) or ``STAGES`` (2-6
            batches of ``cp.async`` copies in shared memory); for benchmarks, eager calls only (a traced call uses
            the defaults).
        act: None, or ``"silu_mul"``: W is a fused gate/up projection ``[gate; up]`` (``[2F, K]``) and the
            result is SwiGLU's ``silu(x @ gate^T) * (x @ up^T)``, ``[M, F]``: each product rounded to
            x's dtype, then combined in fp32 and rounded once, as ``silu_mul`` of the plain GEMV's output
            computes it. One launch (the tile reads the gate and up rows of its outputs, no K split) on
            the fma, word and mma kernels; on the tensor-core kernel (``tc``) the GEMV and a ``silu_mul``.

    Returns:
        ``out``, or a new ``[M, N]`` (``[N]`` for a 1-D x; ``N / 2`` columns with ``act``) tensor in
        ``x.dtype``, accumulated in fp32.

    Raises:
        TypeError: wrong dtypes (weights for the format, scales vs activations, out).
        ValueError: bad shapes, more than 8 rows, K not a multiple of 128 for w4a16, mixed devices, an
            unknown fmt/impl, an impl that cannot run on these tensors, a bad out, pdl or act (an odd N).
    """
    one_row = isinstance(x, torch.Tensor) and x.dim() == 1
    key = path_key((fmt, impl, pdl, act), (x, w), (scales, out)) if config is None else None
    path = _PATHS.get(key) if key is not None else None
    if path is not None:
        y = _gemv_run(w, x.reshape(1, -1) if one_row else x, scales, fmt, path[0], path[1],
                      None if out is None else (out.unsqueeze(0) if one_row else out), None, path[2], act)
        return out if out is not None else (y.reshape(-1) if one_row else y)
    impl, x2, out2, pdl, config = _check_gemv(w, x, scales, fmt, impl, out, pdl, config, act)
    if key is not None:
        _PATHS.remember(key, (impl, pdl, None if impl == "reference" else
                              _GemvLaunch(w, x2, scales, fmt, None, impl == "cuda", pdl, out2, True, act is not None)))
    if torch.compiler.is_compiling():  # traced: the custom op with its fake implementation
        n = w.shape[0] // 2 if act is not None else w.shape[0]
        y = x2.new_empty((x2.shape[0], n)) if out2 is None else out2
        torch.ops.xelink.gemv(w, x2, scales, fmt, impl, pdl, act, y)
    else:
        # Eager (CUDA graph capture included): launch directly; custom-op dispatch costs tens of
        # microseconds of host time a call, more than the kernel runs.
        y = _gemv_run(w, x2, scales, fmt, impl, pdl, out2, config, act=act)
    if out is not None:
        return out
    return y.reshape(-1) if one_row else y

"""Compile xelink's Triton kernels for Intel GPUs on a machine with no GPU (Intel's Triton, ``triton-xpu``).

Intel's Triton 3.3 lowers a kernel to TTGIR, LLVM IR and SPIR-V for an explicit target. This module
makes that a check: every portable kernel is compiled the way a real launch would specialize it
(example launch arguments go through Triton's own JIT binder: pointers 16-byte aligned, unit strides
folded to constants, counts divisible by 16 where a real shape is), for each Intel target and
sub-group size, and the result is held to what the kernel promises:

- it compiles;
- a matrix kernel (GEMM, attention) contains the DPAS builtins (``intel_sub_group_*_matrix_mad_*``)
  and 2D block IO (``intel_sub_group_2d_block_*``) in its SPIR-V;
- a kernel that needs no shared local memory still needs none (``metadata.shared``).

``python -m xelink.kernels.intel_aot check`` runs it; ``... dump NAME --target xe2 --sub-group 16
--out DIR`` writes a kernel's TTGIR, LLVM IR and SPIR-V for inspection; ``list`` names the kernels.

How: the stock Intel backend builds a small SYCL/Level Zero helper only to turn the architecture
number into a name for ``ocloc``; without SYCL headers that build fails, so ``_patch_backend``
replaces that helper (code generation depends only on the capability flags). A stand-in driver makes
Triton's JIT compile for the chosen target without a device.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Callable

__all__ = ["TARGETS", "SUB_GROUPS", "LAUNCHES", "EXCEPTIONS", "Launch", "compile_launch", "check", "main",
           "spirv_capabilities", "without_kernel_attributes"]

# Capability sets, as torch.xpu.get_device_capability() reports them. Xe2 (Battlemage / Lunar Lake)
# and Intel Max (Ponte Vecchio) have the same flags for what xelink uses (DPAS, 2D block IO, bf16
# conversions): code generation, which reads only these flags, gives identical SPIR-V for the two
# except where tf32 DPAS matters (Max has it; no xelink kernel uses tf32).
_COMMON = dict(sub_group_sizes=[16, 32], has_subgroup_matrix_multiply_accumulate=True,
               has_subgroup_2d_block_io=True, has_bfloat16_conversions=True)
TARGETS = {
    "xe2": dict(_COMMON, architecture=0x0500400400, name="bmg_g21",
                has_subgroup_matrix_multiply_accumulate_tensor_float32=False),
    "max": dict(_COMMON, architecture=0x030F000700, name="pvc",
                has_subgroup_matrix_multiply_accumulate_tensor_float32=True),
}
SUB_GROUPS = (16, 32)
_DPAS = b"matrix_mad"
_BLOCK_IO = b"2d_block_"


@dataclasses.dataclass
class Launch:
    """One kernel launch to compile: where the kernel lives and arguments like a real call's.

    Attributes:
        name: ``module.kernel[variant]``.
        module, kernel: the module under ``xelink.kernels`` and the ``@triton.jit`` function's name.
        args: returns (positional args, keyword args) of an example launch; tensors are stand-ins
            with a dtype (aligned addresses), ints are real sizes and strides.
        num_warps: as the host wrapper launches it.
        matrix: must contain DPAS (``tl.dot`` on the matrix engines).
        block_io: must contain 2D block IO (block-pointer loads; default: what ``matrix`` says).
        shared: expected ``metadata.shared`` in bytes, or {sub-group size: bytes} (None: not checked);
            the values are what the kernel needs today, so any growth (or a kernel that needed none
            starting to need some) fails the check.
        sub_groups: sub-group sizes the kernel is compiled at. DPAS works on sub-groups of 16: the
            backend compiles a ``tl.dot`` kernel at 16 whatever is asked, so matrix kernels list (16,).
    """

    name: str
    module: str
    kernel: str
    args: Callable[[], tuple[list, dict]]
    num_warps: int = 4
    matrix: bool = False
    block_io: bool | None = None
    shared: int | dict | None = None
    sub_groups: tuple = SUB_GROUPS


def _t(dtype: str):
    """A tensor stand-in: Triton reads only ``dtype`` and ``data_ptr()`` (0: 16-byte aligned)."""
    from triton.runtime.jit import MockTensor

    import torch

    return MockTensor(getattr(torch, dtype))


# -- the kernels ---------------------------------------------------------------------------------
# Example launches mirror the host wrappers' calls at a typical shape (sizes divisible by 16 where the
# real shapes are, unit inner strides).

def _gemm(dtype="bfloat16", a_row=True, b_row=True, even=True):
    def args():
        M = N = K = 4096
        sa = (K, 1) if a_row else (1, M)
        sb = (N, 1) if b_row else (1, K)
        return ([_t(dtype), _t(dtype), _t(dtype), M, N, K, *sa, *sb, N, 1],
                dict(A_ROW_MAJOR=a_row, B_ROW_MAJOR=b_row, EVEN=even, BLOCK_M=128, BLOCK_N=128, BLOCK_K=32,
                     GROUP_M=8, PDL=0))
    return args


def _qgemm(w4=True, split=1, tiled=False):
    def args():
        M, N, K = 512, 4096, 4096
        # x, w, scales, y, partials, counters, M, N, K, x's strides, w's row stride, scales' row stride, y's strides
        return ([_t("bfloat16"), _t("uint8" if w4 else "int8"), _t("bfloat16"), _t("bfloat16"), _t("float32"),
                 _t("int32"), M, N, K, K, 1, K // 2 if w4 else K, K // 128 if w4 else 1, N, 1],
                dict(W4=w4, FP16=False, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, SPLIT_K=split, UNPACK=0,
                     TILED=tiled))
    return args


def _contiguous(*shape):
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return list(reversed(strides))


def _packed(total, heads, d):
    """flash_attention_varlen's strides of a packed (total, heads, d) tensor as the kernels take them: (b, h, s, d)
    with no batch stride."""
    return [0, d, heads * d, 1]


def _flash(d=128, causal=False, dtype="bfloat16", group=1, block_m=128, block_n=64, window=0, varlen=False):
    def args():
        B, H, S = 1, 32, 8192
        q = _contiguous(B, H, S, d)
        kv = _contiguous(B, H // group, S, d)
        extra = {}
        if varlen:  # 16 packed sequences of S tokens in all
            q, kv = _packed(S, H, d), _packed(S, H // group, d)
            extra = dict(VARLEN=True, CU_Q=_t("int32"), CU_K=_t("int32"))
        return ([_t(dtype), _t(dtype), _t(dtype), _t(dtype), _t("float32"), *q, *kv, *kv, *q, H, group, S, S, 0.127,
                 window], dict(HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, WINDOWED=window > 0,
                               **extra))
    return args


def _flash_bwd(kv_pass: bool, d=128, group=4, window=0, varlen=False):
    def args():
        B, H, S = 1, 32, 8192
        q = _contiguous(B, H, S, d)
        kv = _contiguous(B, H // group, S, d)
        extra = {}
        if varlen:
            q, kv = _packed(S, H, d), _packed(S, H // group, d)
            extra = dict(VARLEN=True, CU_Q=_t("int32"), CU_K=_t("int32"))
        outs = [_t("float32"), _t("float32")] if kv_pass else [_t("float32")]
        return ([_t("bfloat16"), _t("bfloat16"), _t("bfloat16"), _t("bfloat16"), _t("float32"), _t("float32"), *outs,
                 *q, *kv, *kv, *q, H // group if kv_pass else H, group, S, S, 0.088, 0.127, window],
                dict(HEAD_DIM=d, BLOCK_M=32 if kv_pass else 64, BLOCK_N=64 if kv_pass else 32, CAUSAL=True,
                     WINDOWED=window > 0, **extra))
    return args


def _flash_delta(d=128, varlen=False):
    def args():
        B, H, S = 1, 32, 8192
        if varlen:  # dlse (H, total_q): no batch stride
            return ([_t("bfloat16"), _t("bfloat16"), _t("float32"), _t("float32"), *_packed(S, H, d), *_packed(S, H, d),
                     0, S, 1, H, S], dict(HEAD_DIM=d, BLOCK_M=64, HAS_DLSE=True, VARLEN=True, CU_Q=_t("int32")))
        return ([_t("bfloat16"), _t("bfloat16"), _t("float32"), _t("float32"), *_contiguous(B, H, S, d),
                 *_contiguous(B, H, S, d), H * S, S, 1, H, S], dict(HEAD_DIM=d, BLOCK_M=64, HAS_DLSE=True))
    return args


def _decode(d=128, dtype="bfloat16", rope=False, window=0, ring=False):
    def args():
        B, HQ, HKV, SQ, SMAX = 8, 32, 8, 1, 4096 if ring else 32768
        q = _contiguous(B, HQ, SQ, d)
        kv = _contiguous(B, HKV, SMAX, d)
        # rope: the new k and v as views of a fused qkv row (48 heads of d), the cos / sin tables' row stride
        new = (48 * d, d, 48 * d, d, d, d) if rope else (0,) * 6
        return ([_t(dtype), _t(dtype), _t(dtype), _t("int32"), _t("float32"), _t("float32"), _t(dtype), _t("float32"),
                 _t("int32"), _t(dtype), _t(dtype), _t("float32"), _t("float32"), _t(dtype), *q, *kv, *kv, *q, *new,
                 HKV, HQ // HKV, SQ, SMAX, 0.127, 0, window, window],
                dict(HEAD_DIM=d, BLOCK_M=16, BLOCK_N=64, CAUSAL=False, MERGE_ROWS=4, UNROLL=16, MIN_CHUNK=256, PDL=0,
                     ROPE=rope, WINDOWED=window > 0, RING=ring))
    return args


def _merge(d=128):
    def args():
        n, B, H, S = 4, 1, 32, 8192
        o = _contiguous(n, B, H, S, d)
        lse = _contiguous(n, B, H, S)
        return ([_t("float32"), _t("float32"), _t("bfloat16"), _t("float32"), *o, *lse, *_contiguous(B, H, S, d),
                 n, H, S, d], dict(BLOCK_S=32, BLOCK_D=d, PDL=0))
    return args


def _rmsnorm(residual):
    def args():
        H = 4096
        return ([_t("bfloat16")] * 5 + [H, H, H, H, H, 1e-6], dict(HAS_RES=residual, ONE_PASS=True, BLOCK_H=H, PDL=0))
    return args


def _rope():
    def args():
        B, HQ, HK, S, D = 1, 32, 8, 8192, 128
        q, k, c = _contiguous(B, HQ, S, D), _contiguous(B, HK, S, D), _contiguous(1, 1, S, D)
        return ([_t("bfloat16"), _t("bfloat16"), _t("bfloat16"), _t("bfloat16"), _t("bfloat16"), _t("bfloat16"),
                 S, HQ, HK, *q[:3], *k[:3], 0, c[2], 0, c[2], *q[:3], *k[:3]],
                dict(HALF=D // 2, BLOCK_S=16, BLOCK_D=D // 2, HEADS=8, PDL=0))
    return args


def _rope_kv():
    def args():
        B, HQ, HK, S, D = 1, 32, 8, 8192, 128
        q, kc = _contiguous(B, HQ + 2 * HK, 1, D), _contiguous(B, HK, S, D)
        return ([_t("bfloat16"), _t("bfloat16"), _t("bfloat16"), _t("bfloat16"), _t("bfloat16"), _t("int64"),
                 _t("bfloat16"), _t("bfloat16"), _t("bfloat16"), HQ, HK, q[0], q[1], q[0], q[1], q[0], q[1], D, D,
                 HQ * D, D, *kc[:3], *kc[:3]],
                dict(HALF=D // 2, D=D, BLOCK_D=D // 2, BLOCK_V=D, HEADS=8, PDL=0))
    return args


# GEMV formats: (weight dtype, columns stored per row of K, scale row stride, FMT code)
_GEMV_FORMATS = {"bf16": ("bfloat16", 1, 0, 0), "w8a16": ("int8", 1, 1, 1), "w4a16": ("uint8", 2, 32, 2)}


def _gemv_fma(fmt, act=False):
    # act: the gate/up projection with SwiGLU at the store (unsplit, N outputs from 2N rows of W)
    def args():
        N = K = 4096
        wdt, per_byte, s_stride, code = _GEMV_FORMATS[fmt]
        return ([_t(wdt), _t("bfloat16"), _t("bfloat16"), _t("float32"), _t("bfloat16"), _t("int32"), N, K, K // 4,
                 K // per_byte, K, s_stride, N, N, N],
                dict(FMT=code, EVEN_K=True, PARTIAL=not act, ROWS=1, BLOCK_N=4, BLOCK_K=1024, PDL=0, ACT=act))
    return args


def _gemv_words(fmt, act=False):
    def args():
        N = K = 4096
        wdt, per_byte, s_stride, code = _GEMV_FORMATS[fmt]
        return ([_t(wdt), _t("bfloat16"), _t("bfloat16"), _t("bfloat16"), _t("bfloat16"), _t("bfloat16"), N, K, 8,
                 K // per_byte // 4, K, s_stride, N, 0, N],
                dict(FMT=code, PARTIAL=False, ROWS=1, PTX=False, BLOCK_N=8, BLOCK_K=512, PDL=0, ACT=act))
    return args


def _gemv_mma(fmt, act=False):
    def args():
        M, N, K = 8, 4096, 4096
        wdt, per_byte, s_stride, code = _GEMV_FORMATS[fmt]
        magic, bias = 0x4300, 136.0
        return ([_t(wdt), _t("bfloat16"), _t("bfloat16"), _t("float32"), _t("bfloat16"), _t("int32"), M, N, K, K // 4,
                 K // per_byte, K, s_stride, N, M * N, N],
                dict(FMT=code, EVEN_K=True, PARTIAL=not act, MAGIC=magic, BIAS=bias, PTX=False, FOLD=False, BLOCK_N=32,
                     BLOCK_K=512 if fmt == "w4a16" else 256, BLOCK_M=16, PDL=0, ACT=act))
    return args


def _gated_gemm(slices: int = 1):
    def args():
        M = N = K = 4096
        return ([_t("bfloat16"), _t("bfloat16"), _t("bfloat16"), _t("int32"), _t("int32"), _t("int32"), M, N, K,
                 K, 1, N, 1, N, 1, 512, 10**9],
                dict(A_ROW_MAJOR=True, B_ROW_MAJOR=True, EVEN=True, BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8,
                     NUM_PROGRAMS=64, TIMER=False, SLICES=slices))
    return args



def _scatter_gemm():
    def args():
        M = N = K = 4096
        world = 2
        peers = [_t("bfloat16")] * world + [None] * (8 - world)
        counters = [_t("int32")] * world + [None] * (8 - world)
        return ([_t("bfloat16"), _t("bfloat16"), *peers, *counters, _t("int32"), M, N, K, K, 1, N, 1, M // world,
                 M // world, 0],
                dict(RANK=1, WORLD=world, BLOCKS=1, A_ROW_MAJOR=True, B_ROW_MAJOR=True, EVEN=True, BLOCK_M=128,
                     BLOCK_N=128, BLOCK_K=32, GROUP_M=8, NUM_PROGRAMS=64))
    return args


def _scatter_reduce():
    def args():
        N, rows = 4096, 2048
        return ([_t("bfloat16"), _t("int32"), _t("int32"), _t("int32"), _t("bfloat16"), N, rows, N, 1, N // 128,
                 10**9, 0.5],
                dict(WORLD=2, BLOCKS=1, CHUNK_ROWS=128, ROWS=32, BLOCK_N=256, AVG=False, NUM_PROGRAMS=64, TIMER=False))
    return args

LAUNCHES: list[Launch] = [
    # The CUDA-core GEMV reduces across the sub-group through a little shared memory; the matrix-engine
    # GEMV loads through plain pointers (its weights are dequantized on the way), so DPAS but no block IO.
    *[Launch(f"gemv._gemv_fma_kernel[{f}, 1 row, split-K]", "gemv", "_gemv_fma_kernel", _gemv_fma(f),
             shared={"bf16": 64, "w8a16": 2048}[f]) for f in ("bf16", "w8a16")],
    *[Launch(f"gemv._gemv_words_kernel[{f}, 1 row]", "gemv", "_gemv_words_kernel", _gemv_words(f), num_warps=1,
             shared={"w8a16": 16, "w4a16": {16: 544, 32: 1056}}[f]) for f in ("w8a16", "w4a16")],
    *[Launch(f"gemv._gemv_kernel[{f}, 8 rows, split-K]", "gemv", "_gemv_kernel", _gemv_mma(f), matrix=True,
             block_io=False, shared=12288 if f == "w4a16" else 24576, sub_groups=(16,)) for f in _GEMV_FORMATS],
    Launch("gemv._gemv_fma_kernel[bf16, 1 row, act]", "gemv", "_gemv_fma_kernel", _gemv_fma("bf16", True)),
    Launch("gemv._gemv_words_kernel[w4a16, 1 row, act]", "gemv", "_gemv_words_kernel", _gemv_words("w4a16", True),
           num_warps=1),
    Launch("gemv._gemv_kernel[bf16, 8 rows, act]", "gemv", "_gemv_kernel", _gemv_mma("bf16", True), matrix=True,
           block_io=False, sub_groups=(16,)),
    Launch("gemv._splitk_sum_kernel", "gemv", "_splitk_sum_kernel",
           lambda: ([_t("float32"), _t("bfloat16"), 8 * 4096, 4096, 4096], dict(SPLIT=4, BLOCK=1024, PDL=0)), shared=0),
    Launch("norm._rmsnorm_kernel", "norm", "_rmsnorm_kernel", _rmsnorm(False), num_warps=8, shared=32),
    Launch("norm._rmsnorm_kernel[residual]", "norm", "_rmsnorm_kernel", _rmsnorm(True), num_warps=8, shared=32),
    Launch("norm._rope_kernel", "norm", "_rope_kernel", _rope(), shared=0),
    Launch("norm._rope_kv_kernel[hd128, gqa 4]", "norm", "_rope_kv_kernel", _rope_kv(), num_warps=1),
    Launch("norm._silu_mul_kernel", "norm", "_silu_mul_kernel",
           lambda: ([_t("bfloat16"), _t("bfloat16"), 14336, 2 * 14336, 14336], dict(BLOCK=1024, PDL=0))),
    *[Launch(f"attention._flash_fwd_kernel[hd{d}{', causal gqa' if c else ''}]", "attention", "_flash_fwd_kernel",
             _flash(d, c, group=4 if c else 1, block_m=128 if d < 256 else 64), num_warps=8, matrix=True,
             shared=256 * d, sub_groups=(16,))
      for d in (64, 128, 256) for c in (False, True)],
    Launch("attention._flash_fwd_kernel[hd128, causal gqa, window]", "attention", "_flash_fwd_kernel",
           _flash(128, True, group=4, window=4096), num_warps=8, matrix=True, sub_groups=(16,)),
    Launch("attention._flash_fwd_kernel[hd128, causal gqa, varlen]", "attention", "_flash_fwd_kernel",
           _flash(128, True, group=4, varlen=True), num_warps=8, matrix=True, shared=256 * 128, sub_groups=(16,)),
    Launch("attention._flash_fwd_kernel[hd128, causal gqa, window, varlen]", "attention", "_flash_fwd_kernel",
           _flash(128, True, group=4, window=4096, varlen=True), num_warps=8, matrix=True, sub_groups=(16,)),
    Launch("attention_bwd._delta_kernel[hd128, dlse]", "attention_bwd", "_delta_kernel", _flash_delta(),
           num_warps=4, sub_groups=(16,)),
    Launch("attention_bwd._delta_kernel[hd128, dlse, varlen]", "attention_bwd", "_delta_kernel",
           _flash_delta(varlen=True), num_warps=4, sub_groups=(16,)),
    Launch("attention_bwd._dkdv_kernel[hd128, causal gqa 4]", "attention_bwd", "_dkdv_kernel", _flash_bwd(True),
           num_warps=8, matrix=True, block_io=False, sub_groups=(16,)),
    Launch("attention_bwd._dq_kernel[hd128, causal gqa 4]", "attention_bwd", "_dq_kernel", _flash_bwd(False),
           num_warps=8, matrix=True, block_io=False, sub_groups=(16,)),
    Launch("attention_bwd._dkdv_kernel[hd128, causal gqa 4, window]", "attention_bwd", "_dkdv_kernel",
           _flash_bwd(True, window=4096), num_warps=8, matrix=True, block_io=False, sub_groups=(16,)),
    Launch("attention_bwd._dq_kernel[hd128, causal gqa 4, window]", "attention_bwd", "_dq_kernel",
           _flash_bwd(False, window=4096), num_warps=8, matrix=True, block_io=False, sub_groups=(16,)),
    Launch("attention_bwd._dkdv_kernel[hd128, causal gqa 4, varlen]", "attention_bwd", "_dkdv_kernel",
           _flash_bwd(True, varlen=True), num_warps=8, matrix=True, block_io=False, sub_groups=(16,)),
    Launch("attention_bwd._dq_kernel[hd128, causal gqa 4, varlen]", "attention_bwd", "_dq_kernel",
           _flash_bwd(False, varlen=True), num_warps=8, matrix=True, block_io=False, sub_groups=(16,)),
    Launch("attention._decode_split_kernel[hd128, gqa 4]", "attention", "_decode_split_kernel", _decode(),
           num_warps=4, matrix=True, shared=36864, sub_groups=(16,)),
    Launch("attention._decode_split_kernel[hd128, gqa 4, rope]", "attention", "_decode_split_kernel",
           _decode(rope=True), num_warps=4, matrix=True, sub_groups=(16,)),
    Launch("attention._decode_split_kernel[hd128, gqa 4, rope, window]", "attention", "_decode_split_kernel",
           _decode(rope=True, window=4096), num_warps=4, matrix=True, sub_groups=(16,)),
    Launch("attention._decode_split_kernel[hd128, gqa 4, rope, ring]", "attention", "_decode_split_kernel",
           _decode(rope=True, ring=True), num_warps=4, matrix=True, sub_groups=(16,)),
    Launch("attention._merge_kernel[hd128]", "attention", "_merge_kernel", _merge(), num_warps=4,
           shared={16: 1088, 32: 2176}),
    Launch("gemm._gemm_kernel[bf16, row x row]", "gemm", "_gemm_kernel", _gemm(), num_warps=8, matrix=True,
           shared=0, sub_groups=(16,)),
    Launch("gemm._gemm_kernel[fp16, row x col, tails]", "gemm", "_gemm_kernel",
           _gemm("float16", b_row=False, even=False), num_warps=8, matrix=True, sub_groups=(16,)),
    Launch("qgemm._qgemm_kernel[w4a16, bf16]", "qgemm", "_qgemm_kernel", _qgemm(), num_warps=4, matrix=True,
           block_io=False, sub_groups=(16,)),
    Launch("qgemm._qgemm_kernel[w4a16t, bf16]", "qgemm", "_qgemm_kernel", _qgemm(tiled=True), num_warps=4,
           matrix=True, block_io=False, sub_groups=(16,)),
    Launch("qgemm._qgemm_kernel[w8a16, bf16, K split 4]", "qgemm", "_qgemm_kernel", _qgemm(False, 4), num_warps=4,
           matrix=True, block_io=False, sub_groups=(16,)),
    Launch("gated_gemm._gated_gemm_kernel[bf16, 8 chunks]", "gated_gemm", "_gated_gemm_kernel", _gated_gemm(),
           num_warps=8, matrix=True, sub_groups=(16,)),
    Launch("gated_gemm._gated_gemm_kernel[bf16, 8 chunks, 8 column slices]", "gated_gemm", "_gated_gemm_kernel",
           _gated_gemm(8), num_warps=8, matrix=True, sub_groups=(16,)),
    Launch("scatter_gemm._scatter_gemm_kernel[bf16, 2 ranks]", "scatter_gemm", "_scatter_gemm_kernel",
           _scatter_gemm(), num_warps=8, matrix=True, sub_groups=(16,)),
    Launch("scatter_gemm._scatter_reduce_kernel[bf16, 2 ranks]", "scatter_gemm", "_scatter_reduce_kernel",
           _scatter_reduce(), num_warps=4),
]
# Kernels Intel's Triton 3.3 cannot compile, with the reason (checked: they are not in LAUNCHES).
EXCEPTIONS = {
    "collectives.*": "peer-memory collectives: they lower to SPIR-V, but the barrier deadline reads NVIDIA's "
                     "%globaltimer through inline PTX, which passes into the SPIR-V as foreign assembly that "
                     "Intel's compiler cannot build, and peers are CUDA IPC addresses; the Intel path needs a "
                     "SYCL timer and USM peer pointers (not built)",
    "gemm._gemm_tma_kernel": "Hopper variant (TMA descriptors), selected by a capability check on sm90",
    "gated_gemm._gated_gemm_tma_kernel": "Hopper variant (TMA descriptors), selected by a capability check on sm90",
    "scatter_gemm._scatter_gemm_tma_kernel": "Hopper variant (TMA descriptors), selected by a capability check on "
                                             "sm90",
    "attention._flash_fwd_tma_kernel": "Hopper variant (TMA descriptors), selected by a capability check on sm90",
}


# -- compiling -----------------------------------------------------------------------------------
def _patch_backend() -> None:
    """Let the Intel backend start without SYCL headers (see the module docstring)."""
    import triton.backends

    if "intel" not in triton.backends.backends:
        raise RuntimeError("intel_aot: this Triton has no Intel backend; install triton-xpu==3.3.0b1 "
                           "(pip install --pre --no-deps triton-xpu==3.3.0b1)")
    xpu = triton.backends.backends["intel"].compiler
    glb = xpu.__init__.__globals__
    if glb.get("_xelink_patched"):
        return

    class _Arch:
        def parse_device_arch(self, value):
            return ""  # only names the device for ocloc, which the check does not run

    glb["compile_module_from_src"] = lambda src, name: _Arch()
    glb["_xelink_patched"] = True


class _Driver:
    """Stands in for a device: Triton's JIT asks it for the target and nothing that needs hardware."""

    def __init__(self, target_name: str, sub_group: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("xpu", TARGETS[target_name], sub_group)
        # the JIT caches binders per device: one device number per (target, sub-group size)
        self.device = sorted(TARGETS).index(target_name) * 100 + sub_group

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


def _kernel(launch: Launch):
    import importlib

    return getattr(importlib.import_module(f"xelink.kernels.{launch.module}"), launch.kernel)


def compile_launch(launch: Launch, target: str, sub_group: int, *, target_props: dict | None = None):
    """The ``CompiledKernel`` of ``launch`` for ``target`` ("xe2"/"max") at ``sub_group``.

    ``target_props`` replaces the target's capability flags (tests use it to take DPAS away).
    """
    from triton.runtime.driver import driver

    _patch_backend()
    fake = _Driver(target, sub_group)
    if target_props is not None:
        from triton.backends.compiler import GPUTarget

        fake.target = GPUTarget("xpu", target_props, sub_group)
        fake.device += 10_000 + len(driver.__dict__)  # a binder of its own
    args, kwargs = launch.args()
    fn = _kernel(launch)
    driver.set_active(fake)
    try:
        return fn.warmup(*args, grid=(1,), num_warps=launch.num_warps, threads_per_warp=sub_group, **kwargs)
    finally:
        driver.reset_active()


_OP_EXECUTION_MODE, _OP_CAPABILITY = 16, 17
_KERNEL_ATTRIBUTES_INTEL = 5892  # capability of SPV_INTEL_kernel_attributes
_MAX_WORKGROUP_SIZE_INTEL = 5893  # its execution mode, which Triton's Intel backend emits for every kernel


def _instructions(spv: bytes):
    import struct

    words = struct.unpack(f"<{len(spv) // 4}I", spv)
    i = 5  # after the header
    while i < len(words):
        count = max(words[i] >> 16, 1)
        yield words[i:i + count]
        i += count


def spirv_capabilities(spv: bytes) -> list[int]:
    """The capabilities a SPIR-V module declares (the operands of its ``OpCapability`` instructions)."""
    return [ins[1] for ins in _instructions(spv) if ins[0] & 0xFFFF == _OP_CAPABILITY]


def without_kernel_attributes(spv: bytes) -> bytes:
    """``spv`` without the ``MaxWorkgroupSizeINTEL`` execution mode and the ``KernelAttributesINTEL``
    capability it needs (SPV_INTEL_kernel_attributes): Intel's CPU OpenCL runtime refuses every module that
    declares the capability ("SPIRV module requires unsupported capability 5892"), and the mode is only a
    bound on the work-group size, which the launch sets anyway. Everything else is kept word for word."""
    import struct

    words = list(struct.unpack("<5I", spv[:20]))
    for ins in _instructions(spv):
        op = ins[0] & 0xFFFF
        if (op == _OP_CAPABILITY and ins[1] == _KERNEL_ATTRIBUTES_INTEL) or \
                (op == _OP_EXECUTION_MODE and ins[2] == _MAX_WORKGROUP_SIZE_INTEL):
            continue
        words += ins
    return struct.pack(f"<{len(words)}I", *words)


def problems(launch: Launch, compiled, sub_group: int | None = None) -> list[str]:
    """What ``compiled`` breaks of ``launch``'s promises (empty: nothing)."""
    out = []
    spv = compiled.asm["spv"]
    if sub_group is not None and compiled.metadata.threads_per_warp != sub_group:
        out.append(f"compiled at sub-group {compiled.metadata.threads_per_warp}, asked {sub_group}")
    if launch.matrix and _DPAS not in spv:
        out.append("no DPAS builtin (intel_sub_group_*_matrix_mad_*) in the SPIR-V")
    if (launch.matrix if launch.block_io is None else launch.block_io) and _BLOCK_IO not in spv:
        out.append("no 2D block IO builtin (intel_sub_group_2d_block_*) in the SPIR-V")
    want = launch.shared.get(sub_group) if isinstance(launch.shared, dict) else launch.shared
    if want is not None and compiled.metadata.shared != want:
        out.append(f"metadata.shared={compiled.metadata.shared}, expected {want}")
    return out


def _check_one(launch: Launch, target: str, sg: int) -> tuple[list[str], str]:
    """(failures, log line) of one compile."""
    where = f"{launch.name} [{target}, sub-group {sg}]"
    try:
        compiled = compile_launch(launch, target, sg)
    except Exception as e:  # noqa: BLE001 - a compile error is the finding; report it whole
        failure = f"{where}: does not compile: {type(e).__name__}: {str(e).splitlines()[0]}"
        return [failure], failure
    found = problems(launch, compiled, sg)
    return [f"{where}: {p}" for p in found], (f"{where}: {'ok' if not found else '; '.join(found)} "
                                              f"(shared={compiled.metadata.shared}, spv={len(compiled.asm['spv'])} B)")


def _check_listed(index: int, target: str, sg: int) -> tuple[list[str], str]:
    """_check_one of ``LAUNCHES[index]`` (a worker process's job: launches are not picklable)."""
    return _check_one(LAUNCHES[index], target, sg)


def check(launches=None, targets=None, sub_groups=None, log=print, workers: int = 1) -> list[str]:
    """Compile every launch for every target and sub-group size; return the failures (empty: all good).
    ``workers`` > 1: the compiles of ``LAUNCHES`` (the default list) in that many processes (the
    compiler is single-threaded); the failures and the log lines come in the same order either way."""
    listed = launches is None
    jobs = [(i, launch, target, sg) for i, launch in enumerate(LAUNCHES if listed else launches)
            for target in targets or TARGETS
            for sg in (launch.sub_groups if sub_groups is None else [s for s in sub_groups if s in launch.sub_groups])]
    if workers > 1 and listed and len(jobs) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(_check_listed, *zip(*[(i, target, sg) for i, _, target, sg in jobs])))
    else:
        results = (_check_one(launch, target, sg) for _, launch, target, sg in jobs)
    failures = []
    for found, line in results:
        failures += found
        log(line)
    return failures


def _by_name(name: str) -> Launch:
    for launch in LAUNCHES:
        if launch.name == name:
            return launch
    raise SystemExit(f"intel_aot: no kernel launch named {name!r}; `list` shows them")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m xelink.kernels.intel_aot", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the kernel launches checked, and the exceptions")
    c = sub.add_parser("check", help="compile every kernel for every Intel target; exit 1 on a failure")
    c.add_argument("--target", choices=sorted(TARGETS), action="append")
    c.add_argument("--workers", type=int, default=1, help="compile in this many processes (default 1)")
    d = sub.add_parser("dump", help="write one kernel's TTGIR, LLVM IR and SPIR-V")
    d.add_argument("name")
    d.add_argument("--target", choices=sorted(TARGETS), default="xe2")
    d.add_argument("--sub-group", type=int, choices=SUB_GROUPS, default=16)
    d.add_argument("--out", default="intel-aot")
    args = p.parse_args(argv)
    if args.cmd == "list":
        for launch in LAUNCHES:
            print(f"{launch.name:45s} matrix={launch.matrix!s:5s} shared={launch.shared}")
        for name, why in EXCEPTIONS.items():
            print(f"{name:45s} not compiled: {why}")
        return 0
    if args.cmd == "check":
        failures = check(targets=args.target, workers=max(1, args.workers))
        print(f"intel_aot: {len(failures)} failure(s)")
        return 1 if failures else 0
    compiled = compile_launch(_by_name(args.name), args.target, args.sub_group)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{args.name.replace('[', '_').replace(']', '')}.{args.target}.sg{args.sub_group}"
    for key in ("ttgir", "llir", "spv"):
        data = compiled.asm[key]
        path = out / f"{stem}.{key}"
        path.write_bytes(data) if isinstance(data, bytes) else path.write_text(data)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

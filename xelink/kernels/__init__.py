"""Local kernels: a Triton kernel per op plus its pure-torch ``reference_*`` twin.

Modules import without Triton; a kernel that needs Triton raises a clear error when called without it.
The kernels are forward only, except flash attention and its packed-sequence twin ``flash_attention_varlen``:
where grad mode is on and an input requires grad, ``impl="auto"`` takes the reference path (torch ops,
differentiable) and a named kernel path raises ValueError (``common.forward_only``), so no output silently leaves
the autograd graph. ``flash_attention`` (``flash_attention_varlen``) with grad runs its path as the forward of an
autograd node whose backward is ``flash_attention_backward`` (``flash_attention_varlen_backward``): Triton kernels
on GPUs, ``attention_bwd``; the reference in torch ops elsewhere.
"""

from .attention import (decode_attention, flash_attention, flash_attention_backward, flash_attention_varlen,
                        flash_attention_varlen_backward, merge_attention, reference_decode_attention,
                        reference_flash_attention, reference_flash_attention_backward, reference_merge_attention,
                        reference_rope_decode_attention, rope_decode_attention)
from .gated_gemm import gated_gemm
from .gemm import gemm, reference_gemm
from .gemv_norm import gemv_residual, gemv_rms, norm_folds, reference_gemv_residual, reference_gemv_rms
from .gemv import (W4_TILE_ROWS, gemv, pack_w4a16, pack_w8a16, reference_gemv, tile_w4a16, tiled_w4a16_native,
                   unpack_w4a16, unpack_w8a16, untile_w4a16)
from .norm import (reference_rmsnorm, reference_rope, reference_rope_kv, reference_silu_mul, rmsnorm, rope, rope_kv,
                   silu_mul)
from .qgemm import qgemm
from .scatter_gemm import (reduce_programs, reference_scatter_reduce, scatter_gemm, scatter_geometry,
                           scatter_reduce)

__all__: list[str] = [
    "W4_TILE_ROWS",
    "decode_attention", "flash_attention", "flash_attention_backward", "flash_attention_varlen",
    "flash_attention_varlen_backward", "merge_attention", "reference_decode_attention",
    "reference_flash_attention", "reference_flash_attention_backward", "reference_merge_attention",
    "reference_rope_decode_attention", "rope_decode_attention",
    "gated_gemm", "gemm", "gemv", "gemv_residual", "gemv_rms", "norm_folds", "pack_w4a16", "pack_w8a16", "qgemm",
    "reference_gemm", "reference_gemv", "reference_gemv_residual", "reference_gemv_rms", "reference_rmsnorm",
    "reduce_programs", "reference_rope", "reference_rope_kv", "reference_scatter_reduce", "reference_silu_mul",
    "rmsnorm", "rope", "rope_kv", "scatter_gemm", "scatter_geometry", "scatter_reduce", "silu_mul", "tile_w4a16",
    "tiled_w4a16_native", "unpack_w4a16", "unpack_w8a16", "untile_w4a16",
]

"""Local ops with device dispatch: each picks its Triton kernel on a GPU and its pure-torch reference
elsewhere. One vocabulary for every op: ``impl=`` names a path, "auto", "triton" (portable), "cuda" (the
NVIDIA-specific kernel, where the op has one: gemm, gemv, flash_attention; "hopper" is its old name) or
"reference"; ``pdl=`` programmatic dependent launch, None, True, False, "early" or "late" (gemm, gemv,
rmsnorm, rope, rope_kv, silu_mul, decode_attention, rope_decode_attention); ``out=`` a caller's buffer (or a view
of one) to write the result into
(gemm, gemv, qgemm, rmsnorm and the attention ops); ``qgemm`` is gemv's quantized weights for any number of rows;
``gemv_residual`` / ``gemv_rms`` are the GEMVs on each side of an RMSNorm with the norm folded into them (one launch
each on the W4A16 tiles' CUDA C++ kernel, ``norm_folds``; elsewhere, and traced, gemv and torch ops).
Eager calls launch the kernels directly; under ``torch.compile`` every op goes through a ``torch.library``
custom op (``xelink::<name>``; rope_kv and rope_decode_attention mark the caches they write);
``flash_attention_backward`` is plain eager code (its kernels launched as Triton's own); ``flash_attention_varlen``
(packed sequences of different lengths, ``cu_seqlens`` offsets) traces as one custom op whose backward op is its
autograd formula. See ``xelink.kernels``."""
from .kernels import (decode_attention, flash_attention, flash_attention_backward, flash_attention_varlen,
                      flash_attention_varlen_backward, gemm, gemv, gemv_residual, gemv_rms, merge_attention, norm_folds,
                      pack_w4a16, pack_w8a16, qgemm, rmsnorm, rope, rope_decode_attention, rope_kv, silu_mul,
                      tile_w4a16, tiled_w4a16_native, unpack_w4a16, unpack_w8a16, untile_w4a16)

__all__ = ["decode_attention", "flash_attention", "flash_attention_backward", "flash_attention_varlen",
           "flash_attention_varlen_backward", "gemm", "gemv", "gemv_residual", "gemv_rms", "merge_attention",
           "norm_folds",
           "pack_w4a16", "pack_w8a16", "qgemm", "rmsnorm", "rope", "rope_decode_attention", "rope_kv", "silu_mul",
           "tile_w4a16", "tiled_w4a16_native", "unpack_w4a16", "unpack_w8a16", "untile_w4a16"]

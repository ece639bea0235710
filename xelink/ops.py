"""Local ops with device dispatch: each picks its Triton kernel on a GPU and its pure-torch reference
elsewhere (``impl=`` names a path: "auto", "triton", "hopper", "reference"). See ``xelink.kernels``."""
from .kernels import (decode_attention, flash_attention, gemm, gemv, merge_attention, pack_w4a16, pack_w8a16, rmsnorm,
                      rope, unpack_w4a16, unpack_w8a16)

__all__ = ["decode_attention", "flash_attention", "gemm", "gemv", "merge_attention", "pack_w4a16", "pack_w8a16",
           "rmsnorm", "rope", "unpack_w4a16", "unpack_w8a16"]

"""``y = x @ W^T`` with quantized weights (W8A16, W4A16) for any number of activation rows: the dequantization
inside a tiled tensor-core GEMM (prefill, and decode batches past ``gemv``'s 8 rows).

Weights and scales as ``gemv``'s formats (gemv.py): W8A16 ``W`` int8 ``[N, K]`` with ``scales [N]``, W4A16 ``W``
uint8 ``[N, K/2]`` (low nibble = even k) with ``scales [N, K/128]``. Each program computes a ``BLOCK_M x
BLOCK_N`` tile of y over K in steps of ``BLOCK_K`` = 128 columns: the activations' tile, the weights' tile as
exact 16-bit integers (the int8, or nibble - 8), one ``tl.dot`` into fp32, and then the scales: W4A16's group
scale (one group a step) multiplies each step's product, W8A16's row scale the sum at the end. Every product is
thus ``x * q`` exactly and the sums run in fp32, as ``reference_gemv`` computes ``x @ (q * scale)^T`` (up to
fp32 rounding), instead of rounding ``q * scale`` to 16 bits first. Before this kernel a model dequantized every
weight into a 16-bit copy for each call of more than 8 rows.
"""
from __future__ import annotations

import torch

from .common import check_no_overlap, triton, tl
from .gemv import W4_GROUP, _check_gemv, reference_gemv

__all__ = ["QGEMM_FORMATS", "QGEMM_IMPLS", "qgemm"]

QGEMM_FORMATS = ("w8a16", "w4a16")
QGEMM_IMPLS = ("auto", "triton", "reference")
_BLOCK_K = W4_GROUP  # a W4A16 step is one scale group


if triton is not None:

    @triton.jit
    def _qgemm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_sn, stride_ym,
                      stride_yn, W4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        # tiles in groups of GROUP_M rows of tiles, so that neighbouring programs share W's tiles in L2
        pid = tl.program_id(0)
        grid_m = tl.cdiv(M, BLOCK_M)
        width = GROUP_M * tl.cdiv(N, BLOCK_N)
        first_m = pid // width * GROUP_M
        size_m = tl.minimum(grid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % size_m
        pid_n = (pid % width) // size_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :] * stride_xk
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if W4:  # K is a multiple of BLOCK_K (= the scale group)
            w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + tl.arange(0, BLOCK_K // 2)[None, :]
            s_ptrs = s_ptr + rn.to(tl.int64) * stride_sn
            for _ in range(0, K, BLOCK_K):
                x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
                p = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
                lo = (p & 15).to(tl.int16) - 8
                hi = (p >> 4).to(tl.int16) - 8
                q = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K)).to(x.dtype)  # column 2j: lo, 2j + 1: hi
                s = tl.load(s_ptrs, mask=n_ok, other=0.0).to(tl.float32)
                acc += tl.dot(x, tl.trans(q)) * s[None, :]
                x_ptrs += BLOCK_K * stride_xk
                w_ptrs += BLOCK_K // 2
                s_ptrs += 1
        else:
            w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
            for k0 in range(0, K, BLOCK_K):
                k_ok = (k0 + rk < K)[None, :]
                x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok, other=0.0)
                q = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok, other=0).to(x.dtype)
                acc += tl.dot(x, tl.trans(q))
                x_ptrs += BLOCK_K * stride_xk
                w_ptrs += BLOCK_K
            acc *= tl.load(s_ptr + rn * stride_sn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :] * stride_yn
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _config(M: int) -> dict:
    """Tile sizes by the rows of x (the tensor cores' 16 at the fewest)."""
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 else 128
    return dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=_BLOCK_K, GROUP_M=8, num_warps=8 if block_m == 128 else 4,
                num_stages=3)


def qgemm(w: torch.Tensor, x: torch.Tensor, scales: torch.Tensor, fmt: str = "w4a16", impl: str = "auto", *,
          out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """``y = x @ W^T`` for any number of rows of activations, W quantized: ``gemv``'s formats and contract
    past its 8 rows.

    Args:
        w: int8 ``[N, K]`` (``"w8a16"``) or packed uint8 ``[N, K/2]`` (``"w4a16"``), contiguous along K.
        x: ``[K]`` or ``[M, K]``, M >= 1, bf16 or fp16.
        scales: ``[N]`` (w8a16) or ``[N, K/128]`` (w4a16) in ``x.dtype``.
        fmt: ``"w8a16"`` or ``"w4a16"`` (dense weights: ``gemm``).
        impl: ``"auto"`` (the Triton kernel on a GPU, else the reference), ``"triton"`` or ``"reference"``
            (``reference_gemv``: torch, float32).
        out: optional ``[M, N]`` (``[N]`` for a 1-D x) tensor in ``x.dtype`` on x's device, unit stride along N,
            sharing no memory with w, x or scales.
        config: tile override (``BLOCK_M``, ``BLOCK_N``, ``GROUP_M``, ``num_warps``, ``num_stages``), for
            benchmarks.

    Returns:
        ``out``, or a new ``[M, N]`` (``[N]`` for a 1-D x) tensor in ``x.dtype``, accumulated in fp32 and rounded
        once.

    Raises:
        TypeError / ValueError: as ``gemv``'s checks (before anything runs), naming ``qgemm``.
    """
    fn = "qgemm"
    one_row = isinstance(x, torch.Tensor) and x.dim() == 1
    impl, x2, out2, _, _ = _check_gemv(w, x, scales, fmt, impl, out, None, None, fn=fn, formats=QGEMM_FORMATS,
                                       impls=QGEMM_IMPLS, max_rows=None)
    if torch.compiler.is_compiling():  # traced: the custom op with its fake implementation
        y = x2.new_empty((x2.shape[0], w.shape[0])) if out2 is None else out2
        torch.ops.xelink.qgemm(w, x2, scales, fmt, impl, y)
    else:
        y = _qgemm_run(w, x2, scales, fmt, impl, out2, config)
    if out is not None:
        return out
    return y.reshape(-1) if one_row else y


def _qgemm_run(w, x, scales, fmt: str, impl: str, out=None, config: dict | None = None) -> torch.Tensor:
    """The checked call (also the custom op's body): ``out`` against the inputs, then the reference or the launch."""
    if out is not None:
        check_no_overlap("qgemm", out, w=w, x=x, scales=scales)
    if impl == "reference":
        y = reference_gemv(w, x, scales, fmt)
        return y if out is None else out.copy_(y)
    (M, K), N = x.shape, w.shape[0]
    y = x.new_empty((M, N)) if out is None else out
    cfg = dict(_config(M), **(config or {}), BLOCK_K=_BLOCK_K)
    if y.numel():
        grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
        _qgemm_kernel[grid](x, w, scales, y, M, N, K, x.stride(0), x.stride(1), w.stride(0), scales.stride(0),
                            y.stride(0), y.stride(1), W4=fmt == "w4a16", **cfg)
    return y


@torch.library.custom_op("xelink::qgemm", mutates_args=("out",))
def _qgemm_op(w: torch.Tensor, x: torch.Tensor, scales: torch.Tensor, fmt: str, impl: str, out: torch.Tensor) -> None:
    _qgemm_run(w, x, scales, fmt, impl, out)


@_qgemm_op.register_fake
def _(w, x, scales, fmt, impl, out):
    return None

"""``y = x @ W^T`` with quantized weights (W8A16, W4A16) for any number of activation rows: the dequantization
inside a tiled tensor-core GEMM (prefill, and decode batches past ``gemv``'s 8 rows).

Weights and scales as ``gemv``'s formats (gemv.py): W8A16 ``W`` int8 ``[N, K]`` with ``scales [N]``, W4A16 ``W``
uint8 ``[N, K/2]`` (low nibble = even k) with ``scales [N, K/128]``, read in place also in ``tile_w4a16``'s tiles
(``"w4a16t"``: a tile of 16 rows is one step of K, 1 KB). Each program computes a ``BLOCK_M x
BLOCK_N`` tile of y over K in steps of ``BLOCK_K`` = 128 columns: the activations' tile, the weights' tile as
exact 16-bit integers (the int8, or nibble - 8 built under a float's exponent: no int-to-float conversion), one
``tl.dot`` into fp32, and then the scales: W4A16's group scale (one group a step) multiplies each step's product,
W8A16's row scale the sum at the end. Every product is thus ``x * q`` exactly and the sums run in fp32, as
``reference_gemv`` computes ``x @ (q * scale)^T`` (up to fp32 rounding), instead of rounding ``q * scale`` to 16
bits first. Where the tiles are too few to fill the GPU (a few rows: decode batches), K is split and the last
split of a tile to finish adds the float32 partials in split order, in the same launch (``split.py``).
Before this kernel a model dequantized every weight into a 16-bit copy for each call of more than 8 rows.
"""
from __future__ import annotations

import torch

from .common import Paths, check_no_overlap, path_key, sm_count, tl, triton
from .gemv import W4_GROUP, _check_gemv, reference_gemv
from .launcher import launch
from .split import SCRATCH, last_split

__all__ = ["QGEMM_FORMATS", "QGEMM_IMPLS", "qgemm"]

QGEMM_FORMATS = ("w8a16", "w4a16", "w4a16t")
QGEMM_IMPLS = ("auto", "triton", "reference")
_BLOCK_K = W4_GROUP  # a W4A16 step is one scale group


if triton is not None:

    @triton.jit
    def _w4_tile(w_ptrs, n_ok, rk, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP16: tl.constexpr,
                 UNPACK: tl.constexpr):
        """One [BLOCK_N, BLOCK_K] tile of nibble - 8 in the activation dtype, exactly: the nibble OR-ed under the
        exponent of 128.0 (bf16) or 1024.0 (fp16) is 128 + n (1024 + n) exactly, and one subtraction leaves n - 8
        (no int-to-float conversion). UNPACK 0: the byte row split in two halves and joined; 1: each byte read
        twice (once a column) and shifted."""
        if UNPACK == 0:
            p = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
            n = tl.reshape(tl.join((p & 15).to(tl.int16), (p >> 4).to(tl.int16)), (BLOCK_N, BLOCK_K))
        else:
            p = tl.load(w_ptrs, mask=n_ok[:, None], other=0).to(tl.int16)
            n = (p >> ((rk % 2) * 4)[None, :]) & 15
        if FP16:
            q = (n | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
        else:
            q = (n | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
        return q

    @triton.jit
    def _qgemm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, counters, M, N, K, stride_xm, stride_xk, stride_wn,
                      stride_sn, stride_ym, stride_yn, W4: tl.constexpr, FP16: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
                      UNPACK: tl.constexpr, TILED: tl.constexpr = False):
        # tiles in groups of GROUP_M rows of tiles, so that neighbouring programs share W's tiles in L2
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
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
        # this split's K range: whole BLOCK_K steps
        per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        k_lo = pid_k * per
        k_hi = tl.minimum(K, k_lo + per)
        x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k_lo + rk)[None, :] * stride_xk
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if W4:  # K is a multiple of BLOCK_K (= the scale group)
            w_cols = tl.arange(0, BLOCK_K // 2) if UNPACK == 0 else rk // 2  # bytes of a step's row
            if TILED:
                # "w4a16t" (gemv.tile_w4a16): a step of 16 rows is one 16 x 64-byte tile, a row block's tiles in
                # column order
                rows = (rn // 16).to(tl.int64) * (16 * stride_wn) + (rn % 16) * (BLOCK_K // 2)
                w_ptrs = w_ptr + rows[:, None] + k_lo // 2 * 16 + w_cols[None, :]
            else:
                w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + k_lo // 2 + w_cols[None, :]
            s_ptrs = s_ptr + rn.to(tl.int64) * stride_sn + k_lo // BLOCK_K
            for _ in range(k_lo, k_hi, BLOCK_K):
                x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
                q = _w4_tile(w_ptrs, n_ok, rk, BLOCK_N, BLOCK_K, FP16, UNPACK)
                s = tl.load(s_ptrs, mask=n_ok, other=0.0).to(tl.float32)
                acc += tl.dot(x, tl.trans(q)) * s[None, :]
                x_ptrs += BLOCK_K * stride_xk
                w_ptrs += BLOCK_K // 2 * (16 if TILED else 1)
                s_ptrs += 1
        else:
            w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k_lo + rk)[None, :]
            for k0 in range(k_lo, k_hi, BLOCK_K):
                k_ok = (k0 + rk < K)[None, :]
                x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok, other=0.0)
                q = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok, other=0).to(x.dtype)
                acc += tl.dot(x, tl.trans(q))
                x_ptrs += BLOCK_K * stride_xk
                w_ptrs += BLOCK_K
        if SPLIT_K == 1:
            _store_tile(acc, s_ptr, y_ptr, rm, rn, m_ok, n_ok, stride_sn, stride_ym, stride_yn, W4)
        else:
            # a float32 partial a split; the last split of the tile to finish sums them in split order
            tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            tiles = tl.num_programs(0)
            tl.store(part_ptr + (pid_k * tiles + pid).to(tl.int64) * (BLOCK_M * BLOCK_N) + tile, acc)
            if last_split(counters, pid, SPLIT_K):
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for k in range(0, SPLIT_K):
                    acc += tl.load(part_ptr + (k * tiles + pid).to(tl.int64) * (BLOCK_M * BLOCK_N) + tile,
                                   cache_modifier=".cg")
                _store_tile(acc, s_ptr, y_ptr, rm, rn, m_ok, n_ok, stride_sn, stride_ym, stride_yn, W4)

    @triton.jit
    def _store_tile(acc, s_ptr, y_ptr, rm, rn, m_ok, n_ok, stride_sn, stride_ym, stride_yn, W4: tl.constexpr):
        """y's tile, W8A16's row scales applied (W4A16's were, a step at a time)."""
        if not W4:
            acc *= tl.load(s_ptr + rn * stride_sn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :] * stride_yn
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _config(M: int, N: int, K: int, sms: int, w4: bool) -> dict:
    """Tiles by the rows of x (the tensor cores' 16 at the fewest); where the tiles do not fill one wave of the
    GPU, K split in two, four, ... (at least two BLOCK_K steps a split) until they do. (H100, Llama-3.1-8B's
    projections: 128-column tiles beat 64 at 16 rows, W4A16 64-row tiles of 4 warps beat 128 of 8 by 1.3-1.4x at
    1024 rows (W8A16 the other way), and the bytes split in two halves and joined beat each byte read twice by
    2-4x: benchmarks/results/h100-rows/qgemm_ab.log.)"""
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 or w4 else 128
    tiles = -(-M // block_m) * -(-N // 128)
    steps = -(-K // _BLOCK_K)
    split = 1
    while tiles * split < sms and steps // (2 * split) >= 2:
        split *= 2
    return dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=_BLOCK_K, GROUP_M=8, SPLIT_K=split, UNPACK=0,
                num_warps=8 if block_m == 128 else 4, num_stages=3)


# qgemm()'s checks, remembered by everything they read (``common.path_key``: fmt, impl, the geometry of x, w, scales
# and out) as gemv's are; the value is the impl they resolved. What reads addresses (out overlapping an input) runs
# every call; calls with a config (benchmarks) are not remembered.
_PATHS = Paths()


def qgemm(w: torch.Tensor, x: torch.Tensor, scales: torch.Tensor, fmt: str = "w4a16", impl: str = "auto", *,
          out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """``y = x @ W^T`` for any number of rows of activations, W quantized: ``gemv``'s formats and contract
    past its 8 rows.

    Args:
        w: int8 ``[N, K]`` (``"w8a16"``) or packed uint8 ``[N, K/2]`` (``"w4a16"``, or ``"w4a16t"``:
            ``tile_w4a16``'s layout), contiguous along K.
        x: ``[K]`` or ``[M, K]``, M >= 1, bf16 or fp16.
        scales: ``[N]`` (w8a16) or ``[N, K/128]`` (w4a16, w4a16t) in ``x.dtype``.
        fmt: ``"w8a16"``, ``"w4a16"`` or ``"w4a16t"`` (dense weights: ``gemm``).
        impl: ``"auto"`` (the Triton kernel on a GPU, else the reference), ``"triton"`` or ``"reference"``
            (``reference_gemv``: torch, float32).
        out: optional ``[M, N]`` (``[N]`` for a 1-D x) tensor in ``x.dtype`` on x's device, unit stride along N,
            sharing no memory with w, x or scales.
        config: tile override (``BLOCK_M``, ``BLOCK_N``, ``GROUP_M``, ``SPLIT_K``, ``UNPACK``, ``num_warps``,
            ``num_stages``), for benchmarks.

    Returns:
        ``out``, or a new ``[M, N]`` (``[N]`` for a 1-D x) tensor in ``x.dtype``, accumulated in fp32 and rounded
        once.

    Raises:
        TypeError / ValueError: as ``gemv``'s checks (before anything runs), naming ``qgemm``.
    """
    fn = "qgemm"
    one_row = isinstance(x, torch.Tensor) and x.dim() == 1
    key = path_key((fmt, impl), (x, w), (scales, out)) if config is None else None
    hit = _PATHS.get(key) if key is not None else None
    if hit is not None:
        y = _qgemm_run(w, x.reshape(1, -1) if one_row else x, scales, fmt, hit,
                       None if out is None else (out.unsqueeze(0) if one_row else out))
        return out if out is not None else (y.reshape(-1) if one_row else y)
    impl, x2, out2, _, _ = _check_gemv(w, x, scales, fmt, impl, out, None, None, fn=fn, formats=QGEMM_FORMATS,
                                       impls=QGEMM_IMPLS, max_rows=None)
    if key is not None:
        _PATHS.remember(key, impl)
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
    if not y.numel():
        return y
    cfg = dict(_config(M, N, K, sm_count(x.device), fmt != "w8a16"), **(config or {}), BLOCK_K=_BLOCK_K)
    tiles = triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
    # without a K split the kernel reads neither counters nor partials: y stands in for both
    counters, part = SCRATCH.get(x.device, tiles, tiles * cfg["SPLIT_K"] * cfg["BLOCK_M"] * cfg["BLOCK_N"]) \
        if cfg["SPLIT_K"] > 1 else (y, y)
    # launcher.launch: Triton's JIT call without its tens of microseconds of host time a call
    launch(_qgemm_kernel, (tiles, cfg["SPLIT_K"]), x, w, scales, y, part, counters, M, N, K, x.stride(0), x.stride(1),
           w.stride(0), scales.stride(0), y.stride(0), y.stride(1), W4=fmt != "w8a16", TILED=fmt == "w4a16t",
           FP16=x.dtype == torch.float16, **cfg)
    return y


@torch.library.custom_op("xelink::qgemm", mutates_args=("out",))
def _qgemm_op(w: torch.Tensor, x: torch.Tensor, scales: torch.Tensor, fmt: str, impl: str, out: torch.Tensor) -> None:
    _qgemm_run(w, x, scales, fmt, impl, out)


@_qgemm_op.register_fake
def _(w, x, scales, fmt, impl, out):
    return None

"""The GEMVs on each side of a pre-norm block's RMSNorm, with the norm folded into them: no launch of its own.

A Llama-style block at decode runs ``o = gemv(W_o, a)``, then ``normed, h = rmsnorm(o, g, eps, residual=h)``,
then ``gemv(W_gate_up, normed)``. Since ``rmsnorm(h) @ W^T = rsqrt(mean(h^2) + eps) * ((h * g) @ W^T)`` row by
row, the norm splits into what the GEMV before can finish at its store and what the GEMV after can apply to its
sums:

- :func:`gemv_residual`: ``y = x @ W^T`` added into the residual stream in place (``h = round(h + round(y))``,
  rmsnorm's fused add); returns ``round(h * norm_weight)``, the next norm's input before its ``1 / rms``.
- :func:`gemv_rms`: ``round(rsqrt(mean(rms_of^2) + eps) * (x @ W^T))`` a row (``act="silu_mul"``: each of gate and
  up so scaled and rounded, then SwiGLU), so that ``gemv_rms(W, gemv_residual(W_o, a, h, g), h)`` is
  ``gemv(W, rmsnorm(o, g, residual=h)[0])`` within rounding (``h * g`` is rounded before the ``1 / rms``, not after).

Each is one launch of the CUDA C++ W4A16 kernel (``gemv_cu``: fmt ``"w4a16t"``, impl ``"cuda"`` where
``CU_FOLD``, ``gemv.CU_W4`` and NVRTC serve, :func:`norm_folds`): each program of ``gemv_rms`` sums ``rms_of^2``
over its row itself (the vector is in L2) after its first weights are asked for. Every other path composes
``gemv`` and torch ops (same values within rounding, more launches); ``reference_gemv_residual`` /
``reference_gemv_rms`` are the pure-torch twins, in float32 rounded as the kernel rounds.
"""
from __future__ import annotations

import sys
import warnings

import torch

from .common import Paths, byte_span, check_tensor, path_key
from .gemv import _check_gemv, aligned16, gemv, pdl_mode, reference_gemv
from .gemv_cu import CuLaunch, cu_available, cu_config
from .norm import reference_silu_mul, silu_mul
from .pdl import prefetch_bytes

__all__ = ["gemv_residual", "gemv_rms", "norm_folds", "reference_gemv_residual", "reference_gemv_rms"]

_GEMV = sys.modules[gemv.__module__]  # gemv's module: its switch CU_W4, read at each plan
_PATHS = Paths()
# The one-launch path (the kernel's RMS and RES modes) and with it the Llama decode step's folded norms
# (``Llama._fold_norms``). Off: compiled and checked offline (NVRTC, sm_80 / sm_90; ptxas: no spills in the
# decode step's configurations) but not yet run on a GPU, so the default step stays the measured one. The GPU tests
# set it; ``benchmarks/scripts/h200_pending.sh s39f`` runs them and the step's A/B
# (``step_ab.py gemv_norm.CU_FOLD=False,True``). Read when a path is planned.
CU_FOLD = False


def norm_folds(device, fmt: str = "w4a16t") -> bool:
    """Whether :func:`gemv_residual` and :func:`gemv_rms` run as one launch each (``impl="auto"``) for weights of
    ``fmt`` on ``device``: the CUDA C++ W4A16 kernel's (``CU_FOLD``, tiled W4A16, ``gemv.CU_W4``, NVRTC, compute
    capability >= 8.0). Elsewhere they compose ``gemv`` and torch ops: correct, more launches than the unfolded
    norm."""
    device = torch.device(device)
    return CU_FOLD and fmt == "w4a16t" and _GEMV.CU_W4 and cu_available(device) and _GEMV.tiled_w4a16_native(device)


def _check_eps(fn: str, eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"{fn}: eps={eps!r} must be a float >= 0")
    return float(eps)


def _check_vector(fn: str, name: str, t, like: torch.Tensor, shape: tuple) -> None:
    """``t`` a tensor of ``shape`` in ``like``'s dtype and device, unit stride along its last dim."""
    check_tensor(fn, name, t)
    if tuple(t.shape) != shape:
        raise ValueError(f"{fn}: {name}.shape={tuple(t.shape)} must be {shape}")
    if t.dtype != like.dtype:
        raise TypeError(f"{fn}: {name}.dtype={t.dtype} must equal x.dtype={like.dtype}")
    if t.device != like.device:
        raise ValueError(f"{fn}: {name} is on {t.device}, x on {like.device}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{fn}: {name} needs unit stride along its last dim (stride {t.stride()})")


def _cu_launch(fn: str, w, x2, scales, fmt: str, impl: str, pdl: str, act: bool, rms: bool, res: int, h2,
               eps: float):
    """The one-launch plan (``CuLaunch``) where the cu kernel serves this call, else None (the composed path).
    ``h2``: rms_of / the residual as [M, *] (rows 16-byte aligned for ``rms``)."""
    if impl != "cuda" or not norm_folds(x2.device, fmt):
        return None
    M, K = x2.shape
    N = w.shape[0]
    if act and N % 32 or rms and (h2.data_ptr() % 16 or h2.stride(0) * h2.element_size() % 16):
        return None
    mode = pdl_mode(pdl, N)
    try:
        return CuLaunch(x2.device, N, K, M, cu_config(M, N, K, act), act, x2.dtype == torch.float16, mode,
                        N // 2 if act else N, scales.stride(0), prefetch_bytes(mode, x2.device, gemv=True), rms=rms,
                        res=res, ldh=h2.stride(0), eps=eps)
    except (RuntimeError, OSError) as exc:  # NVRTC or the driver could not build it: composed, as gemv's CU_W4 path
        warnings.warn(f"{fn}: the CUDA C++ W4A16 kernel could not be built on {x2.device}, gemv and torch ops run "
                      f"instead: {str(exc)[:300]}", RuntimeWarning, stacklevel=3)
        return None


def gemv_rms(w: torch.Tensor, x: torch.Tensor, scales: torch.Tensor | None, fmt: str, rms_of: torch.Tensor,
             eps: float = 1e-6, impl: str = "auto", *, act: str | None = None, pdl=None) -> torch.Tensor:
    """``rsqrt(mean(rms_of^2) + eps) * (x @ W^T)`` a row, rounded once to x's dtype: the GEMV after an RMSNorm
    whose ``1 / rms`` it applies (module docstring; ``x``: :func:`gemv_residual`'s ``h * norm_weight``).

    Args:
        w, x, scales, fmt, impl, pdl: as :func:`xelink.kernels.gemv` (1-8 rows of x, any format; one launch
            where :func:`norm_folds`, else ``gemv`` then torch ops).
        rms_of: the tensor whose rows' RMS scales the output, x's shape, dtype and device, unit stride along K.
        eps: the RMSNorm epsilon, >= 0.
        act: None or ``"silu_mul"`` (w is ``[gate; up]``): SwiGLU of the scaled, rounded gate and up products.

    Returns:
        a new ``[M, N]`` (``[N]`` for a 1-D x; ``N / 2`` with ``act``) tensor in x's dtype.

    Raises:
        TypeError, ValueError: as ``gemv``, and a bad ``rms_of`` or ``eps``, naming gemv_rms.
    """
    fn = "gemv_rms"
    key = path_key((fn, fmt, impl, pdl, act, eps), (x, w, rms_of), (scales,))
    hit = _PATHS.get(key) if key is not None else None
    if hit is None:
        eps = _check_eps(fn, eps)
        impl, x2, _, option, _ = _check_gemv(w, x, scales, fmt, impl, None, pdl, None, act, fn=fn)
        _check_vector(fn, "rms_of", rms_of, x, tuple(x.shape))
        h2 = rms_of.reshape(x2.shape)
        hit = (impl, option, None if impl == "reference" or torch.compiler.is_compiling() else
               _cu_launch(fn, w, x2, scales, fmt, impl, option, act is not None, True, 0, h2, eps))
        if key is not None:
            _PATHS.remember(key, hit)
    impl, option, launch = hit
    one_row = x.dim() == 1
    x2, h2 = (x.reshape(1, -1), rms_of.reshape(1, -1)) if one_row else (x, rms_of)
    if impl == "reference":
        y = reference_gemv_rms(w, x2, scales, fmt, h2, eps, act)
    elif launch is not None:
        M, N = x2.shape[0], w.shape[0] // 2 if act else w.shape[0]
        y = launch(aligned16(w), aligned16(x2.contiguous()), scales, x2.new_empty((M, N)), h2, None)
    else:  # composed: the GEMV, its rows scaled, then the activation
        y = gemv(w, x2, scales, fmt, impl, pdl=pdl)
        y = (y.float() * _rstd(h2, eps)).to(x.dtype)
        y = silu_mul(y, impl="auto") if act else y
    return y.reshape(-1) if one_row else y


def gemv_residual(w: torch.Tensor, x: torch.Tensor, scales: torch.Tensor | None, fmt: str, residual: torch.Tensor,
                  norm_weight: torch.Tensor | None = None, impl: str = "auto", *, pdl=None) -> torch.Tensor:
    """``y = x @ W^T`` added into ``residual`` in place, ``round(residual + round(y))`` (``rmsnorm``'s fused residual
    add); returns ``round(residual * norm_weight)`` (the next RMSNorm's input before its ``1 / rms``: pass it to
    :func:`gemv_rms` with ``rms_of=residual``), or ``round(y)`` without ``norm_weight``.

    Args:
        w, x, scales, fmt, impl, pdl: as :func:`xelink.kernels.gemv` (no ``act``; one launch where
            :func:`norm_folds`, else ``gemv`` then torch ops).
        residual: ``[M, N]`` (``[N]`` for a 1-D x) in x's dtype and device, unit stride along N, sharing no
            memory with w, x or scales: updated in place.
        norm_weight: None or the next RMSNorm's weight ``[N]`` in x's dtype, unit stride.

    Returns:
        a new tensor of residual's shape in x's dtype.

    Raises:
        TypeError, ValueError: as ``gemv``, and a bad ``residual`` or ``norm_weight``, naming gemv_residual.
    """
    fn = "gemv_residual"
    key = path_key((fn, fmt, impl, pdl), (x, w, residual), (scales, norm_weight))
    hit = _PATHS.get(key) if key is not None else None
    if hit is None:
        impl, x2, _, option, _ = _check_gemv(w, x, scales, fmt, impl, None, pdl, None, None, fn=fn)
        N = w.shape[0]
        _check_vector(fn, "residual", residual, x, (N,) if x.dim() == 1 else (x.shape[0], N))
        if norm_weight is not None:
            _check_vector(fn, "norm_weight", norm_weight, x, (N,))
        h2 = residual.reshape(x2.shape[0], N)
        hit = (impl, option, None if impl == "reference" or torch.compiler.is_compiling() else
               _cu_launch(fn, w, x2, scales, fmt, impl, option, False, False, 1 if norm_weight is None else 2, h2,
                          0.0),
               _extents(residual, w=w, x=x, scales=scales, norm_weight=norm_weight))
        if key is not None:
            _PATHS.remember(key, hit)
    impl, option, launch, extents = hit
    _check_apart(fn, extents, residual, w=w, x=x, scales=scales, norm_weight=norm_weight)
    one_row = x.dim() == 1
    x2, h2 = (x.reshape(1, -1), residual.reshape(1, -1)) if one_row else (x, residual)
    if launch is not None:
        y = launch(aligned16(w), aligned16(x2.contiguous()), scales, x2.new_empty(h2.shape), h2, norm_weight)
    else:
        y = reference_gemv(w, x2, scales, fmt) if impl == "reference" else gemv(w, x2, scales, fmt, impl, pdl=pdl)
        h2.copy_(_add(h2, y))
        y = y if norm_weight is None else (h2.float() * norm_weight.float()).to(x.dtype)
    return y.reshape(-1) if one_row else y


def _extents(residual: torch.Tensor, **inputs) -> tuple:
    """The bytes each tensor's elements span (``common.byte_span``), residual's first: they depend on the geometry
    alone, so a remembered path keeps them and a call compares addresses only (:func:`_check_apart`)."""
    spans = [byte_span(t) if t is not None else (0, 0) for t in (residual, *inputs.values())]
    return tuple(hi - lo for lo, hi in spans)


def _check_apart(fn: str, extents: tuple, residual: torch.Tensor, **inputs) -> None:
    """``residual`` (written in place) shares no byte with an input the launch reads (address ranges compared, as
    ``common.spans_overlap``), before anything runs; ValueError naming the input."""
    lo = residual.data_ptr()
    hi = lo + extents[0]
    for (name, t), n in zip(inputs.items(), extents[1:]):
        if t is not None and n and lo < t.data_ptr() + n and t.data_ptr() < hi:
            raise ValueError(f"{fn}: residual overlaps {name} in memory (it is written in place: it must not share "
                             f"memory with an input)")


def _rstd(h: torch.Tensor, eps: float) -> torch.Tensor:
    """``rsqrt(mean(h^2) + eps)`` of each row, float32 ``[M, 1]``."""
    hf = h.float()
    return torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)


def _add(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (h.float() + y.float()).to(h.dtype)


def reference_gemv_rms(w: torch.Tensor, x: torch.Tensor, scales: torch.Tensor | None, fmt: str,
                       rms_of: torch.Tensor, eps: float = 1e-6, act: str | None = None) -> torch.Tensor:
    """Twin of :func:`gemv_rms`: float32 products (W dequantized exactly) times each row's ``1 / rms``, rounded
    once (``act``: gate and up each rounded, then SwiGLU rounded once)."""
    x2, h2 = (x.reshape(1, -1), rms_of.reshape(1, -1)) if x.dim() == 1 else (x, rms_of)
    y = reference_gemv(w, x2.float(), scales, fmt) * _rstd(h2, eps)  # (reference_gemv in x's dtype: float32 here)
    y = reference_silu_mul(y.to(x.dtype)) if act else y.to(x.dtype)
    return y.reshape(-1) if x.dim() == 1 else y


def reference_gemv_residual(w: torch.Tensor, x: torch.Tensor, scales: torch.Tensor | None, fmt: str,
                            residual: torch.Tensor, norm_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Twin of :func:`gemv_residual` (``residual`` updated in place the same way)."""
    y = reference_gemv(w, x, scales, fmt)
    residual.copy_(_add(residual, y))
    return y if norm_weight is None else (residual.float() * norm_weight.float()).to(x.dtype)

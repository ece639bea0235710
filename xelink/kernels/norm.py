"""RMSNorm (with a fused residual add), rotary position embedding (RoPE), and the decode step's fusions
(``rope_kv``: RoPE + the KV-cache write; ``silu_mul``: SwiGLU's activation) in Triton, with torch twins.

Both are one pass over memory: every input is read once and every output written once, in one launch
(RoPE handles Q and K in the same launch, reading each cos/sin tile once for a group of heads).
Arithmetic is float32 with one rounding to the output dtype.

On CUDA sm90+ both launch with programmatic dependent launch (``pdl``, pdl.py), as the GEMV kernels do:
a kernel waits for the one before it before touching memory, and lets the next be placed while it
runs, so a decode step's chain of norms, RoPE and GEMVs overlaps each launch with the previous tail.

``rmsnorm(..., out=)`` writes the normalized rows into a caller's view (a row or column block of a
larger buffer); the new residual of the fused variant is still a new tensor.
"""
from __future__ import annotations

import numbers

import torch

from .common import (Paths, auto_takes_triton, cdiv, check_impl, check_no_overlap, check_out, check_same_device,
                     check_tensor, forward_only, next_power_of_2, path_key, require_triton, tl, triton)
from .launcher import Slot, launch, launch_keyed
from .pdl import pdl_launch, pdl_launch_args, pdl_option, pdl_wait

__all__ = ["NORM_IMPLS", "reference_rmsnorm", "reference_rope", "reference_rope_kv", "reference_silu_mul", "rmsnorm",
           "rope", "rope_kv", "silu_mul"]

NORM_IMPLS = ("auto", "triton", "reference")
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_ONE_PASS_MAX = 16384  # widest row held in registers at once; wider rows take two passes


# -- references -----------------------------------------------------------------------------------

def reference_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None):
    """``x / sqrt(mean(x^2) + eps) * w`` in float32, rounded once to ``x.dtype``.

    With ``residual``: ``h = round(x + residual)`` (float32 add, rounded to ``x.dtype``) is normalized
    instead of x and returned as the new residual, ``(rmsnorm(h), h)``: the fused pre-norm residual
    step of Llama-style blocks (the rounded ``h`` is what the next layer adds to, so the norm uses it too).
    """
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    out = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)
    return out if residual is None else (out, h)


def _cos_sin_4d(c: torch.Tensor) -> torch.Tensor:
    """(S, D) / (B, S, D) / (B, 1, S, D) -> (B or 1, 1, S, D) view."""
    if c.dim() == 2:
        return c[None, None]
    if c.dim() == 3:
        return c[:, None]
    return c


def reference_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotate-half RoPE of q and k in float32, rounded once to their dtype. Args/Returns as ``rope``."""
    c, s = _cos_sin_4d(cos).float(), _cos_sin_4d(sin).float()

    def rotate(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return (x.float() * c + torch.cat((-x2, x1), dim=-1) * s).to(x.dtype)

    return rotate(q), rotate(k)


def reference_rope_kv(q, k, v, cos, sin, positions, k_cache, v_cache):
    """Twin of ``rope_kv``: RoPE of one token's q and k at ``positions`` (rows of the ``cos``/``sin`` tables),
    k and v written into the caches there; returns the rotated q."""
    return rope_kv_rows(q, k, v, cos, sin, positions, positions, k_cache, v_cache)


def rope_kv_rows(q, k, v, cos, sin, positions, rows, k_cache, v_cache):
    """``reference_rope_kv`` writing sequence b's k and v at cache row ``rows[b]`` instead of its position (a ring
    cache: ``rope_decode_attention(ring=True)``'s reference)."""
    c, s = cos[positions][:, None, None], sin[positions][:, None, None]  # (B, 1, 1, D)
    qr, kr = reference_rope(q, k, c, s)
    batch = torch.arange(q.shape[0], device=q.device)
    k_cache[batch, :, rows] = kr[:, :, 0]
    v_cache[batch, :, rows] = v[:, :, 0]
    return qr


def reference_silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :F]) * x[..., F:]`` (SwiGLU's gate times up) in float32, rounded once to ``x.dtype``."""
    g, u = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).to(x.dtype)


# -- kernels --------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _rmsnorm_kernel(x_ptr, r_ptr, w_ptr, o_ptr, h_ptr, H, stride_x, stride_r, stride_o, stride_h, eps,
                        HAS_RES: tl.constexpr, ONE_PASS: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        pdl_wait(PDL)
        x_row = x_ptr + row * stride_x
        r_row = r_ptr + row * stride_r
        o_row = o_ptr + row * stride_o
        h_row = h_ptr + row * stride_h
        cols = tl.arange(0, BLOCK_H)
        if ONE_PASS:
            ok = cols < H
            x = tl.load(x_row + cols, mask=ok, other=0.0)
            if HAS_RES:
                # The new residual is rounded to the activation dtype before the norm reads it back.
                x = (x.to(tl.float32) + tl.load(r_row + cols, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
                tl.store(h_row + cols, x, mask=ok)
            xf = x.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
            w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            pdl_launch(PDL)
            tl.store(o_row + cols, (xf * rstd * w).to(o_ptr.dtype.element_ty), mask=ok)
        else:
            acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
            for c0 in range(0, H, BLOCK_H):
                ok = c0 + cols < H
                x = tl.load(x_row + c0 + cols, mask=ok, other=0.0)
                if HAS_RES:
                    x = (x.to(tl.float32) + tl.load(r_row + c0 + cols, mask=ok, other=0.0).to(tl.float32)).to(x.dtype)
                    tl.store(h_row + c0 + cols, x, mask=ok)
                xf = x.to(tl.float32)
                acc += xf * xf
            rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / H + eps)
            pdl_launch(PDL)
            # Second pass re-reads the row (from the new residual when there is one): rows this wide
            # do not fit in registers.
            src = h_row if HAS_RES else x_row
            for c0 in range(0, H, BLOCK_H):
                ok = c0 + cols < H
                xf = tl.load(src + c0 + cols, mask=ok, other=0.0).to(tl.float32)
                w = tl.load(w_ptr + c0 + cols, mask=ok, other=0.0).to(tl.float32)
                tl.store(o_row + c0 + cols, (xf * rstd * w).to(o_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rope_heads(x_ptr, o_ptr, b, h0, h1, stride_b, stride_h, stride_s, ostride_b, ostride_h, ostride_s,
                    rs, rd, ok, c1, c2, s1, s2, HALF: tl.constexpr):
        x_off = b * stride_b + rs[:, None] * stride_s + rd[None, :]
        o_off = b * ostride_b + rs[:, None] * ostride_s + rd[None, :]
        for h in range(h0, h1):
            x1 = tl.load(x_ptr + x_off + h * stride_h, mask=ok, other=0.0)
            x2 = tl.load(x_ptr + x_off + h * stride_h + HALF, mask=ok, other=0.0)
            x1f = x1.to(tl.float32)
            x2f = x2.to(tl.float32)
            tl.store(o_ptr + o_off + h * ostride_h, (x1f * c1 - x2f * s1).to(x1.dtype), mask=ok)
            tl.store(o_ptr + o_off + h * ostride_h + HALF, (x2f * c2 + x1f * s2).to(x1.dtype), mask=ok)

    @triton.jit
    def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, S, HQ, HK,
                     sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sc_b, sc_s, ss_b, ss_s,
                     soq_b, soq_h, soq_s, sok_b, sok_h, sok_s,
                     HALF: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HEADS: tl.constexpr,
                     PDL: tl.constexpr):
        pid_s = tl.program_id(0)
        group = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        rs = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
        rd = tl.arange(0, BLOCK_D)
        ok = (rs < S)[:, None] & (rd < HALF)[None, :]
        c_off = b * sc_b + rs[:, None] * sc_s + rd[None, :]
        s_off = b * ss_b + rs[:, None] * ss_s + rd[None, :]
        pdl_wait(PDL)
        # cos/sin tiles are read once and reused for HEADS heads of q or of k.
        c1 = tl.load(cos_ptr + c_off, mask=ok, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + c_off + HALF, mask=ok, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + s_off, mask=ok, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + s_off + HALF, mask=ok, other=0.0).to(tl.float32)
        q_groups = tl.cdiv(HQ, HEADS)
        if group < q_groups:
            h0 = group * HEADS
            _rope_heads(q_ptr, qo_ptr, b, h0, tl.minimum(h0 + HEADS, HQ), sq_b, sq_h, sq_s, soq_b, soq_h, soq_s,
                        rs, rd, ok, c1, c2, s1, s2, HALF)
        else:
            h0 = (group - q_groups) * HEADS
            _rope_heads(k_ptr, ko_ptr, b, h0, tl.minimum(h0 + HEADS, HK), sk_b, sk_h, sk_s, sok_b, sok_h, sok_s,
                        rs, rd, ok, c1, c2, s1, s2, HALF)
        pdl_launch(PDL)


    @triton.jit
    def _rope_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, qo_ptr, kc_ptr, vc_ptr, HQ, HK,
                        sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, sc, ss, soq_b, soq_h, skc_b, skc_h, skc_s,
                        svc_b, svc_h, svc_s, HALF: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_V: tl.constexpr, HEADS: tl.constexpr, PDL: tl.constexpr):
        group = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        rs = tl.zeros((1,), dtype=tl.int32)
        rd = tl.arange(0, BLOCK_D)
        ok = (rd < HALF)[None, :]
        pdl_wait(PDL)
        pos = tl.load(pos_ptr + b).to(tl.int64)
        c1 = tl.load(cos_ptr + pos * sc + rd[None, :], mask=ok, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + pos * sc + HALF + rd[None, :], mask=ok, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + pos * ss + rd[None, :], mask=ok, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + pos * ss + HALF + rd[None, :], mask=ok, other=0.0).to(tl.float32)
        q_groups = tl.cdiv(HQ, HEADS)
        k_groups = tl.cdiv(HK, HEADS)
        if group < q_groups:
            h0 = group * HEADS
            _rope_heads(q_ptr, qo_ptr, b, h0, tl.minimum(h0 + HEADS, HQ), sq_b, sq_h, 0, soq_b, soq_h, 0,
                        rs, rd, ok, c1, c2, s1, s2, HALF)
        elif group < q_groups + k_groups:  # rotated k straight into its cache slot
            h0 = (group - q_groups) * HEADS
            _rope_heads(k_ptr, kc_ptr + pos * skc_s, b, h0, tl.minimum(h0 + HEADS, HK), sk_b, sk_h, 0, skc_b, skc_h,
                        0, rs, rd, ok, c1, c2, s1, s2, HALF)
        else:  # v copied into its cache slot
            h0 = (group - q_groups - k_groups) * HEADS
            rv = tl.arange(0, BLOCK_V)
            for h in range(h0, tl.minimum(h0 + HEADS, HK)):
                x = tl.load(v_ptr + b * sv_b + h * sv_h + rv, mask=rv < D)
                tl.store(vc_ptr + b * svc_b + h * svc_h + pos * svc_s + rv, x, mask=rv < D)
        pdl_launch(PDL)

    @triton.jit
    def _silu_mul_kernel(x_ptr, o_ptr, F, stride_x, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(1).to(tl.int64)
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < F
        pdl_wait(PDL)
        g = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * stride_x + F + cols, mask=ok, other=0.0).to(tl.float32)
        pdl_launch(PDL)
        tl.store(o_ptr + row * stride_o + cols, (g / (1.0 + tl.exp(-g)) * u).to(o_ptr.dtype.element_ty), mask=ok)


# -- host side: rmsnorm -------------------------------------------------------------------------------

def _resolve(fn: str, impl: str, device: torch.device) -> str:
    if impl == "auto":
        return "triton" if auto_takes_triton(device) else "reference"
    if impl == "triton":
        require_triton(fn, impl, device)
    return impl


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _rmsnorm_triton(x, w, eps: float, residual, pdl: str, out=None):
    shape, H = x.shape, x.shape[-1]
    x2 = _rows(x)
    rows = x2.shape[0]
    out = torch.empty(shape, dtype=x.dtype, device=x.device) if out is None else out
    h = torch.empty(shape, dtype=x.dtype, device=x.device) if residual is not None else out
    if rows == 0 or H == 0:
        return out if residual is None else (out, h.copy_(x))
    r2 = _rows(residual) if residual is not None else x2
    o2, h2 = out.view(-1, H), h.view(-1, H)
    launch(_rmsnorm_kernel, (rows,), x2, r2, w, o2, h2, H, x2.stride(0), r2.stride(0), o2.stride(0), h2.stride(0),
           float(eps), **_rmsnorm_options(rows, H, residual is not None, pdl, x.device))
    return out if residual is None else (out, h)


def _rmsnorm_options(rows: int, H: int, has_res: bool, pdl: str, device) -> dict:
    block = next_power_of_2(H)
    one_pass = block <= _ONE_PASS_MAX
    if not one_pass:
        block = 4096
    return dict(HAS_RES=has_res, ONE_PASS=one_pass, BLOCK_H=block, num_warps=max(1, min(16, block // 512)),
                **pdl_launch_args(pdl, rows, device))


class _NormLaunch:
    """A remembered rmsnorm path (``_PATHS``): the kernel's integer arguments, grid and options, worked out
    from a call whose x, residual and out are views of ``[rows, H]`` (so the kernel takes the tensors
    themselves), and a launcher slot (the key decides every argument's class)."""

    __slots__ = ("grid", "ints", "kwargs", "slot")

    def __init__(self, x, residual, out, pdl: str):
        H = x.shape[-1]
        x2 = x.view(-1, H)
        r2 = residual.view(-1, H) if residual is not None else x2
        stride_o = out.view(-1, H).stride(0) if out is not None else H  # else a new contiguous tensor
        self.grid = (x2.shape[0],)
        self.ints = (H, x2.stride(0), r2.stride(0), stride_o, stride_o if residual is None else H)
        self.kwargs = _rmsnorm_options(x2.shape[0], H, residual is not None, pdl, x.device)
        self.slot = Slot(_rmsnorm_kernel)

    def __call__(self, x, w, eps: float, residual, out):
        if out is not None:
            check_no_overlap("rmsnorm", out, x=x, w=w, residual=residual)
        o = x.new_empty(x.shape) if out is None else out  # contiguous, x's dtype and device
        h = o if residual is None else x.new_empty(x.shape)
        r = x if residual is None else residual
        # the addresses and eps are all that may differ from call to call
        launch_keyed(self.slot, (x.data_ptr(), r.data_ptr(), w.data_ptr(), o.data_ptr(), h.data_ptr(), eps), self.grid,
                     lambda: (x, r, w, o, h, *self.ints, float(eps)), self.kwargs)
        return o if residual is None else (o, h)


# rmsnorm()'s checks and path choice, remembered by everything they read (``common.path_key``): impl, pdl,
# eps, the geometry of x, w, residual and out. Kept only for the Triton path on CUDA tensors that need no
# copy (x, residual, out views of rows).
_PATHS = Paths()


def _rows_view(t) -> bool:
    """``t`` (None counts) is seen by the kernel as ``[rows, H]`` rows without a copy."""
    return t is None or ((t.stride(-1) == 1 or t.shape[-1] <= 1)
                         and t.reshape(-1, t.shape[-1]).data_ptr() == t.data_ptr())


def _rmsnorm_run(x, w, eps: float, residual, impl: str, pdl: str, out=None):
    """The eager call (also the custom ops' body): ``out`` checked against the inputs, then the launch."""
    if out is not None:
        check_no_overlap("rmsnorm", out, x=x, w=w, residual=residual)
    if impl == "triton":
        return _rmsnorm_triton(x, w, eps, residual, pdl, out)
    # contiguous, as the kernel's outputs and the fake implementations (a strided x's elementwise result is not)
    got = reference_rmsnorm(x, w, eps, residual)
    got = got.contiguous() if residual is None else (got[0].contiguous(), got[1].contiguous())
    if out is None:
        return got
    if residual is None:
        return out.copy_(got)
    return out.copy_(got[0]), got[1]


@torch.library.custom_op("xelink::rmsnorm", mutates_args=("out",))
def _rmsnorm_op(x: torch.Tensor, w: torch.Tensor, eps: float, impl: str, pdl: str, out: torch.Tensor) -> None:
    _rmsnorm_run(x, w, eps, None, impl, pdl, out)


@_rmsnorm_op.register_fake
def _rmsnorm_fake(x, w, eps, impl, pdl, out):
    return None


@torch.library.custom_op("xelink::rmsnorm_residual", mutates_args=("out",))
def _rmsnorm_residual_op(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float,
                         impl: str, pdl: str, out: torch.Tensor) -> torch.Tensor:
    return _rmsnorm_run(x, w, eps, residual, impl, pdl, out)[1]


@_rmsnorm_residual_op.register_fake
def _rmsnorm_residual_fake(x, residual, w, eps, impl, pdl, out):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _check_rows_out(fn: str, out, x) -> None:
    """``out`` for x's normalized rows: x's shape, dtype and device, unit stride along H, and its leading
    dims one stride apart so that the kernel sees it as ``[rows, H]`` with a row stride."""
    check_out(fn, out, x.shape, x.dtype, x.device)
    if out.numel():
        try:
            out.view(-1, x.shape[-1])
        except RuntimeError:
            raise ValueError(f"{fn}: out.stride()={out.stride()} for out.shape={tuple(out.shape)} must let out be "
                             "viewed as rows [-1, H] (its leading dims one stride apart)") from None


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None,
            impl: str = "auto", pdl: bool | str | None = None, *, out: torch.Tensor | None = None):
    """RMSNorm over the last dimension, optionally fused with the residual add before it.

    Args:
        x: ``[..., H]`` bf16, fp16 or fp32.
        w: ``[H]`` weight, any float dtype.
        eps: added to the mean square; a float >= 0.
        residual: None, or a tensor of x's shape and dtype; then ``h = x + residual`` (float32 add,
            rounded to x's dtype) is normalized and returned as the new residual.
        impl: ``"auto"`` (Triton on a GPU, else the reference), ``"triton"`` or ``"reference"`` (no
            ``"cuda"``: the portable kernel is the only one).
        pdl: programmatic dependent launch (pdl.py): None (on where it exists: the Triton path on CUDA
            sm90+), True (the same, but an error elsewhere), False, or "early" / "late" (where the next
            kernel may start: after this one's wait, or before its stores).
        out: optional tensor of x's shape and dtype on x's device for the normalized output: any view
            with unit stride along H whose leading dims flatten to rows (``big[r0:r1]``, ``big[:, c0:c1]``
            of a 2-D buffer), sharing no memory with x, w or residual (address ranges compared). With
            ``residual`` only the normalized output goes there: the new residual is still a new tensor
            (the next layer's ``residual`` argument), so the pair is ``(out, new_residual)``.

    Returns:
        ``out`` (a new contiguous tensor unless given) or, with ``residual``, ``(out, new_residual)``.
        ``out = h * rsqrt(mean(h^2) + eps) * w`` in float32, rounded once.

    Raises:
        TypeError: non-tensors or non-float dtypes, residual or out dtype != x dtype.
        ValueError: shape mismatches, negative eps, mixed devices, an unknown impl or one that cannot
            run on these tensors, a bad out, a bad pdl or one this GPU cannot do.
    """
    key = path_key((impl, pdl, eps), (x, w), (residual, out))
    plan = _PATHS.get(key) if key is not None else None
    if plan is not None:
        return plan(x, w, eps, residual, out)
    fn = "rmsnorm"
    impl = check_impl(fn, impl, NORM_IMPLS)
    check_tensor(fn, "x", x)
    check_tensor(fn, "w", w)
    impl = forward_only(fn, impl, x=x, w=w, residual=residual)
    if x.dtype not in _FLOATS:
        raise TypeError(f"rmsnorm: x.dtype={x.dtype} must be bfloat16, float16 or float32")
    if not w.is_floating_point():
        raise TypeError(f"rmsnorm: w.dtype={w.dtype} must be a floating dtype")
    if x.dim() < 1:
        raise ValueError("rmsnorm: x must have at least one dimension")
    if w.dim() != 1 or w.shape[0] != x.shape[-1]:
        raise ValueError(f"rmsnorm: w.shape={tuple(w.shape)} must be ({x.shape[-1]},), the last dim of x")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ValueError(f"rmsnorm: eps={eps!r} must be a float >= 0")
    if residual is not None:
        check_tensor(fn, "residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"rmsnorm: residual.shape={tuple(residual.shape)} != x.shape={tuple(x.shape)}")
        if residual.dtype != x.dtype:
            raise TypeError(f"rmsnorm: residual.dtype={residual.dtype} != x.dtype={x.dtype}")
    check_same_device(fn, x=x, w=w, residual=residual)
    if out is not None:
        _check_rows_out(fn, out, x)
    impl = _resolve(fn, impl, x.device)
    pdl = pdl_option(fn, pdl, impl, x.device)
    eps = float(eps)
    if key is not None and impl == "triton" and x.numel() and w.stride(0) == 1 and _rows_view(x) \
            and _rows_view(residual) and not torch.compiler.is_compiling():
        _PATHS.remember(key, _NormLaunch(x, residual, out, pdl))
    w = w if w.stride(0) == 1 else w.contiguous()
    if torch.compiler.is_compiling():  # traced: the custom ops with their fake implementations
        out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
        if residual is None:
            torch.ops.xelink.rmsnorm(x, w, eps, impl, pdl, out)
            return out
        return out, torch.ops.xelink.rmsnorm_residual(x, residual, w, eps, impl, pdl, out)
    # Eager (CUDA graph capture included): launch directly; custom-op dispatch costs tens of
    # microseconds of host time a call, more than the kernel runs.
    return _rmsnorm_run(x, w, eps, residual, impl, pdl, out)


# -- host side: rope ----------------------------------------------------------------------------------

def _rope_triton(q, k, cos, sin, pdl: str = "off"):
    B, HQ, S, D = q.shape
    HK = k.shape[1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    c = _cos_sin_4d(cos)
    s = _cos_sin_4d(sin)
    c = c if c.stride(-1) == 1 else c.contiguous()
    s = s if s.stride(-1) == 1 else s.contiguous()
    qo = torch.empty((B, HQ, S, D), dtype=q.dtype, device=q.device)
    ko = torch.empty((B, HK, S, D), dtype=k.dtype, device=k.device)
    if B == 0 or S == 0 or D == 0 or HQ + HK == 0:
        return qo, ko
    half = D // 2
    block_d = next_power_of_2(half)
    # Tiles of BLOCK_S positions x D/2 (1024 elements: the four cos/sin halves stay in 32 registers a
    # thread, so many programs fit on a multiprocessor), 8 heads a program: each cos/sin tile is
    # loaded once per 8 heads.
    block_s = max(1, min(next_power_of_2(S), 1024 // block_d))
    heads = 8
    groups = cdiv(HQ, heads) + cdiv(HK, heads)
    grid = (cdiv(S, block_s), groups, B)
    # A batch-broadcast cos/sin (leading dim 1) gets batch stride 0.
    cb = c.stride(0) if c.shape[0] > 1 else 0
    sb = s.stride(0) if s.shape[0] > 1 else 0
    launch(_rope_kernel, grid, q, k, c, s, qo, ko, S, HQ, HK, q.stride(0), q.stride(1), q.stride(2),
           k.stride(0), k.stride(1), k.stride(2), cb, c.stride(2), sb, s.stride(2),
           qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
           HALF=half, BLOCK_S=block_s, BLOCK_D=block_d, HEADS=heads, num_warps=4,
           **pdl_launch_args(pdl, grid[0] * grid[1] * grid[2], q.device))
    return qo, ko


def _rope_run(q, k, cos, sin, impl: str, pdl: str):
    if impl == "reference":  # contiguous, as the kernel's outputs and the fake implementation
        return tuple(t.contiguous() for t in reference_rope(q, k, cos, sin))
    return _rope_triton(q, k, cos, sin, pdl)


@torch.library.custom_op("xelink::rope", mutates_args=())
def _rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             impl: str, pdl: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope_run(q, k, cos, sin, impl, pdl)


@_rope_op.register_fake
def _rope_fake(q, k, cos, sin, impl, pdl):
    return (q.new_empty(q.shape), k.new_empty(k.shape))


def _check_cos_sin(name: str, c, B: int, S: int, D: int) -> None:
    check_tensor("rope", name, c)
    if not c.is_floating_point():
        raise TypeError(f"rope: {name}.dtype={c.dtype} must be a floating dtype")
    shape = tuple(c.shape)
    ok = (c.dim() == 2 and shape == (S, D)) or (c.dim() == 3 and shape[1:] == (S, D) and shape[0] in (1, B)) or \
         (c.dim() == 4 and shape[1:] == (1, S, D) and shape[0] in (1, B))
    if not ok:
        raise ValueError(f"rope: {name}.shape={shape} must be (S, D)=({S}, {D}), (B or 1, S, D) or "
                         f"(B or 1, 1, S, D) with B={B}")


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, impl: str = "auto",
         pdl: bool | str | None = None):
    """Rotary position embedding of q and k, rotate-half convention (Llama / Hugging Face).

    For each head vector x of length D, with x1 = x[:D/2] and x2 = x[D/2:]:
    ``out = x * cos + cat(-x2, x1) * sin``, i.e. ``out[:D/2] = x1*cos[:D/2] - x2*sin[:D/2]`` and
    ``out[D/2:] = x2*cos[D/2:] + x1*sin[D/2:]`` (HF passes cos = cat(freqs, freqs).cos(); any cos/sin
    of full width D is accepted). cos/sin hold one row per position of the sequence, already gathered.
    Computed in float32, rounded once; one launch for q and k.

    Args:
        q: ``(B, Hq, S, D)``, bf16/fp16/fp32, D even.
        k: ``(B, Hk, S, D)``, same B, S, D and dtype (GQA: Hk may differ from Hq).
        cos, sin: ``(S, D)``, ``(B or 1, S, D)`` or ``(B or 1, 1, S, D)``, any float dtype.
        impl: ``"auto"`` (Triton on a GPU, else the reference), ``"triton"`` or ``"reference"`` (no
            ``"cuda"``).
        pdl: programmatic dependent launch, as for :func:`rmsnorm` ("late": after the heads).

    Returns:
        ``(q_rot, k_rot)``: new contiguous tensors of q's and k's shapes and dtype.

    Raises:
        TypeError: non-tensors, non-float dtypes, q/k dtypes differ.
        ValueError: shape mismatches, odd D, mixed devices, an unknown impl or one that cannot run here,
            a bad pdl or one this GPU cannot do.
    """
    fn = "rope"
    impl = forward_only(fn, check_impl(fn, impl, NORM_IMPLS), q=q, k=k, cos=cos, sin=sin)
    check_tensor(fn, "q", q)
    check_tensor(fn, "k", k)
    if q.dtype not in _FLOATS:
        raise TypeError(f"rope: q.dtype={q.dtype} must be bfloat16, float16 or float32")
    if k.dtype != q.dtype:
        raise TypeError(f"rope: k.dtype={k.dtype} != q.dtype={q.dtype}")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"rope: q and k must be (B, H, S, D), got q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}")
    B, _, S, D = q.shape
    if k.shape[0] != B or k.shape[2] != S or k.shape[3] != D:
        raise ValueError(f"rope: k.shape={tuple(k.shape)} must match q.shape={tuple(q.shape)} in B, S and D")
    if D % 2:
        raise ValueError(f"rope: head dim D={D} must be even")
    _check_cos_sin("cos", cos, B, S, D)
    _check_cos_sin("sin", sin, B, S, D)
    check_same_device(fn, q=q, k=k, cos=cos, sin=sin)
    impl = _resolve(fn, impl, q.device)
    pdl = pdl_option(fn, pdl, impl, q.device)
    if torch.compiler.is_compiling():  # traced: the custom op with its fake implementation
        return torch.ops.xelink.rope(q, k, cos, sin, impl, pdl)
    # Eager: launch directly (no custom-op dispatch).
    return _rope_run(q, k, cos, sin, impl, pdl)


# -- host side: rope_kv and silu_mul (the decode step's fusions) ---------------------------------------

def _rope_kv_triton(q, k, v, cos, sin, positions, k_cache, v_cache, pdl: str):
    B, HQ, _, D = q.shape
    HK = k.shape[1]
    qo = q.new_empty(q.shape)
    heads = 8
    grid = (cdiv(HQ, heads) + 2 * cdiv(HK, heads), B)
    half = D // 2
    launch(_rope_kv_kernel, grid, q, k, v, cos, sin, positions, qo, k_cache, v_cache, HQ, HK,
           q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
           qo.stride(0), qo.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
           v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), HALF=half, D=D, BLOCK_D=next_power_of_2(half),
           BLOCK_V=next_power_of_2(D), HEADS=heads, num_warps=1, **pdl_launch_args(pdl, grid[0] * grid[1], q.device))
    return qo


def rope_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, impl: str = "auto",
            pdl: bool | str | None = None) -> torch.Tensor:
    """One decode token per sequence: RoPE of q and k at ``positions`` and the KV-cache write, in one launch.

    Sequence b's token sits at position ``p = positions[b]``: its cos/sin are rows ``p`` of the tables
    (read on the device: no gather, no host synchronization), its rotated k goes to
    ``k_cache[b, :, p]`` and its v to ``v_cache[b, :, p]``; the rotated q is returned. Rotate-half
    convention and float32 arithmetic as :func:`rope`.

    Args:
        q: ``(B, Hq, 1, D)``; k, v: ``(B, Hk, 1, D)``; bf16/fp16/fp32, one dtype, unit stride along D.
        cos, sin: ``(max_positions, D)`` tables, any float dtype, unit stride along D.
        positions: ``(B,)`` int32/int64 on q's device, each in ``[0, min(max_positions, cache length))``
            (not checked: that would synchronize).
        k_cache, v_cache: ``(>= B, Hk, S_cache, D)`` of q's dtype, unit stride along D.
        impl: ``"auto"``, ``"triton"`` or ``"reference"``; pdl: as for :func:`rmsnorm`.

    Returns:
        the rotated q, a new ``(B, Hq, 1, D)`` tensor.

    Raises:
        TypeError / ValueError: before any work, naming the argument (shapes, dtypes, devices, impl, pdl).
    """
    fn = "rope_kv"
    impl = forward_only(fn, check_impl(fn, impl, NORM_IMPLS), q=q, k=k, v=v, cos=cos, sin=sin)
    check_tensor(fn, "positions", positions)
    check_rope_kv(fn, q, k, v, cos, sin, k_cache, v_cache)
    B = q.shape[0]
    if positions.dim() != 1 or positions.shape[0] != B or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{fn}: positions must be ({B},) int32/int64, got {positions.dtype} {tuple(positions.shape)}")
    check_same_device(fn, q=q, positions=positions)
    impl = _resolve(fn, impl, q.device)
    pdl = pdl_option(fn, pdl, impl, q.device)
    if impl != "reference" and any(t.stride(-1) != 1 for t in (q, k, v, cos, sin, k_cache, v_cache)):
        raise ValueError(f"{fn}: q, k, v, cos, sin and the caches need unit stride along D")
    if torch.compiler.is_compiling():  # traced: the custom op (the caches marked as written)
        return torch.ops.xelink.rope_kv(q, k, v, cos, sin, positions, k_cache, v_cache, impl, pdl)
    return _rope_kv_run(q, k, v, cos, sin, positions, k_cache, v_cache, impl, pdl)


def _rope_kv_run(q, k, v, cos, sin, positions, k_cache, v_cache, impl: str, pdl: str):
    if impl == "reference":  # contiguous, as the kernel's output and the fake implementation
        return reference_rope_kv(q, k, v, cos, sin, positions, k_cache, v_cache).contiguous()
    return _rope_kv_triton(q, k, v, cos, sin, positions, k_cache, v_cache, pdl)


@torch.library.custom_op("xelink::rope_kv", mutates_args=("k_cache", "v_cache"))
def _rope_kv_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, impl: str,
                pdl: str) -> torch.Tensor:
    return _rope_kv_run(q, k, v, cos, sin, positions, k_cache, v_cache, impl, pdl)


@_rope_kv_op.register_fake
def _rope_kv_fake(q, k, v, cos, sin, positions, k_cache, v_cache, impl, pdl):
    return q.new_empty(q.shape)


def check_rope_kv(fn: str, q, k, v, cos, sin, k_cache, v_cache) -> None:
    """rope_kv's checks of everything but the positions (also ``rope_decode_attention``'s): one new token's q,
    k, v of one float dtype, the cos / sin tables, caches of at least q's batch, one device."""
    for name, t in (("q", q), ("k", k), ("v", v), ("cos", cos), ("sin", sin), ("k_cache", k_cache),
                    ("v_cache", v_cache)):
        check_tensor(fn, name, t)
    if q.dtype not in _FLOATS or k.dtype != q.dtype or v.dtype != q.dtype or k_cache.dtype != q.dtype or \
            v_cache.dtype != q.dtype:
        raise TypeError(f"{fn}: q, k, v, k_cache and v_cache must share one float dtype, got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if q.dim() != 4 or q.shape[2] != 1 or k.dim() != 4 or tuple(v.shape) != tuple(k.shape) or \
            k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:] or q.shape[3] % 2:
        raise ValueError(f"{fn}: q must be (B, Hq, 1, D) with D even and k, v (B, Hk, 1, D), got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, _, _, D = q.shape
    HK = k.shape[1]
    for name, c in (("cos", cos), ("sin", sin)):
        if c.dim() != 2 or c.shape[1] != D or not c.is_floating_point():
            raise ValueError(f"{fn}: {name} must be a float (max_positions, {D}) table, got {c.dtype} {tuple(c.shape)}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or c.shape[0] < B or c.shape[1] != HK or c.shape[3] != D:
            raise ValueError(f"{fn}: {name} must be (>= {B}, {HK}, S, {D}), got {tuple(c.shape)}")
    check_same_device(fn, q=q, k=k, v=v, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache)


def silu_mul(x: torch.Tensor, impl: str = "auto", pdl: bool | str | None = None, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU's activation: ``silu(x[..., :F]) * x[..., F:]`` of a fused gate/up projection's output, in
    float32, rounded once (one launch: the torch spelling takes four).

    Args:
        x: ``[..., 2F]`` bf16/fp16/fp32, unit stride along the last dimension.
        impl: ``"auto"``, ``"triton"`` or ``"reference"``; pdl: as for :func:`rmsnorm`.
        out: optional ``[..., F]`` tensor of x's dtype and device to write into, whose rows ``[-1, F]``
            are a view with unit stride along F, sharing no memory with x.

    Returns:
        ``out``, or a new ``[..., F]`` tensor of x's dtype.
    """
    fn = "silu_mul"
    impl = forward_only(fn, check_impl(fn, impl, NORM_IMPLS), x=x)
    check_tensor(fn, "x", x)
    if x.dtype not in _FLOATS:
        raise TypeError(f"{fn}: x.dtype={x.dtype} must be bfloat16, float16 or float32")
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"{fn}: x.shape={tuple(x.shape)} must end in an even dimension (gate, then up)")
    shape = x.shape[:-1] + (x.shape[-1] // 2,)
    if out is not None:
        check_out(fn, out, tuple(shape), x.dtype, x.device)
        try:
            if out.numel():
                out.view(-1, shape[-1])
        except RuntimeError:
            raise ValueError(f"{fn}: out.stride()={out.stride()} does not view as rows of {shape[-1]} (the kernel "
                             "stores [rows, F] with one row stride)") from None
    impl = _resolve(fn, impl, x.device)
    pdl = pdl_option(fn, pdl, impl, x.device)
    if torch.compiler.is_compiling():  # traced: the custom op writes out (a new one unless given)
        y = x.new_empty(shape) if out is None else out
        torch.ops.xelink.silu_mul(x, impl, pdl, y)
        return y
    return _silu_mul_run(x, impl, pdl, out)


@torch.library.custom_op("xelink::silu_mul", mutates_args=("out",))
def _silu_mul_op(x: torch.Tensor, impl: str, pdl: str, out: torch.Tensor) -> None:
    _silu_mul_run(x, impl, pdl, out)


@_silu_mul_op.register_fake
def _silu_mul_fake(x, impl, pdl, out):
    return None


def _silu_mul_run(x, impl: str, pdl: str, out=None):
    """The eager call (also the custom op's body): ``out`` checked against x, then the launch."""
    if out is not None:
        check_no_overlap("silu_mul", out, x=x)
    shape = x.shape[:-1] + (x.shape[-1] // 2,)
    if impl == "reference":
        y = reference_silu_mul(x)
        return y if out is None else out.copy_(y)
    F2 = x.shape[-1]
    x2 = _rows(x)
    rows = x2.shape[0]
    y = x.new_empty(shape) if out is None else out
    if rows == 0 or F2 == 0:
        return y
    y2 = y.view(rows, F2 // 2)
    block = min(1024, next_power_of_2(F2 // 2))
    grid = (cdiv(F2 // 2, block), rows)
    launch(_silu_mul_kernel, grid, x2, y2, F2 // 2, x2.stride(0), y2.stride(0), BLOCK=block, num_warps=4,
           **pdl_launch_args(pdl, grid[0] * grid[1], x.device))
    return y

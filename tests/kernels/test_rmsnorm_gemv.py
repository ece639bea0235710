"""rmsnorm_gemv: the pre-norm projection (residual add, RMSNorm, GEMV) in one launch where the fma kernel takes it.

The reference path is exactly ``rmsnorm`` then ``gemv``; the fused kernel (normalized x neither rounded nor written)
is held to float64 as tightly as that pair, its new residual bit for bit rmsnorm's, and every path that does not fold
the norm (other kernels, rows past 4) is exactly the pair. CPU: the reference and the checks; TRITON_INTERPRET=1: the
fused kernel on the CPU; GPU (marked): every format and dtype, tails, act, CUDA-graph replays with new inputs."""
import importlib.util
import os

import pytest
import torch

from xelink.kernels.gemv import gemv, pack_w4a16, pack_w8a16, reference_gemv, rmsnorm_gemv, unpack_w4a16, unpack_w8a16
from xelink.kernels.norm import reference_rmsnorm, reference_silu_mul, rmsnorm

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
TOL = {torch.bfloat16: 8e-3, torch.float16: 1e-3}


def _operands(fmt, N, K, M, dtype, device="cpu", residual=True):
    w = torch.randn(N, K, device=device) * 0.05
    if fmt in ("bf16", "fp16"):
        w, s, exact = w.to(dtype), None, w.to(dtype).double()
    else:
        w, s = (pack_w8a16 if fmt == "w8a16" else pack_w4a16)(w, dtype)
        exact = (unpack_w8a16 if fmt == "w8a16" else unpack_w4a16)(w, s).double()
    x = (torch.randn(M, K, device=device) * 3).to(dtype)
    r = torch.randn(M, K, device=device).to(dtype) if residual else None
    g = (1 + 0.3 * torch.randn(K, device=device)).to(dtype)
    return w, s, exact, x, r, g


def _exact(exact_w, x, r, g, eps, act):
    """float64 of the whole computation, from the rounded new residual (as rmsnorm rounds it)."""
    h = x if r is None else (x.float() + r.float()).to(x.dtype)
    hd = h.double()
    y = (hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + eps) * g.double()) @ exact_w.T
    if act:
        f = y.shape[-1] // 2
        y = torch.nn.functional.silu(y[..., :f]) * y[..., f:]
    return y


def _relerr(y, want):
    return float((y.double() - want).norm() / want.norm().clamp_min(1e-30))


def _pair(x, g, w, s, fmt, eps, r, impl, act, norm_impl="auto"):
    got = rmsnorm(x, g, eps, r, impl=norm_impl)
    normed, h = got if r is not None else (got, None)
    y = gemv(w, normed, s, fmt, impl, act=act)
    return y if r is None else (y, h)


@pytest.mark.parametrize("fmt", ["bf16", "w8a16", "w4a16"])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("act", [None, "silu_mul"])
def test_reference_is_rmsnorm_then_gemv(fmt, residual, act):
    for M, N, K in [(1, 6, 256), (3, 8, 384)]:
        w, s, _, x, r, g = _operands(fmt, N, K, M, torch.bfloat16, residual=residual)
        got = rmsnorm_gemv(x, g, w, s, fmt, 1e-5, r, impl="reference", act=act)
        normed = reference_rmsnorm(x, g, 1e-5, r)
        normed, h = normed if residual else (normed, None)
        y = reference_gemv(w, normed, s, fmt)
        y = reference_silu_mul(y) if act else y
        if residual:
            assert torch.equal(got[0], y) and torch.equal(got[1], h)
        else:
            assert torch.equal(got, y)
    # a 1-D x: [N] out, the residual [K]
    y1, h1 = rmsnorm_gemv(x[0], g, w, s, fmt, 1e-5, torch.zeros_like(x[0]), impl="reference")
    assert y1.shape == (N,) and torch.equal(h1, x[0])


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(g=torch.ones(5, dtype=torch.bfloat16)), ValueError, r"rmsnorm_gemv: norm_weight.shape=\(5,\)"),
    (dict(g=torch.ones(8, dtype=torch.int32)), TypeError, "rmsnorm_gemv: norm_weight.dtype=torch.int32"),
    (dict(eps=-1.0), ValueError, "rmsnorm_gemv: eps=-1.0"),
    (dict(r=torch.zeros(2, 8, dtype=torch.bfloat16)), ValueError, r"rmsnorm_gemv: residual.shape=\(2, 8\)"),
    (dict(r=torch.zeros(1, 8, dtype=torch.float16)), TypeError, "rmsnorm_gemv: residual.dtype=torch.float16"),
    (dict(x=torch.zeros(9, 8, dtype=torch.bfloat16), r=None), ValueError, "rmsnorm_gemv: x has M=9 rows"),
    (dict(w=torch.zeros(4, 6, dtype=torch.bfloat16)), ValueError, r"rmsnorm_gemv: w.shape\[1\]=6 != K=8"),
    (dict(act="gelu"), ValueError, "rmsnorm_gemv: act='gelu'"),
    (dict(fmt="int4"), ValueError, "rmsnorm_gemv: fmt='int4'"),
])
def test_bad_arguments(kwargs, error, match):
    args = dict(x=torch.ones(1, 8, dtype=torch.bfloat16), g=torch.ones(8, dtype=torch.bfloat16),
                w=torch.ones(4, 8, dtype=torch.bfloat16), eps=1e-6, r=torch.zeros(1, 8, dtype=torch.bfloat16),
                fmt="bf16", act=None)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        rmsnorm_gemv(args["x"], args["g"], args["w"], None, args["fmt"], args["eps"], args["r"], act=args["act"])


@pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("fmt", ["fp16", "w8a16"])
@pytest.mark.parametrize("act", [None, "silu_mul"])
def test_interpreted_fused_kernel(fmt, act):
    # The fma kernel (the default at 1-4 rows here) with the norm folded in: float64-close, as close as the
    # unfused pair; the new residual bit for bit rmsnorm's; K tails (200: not whole 1024-column tiles), odd N.
    # (fp16: the interpreter's bf16 arithmetic is not the GPU's.)
    for M, N, K in [(1, 10, 256), (3, 7, 200), (4, 4, 1100)]:
        for residual in (False, True):
            w, s, exact, x, r, g = _operands(fmt, 2 * N if act else N, K, M, torch.float16, residual=residual)
            got = rmsnorm_gemv(x, g, w, s, fmt, 1e-5, r, impl="triton", act=act)
            pair = _pair(x, g, w, s, fmt, 1e-5, r, "triton", act, norm_impl="reference")
            want = _exact(exact, x, r, g, 1e-5, act)
            y, yp = (got[0], pair[0]) if residual else (got, pair)
            assert y.shape == yp.shape == (M, N) and y.dtype == x.dtype
            assert _relerr(y, want) < max(2 * _relerr(yp, want), TOL[torch.float16]), (M, N, K, residual)
            if residual:
                assert torch.equal(got[1], pair[1])


GPU_CASES = [(1, 4096, 4096), (2, 6144, 4096), (4, 1000, 200), (3, 333, 1100), (8, 512, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "w8a16", "w4a16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_matches_the_pair(requires_gpus, fmt, dtype):
    # Every format, dtype and path the model calls at decode: the fused fma kernel (dense and W8A16, 1-4 rows) held
    # to float64 like the pair and its residual bit for bit; the kernels that do not fold the norm (W4A16, 8 rows)
    # exactly the pair; with and without a residual and act; back-to-back calls of changing shapes.
    requires_gpus(1)
    if fmt == "bf16" and dtype == torch.float16:
        fmt = "fp16"
    for M, N, K in GPU_CASES:
        if fmt == "w4a16" and K % 128:
            continue
        for residual in (False, True):
            for act in (None, "silu_mul"):
                w, s, exact, x, r, g = _operands(fmt, 2 * N if act else N, K, M, dtype, "cuda", residual)
                got = rmsnorm_gemv(x, g, w, s, fmt, 1e-5, r, act=act)
                pair = _pair(x, g, w, s, fmt, 1e-5, r, "auto", act)
                y, yp = (got[0], pair[0]) if residual else (got, pair)
                where = (fmt, dtype, M, N, K, residual, act)
                if residual:
                    assert torch.equal(got[1], pair[1]), where
                if M <= 4 and fmt != "w4a16":  # folded
                    want = _exact(exact, x, r, g, 1e-5, act)
                    assert _relerr(y, want) < max(2 * _relerr(yp, want), TOL[dtype]), where
                else:
                    assert torch.equal(y, yp), where


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "w8a16"])
def test_gpu_graph_replays_new_inputs(requires_gpus, fmt):
    # Captured once, replayed over new x, residual and norm weights written into the same buffers: each replay
    # equals an eager call on those inputs bit for bit (the new residual too), so nothing of the first inputs is
    # baked in; a 1-D x and two rows.
    requires_gpus(1)
    for M in (1, 2):
        w, s, _, x, r, g = _operands(fmt, 4096, 4096, M, torch.bfloat16, "cuda")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            rmsnorm_gemv(x, g, w, s, fmt, 1e-5, r)  # the plan and the compilation, before the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                y, h = rmsnorm_gemv(x, g, w, s, fmt, 1e-5, r)
        torch.cuda.current_stream().wait_stream(stream)
        for _ in range(3):
            _, _, _, x2, r2, g2 = _operands(fmt, 1, 4096, M, torch.bfloat16, "cuda")
            x.copy_(x2), r.copy_(r2), g.copy_(g2)
            graph.replay()
            want_y, want_h = rmsnorm_gemv(x2, g2, w, s, fmt, 1e-5, r2)
            assert torch.equal(y, want_y) and torch.equal(h, want_h), (fmt, M)
    y1 = rmsnorm_gemv(x[0], g, w, s, fmt, 1e-5)
    assert y1.shape == (4096,) and torch.equal(y1, rmsnorm_gemv(x[:1], g, w, s, fmt, 1e-5)[0])

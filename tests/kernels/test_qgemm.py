"""qgemm: ``x @ W^T`` with W8A16 / W4A16 weights for any number of rows (the dequantization in the GEMM's tiles):
the reference path, argument checks, the custom op, and the Triton kernel against float64 on the dequantized
weights (CPU interpreter with TRITON_INTERPRET=1; GPU: both formats and dtypes, tails in M and N, Llama-3.1-8B's
shapes at prefill and batch sizes, K splits and both unpackings, out= views, under a CUDA graph)."""
import importlib.util
import os

import pytest
import torch

from xelink.kernels.gemv import pack_w4a16, pack_w8a16, reference_gemv, tile_w4a16, unpack_w4a16, unpack_w8a16
from xelink.kernels.qgemm import qgemm

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
TOL = {torch.bfloat16: 8e-3, torch.float16: 1e-3}


def _case(fmt, m, n, k, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    q, s = (pack_w8a16 if fmt == "w8a16" else pack_w4a16)(w, dtype)
    exact = (unpack_w8a16 if fmt == "w8a16" else unpack_w4a16)(q, s).double()
    x = torch.randn(m, k, generator=gen).to(dtype)
    return q.to(device), s.to(device), x.to(device), exact


def _rel(y, x, exact):
    ref = x.double().cpu() @ exact.T
    return float((y.double().cpu() - ref).norm() / ref.norm())


@pytest.mark.parametrize("fmt", ["w8a16", "w4a16"])
def test_reference_is_gemvs_for_any_rows(fmt):
    q, s, x, exact = _case(fmt, 37, 24, 256, torch.float16)
    assert torch.equal(qgemm(q, x, s, fmt), reference_gemv(q, x, s, fmt))  # CPU: auto is the reference
    assert _rel(qgemm(q, x, s, fmt, impl="reference"), x, exact) < TOL[torch.float16]
    assert torch.equal(qgemm(q, x[0], s, fmt), reference_gemv(q, x[:1], s, fmt)[0])  # a 1-D x
    big = torch.zeros(37, 40, dtype=torch.float16)
    assert qgemm(q, x, s, fmt, out=big[:, 8:32]) is not None and torch.equal(big[:, 8:32], reference_gemv(q, x, s, fmt))
    assert not big[:, :8].any() and not big[:, 32:].any()


def test_bad_arguments_name_qgemm():
    q, s, x, _ = _case("w4a16", 20, 16, 256, torch.bfloat16)
    with pytest.raises(ValueError, match="qgemm: fmt='bf16' is not one of w8a16, w4a16"):
        qgemm(q, x, s, "bf16")
    with pytest.raises(ValueError, match="qgemm: x has M=0 rows; qgemm takes at least 1"):
        qgemm(q, x[:0], s, "w4a16")
    with pytest.raises(ValueError, match="qgemm has no cuda kernel"):
        qgemm(q, x, s, "w4a16", impl="cuda")
    with pytest.raises(TypeError, match="qgemm: scales.dtype=torch.float16 must equal x.dtype=torch.bfloat16"):
        qgemm(q, x, s.half(), "w4a16")
    with pytest.raises(ValueError, match=r"qgemm: w4a16 w.shape\[1\]=128 != K/2=64"):
        qgemm(q, x[:, :128], s, "w4a16")
    with pytest.raises(ValueError, match="qgemm: out"):
        qgemm(q, x, s, "w4a16", out=torch.empty(20, 15, dtype=torch.bfloat16))


def test_grad_takes_the_reference():
    # forward only: with grad, auto is the reference's torch ops (differentiable); a named kernel path refuses
    q, s, x, exact = _case("w4a16", 5, 16, 128, torch.bfloat16)
    x.requires_grad_()
    qgemm(q, x, s, "w4a16").float().sum().backward()
    assert torch.allclose(x.grad.float(), exact.sum(0).float().expand(5, -1), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="qgemm: x requires grad, but impl='triton' is forward only"):
        qgemm(q, x, s, "w4a16", impl="triton")


def test_custom_op_and_compile():
    q, s, x, _ = _case("w4a16", 19, 32, 256, torch.float16)
    out = torch.empty(19, 32, dtype=x.dtype)
    torch.library.opcheck(torch.ops.xelink.qgemm.default, (q, x, s, "w4a16", "reference", out))
    compiled = torch.compile(lambda x: qgemm(q, x, s, "w4a16") * 2, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), reference_gemv(q, x, s, "w4a16") * 2)


def _check_kernel(device, dtype, shapes, fmts=("w8a16", "w4a16", "w4a16t"), config=None):
    for fmt in fmts:
        for m, n, k in shapes:
            if fmt != "w8a16" and k % 128 or fmt == "w4a16t" and n % 16:
                continue
            q, s, x, exact = _case(fmt, m, n, k, dtype, device, seed=m + n + k)
            if fmt == "w4a16t":  # the same weights tiled: the same sums in the same order as the row layout's
                rows = qgemm(q, x, s, "w4a16", impl="triton", config=config)
                q = tile_w4a16(q)
            y = qgemm(q, x, s, fmt, impl="triton", config=config)
            assert y.shape == (m, n) and y.dtype == dtype
            assert _rel(y, x, exact) < TOL[dtype], (fmt, m, n, k, _rel(y, x, exact))
            assert fmt != "w4a16t" or torch.equal(y, rows), (m, n, k, "tiled != rows")
            # out= a column block of a wider buffer, poisoned around it
            big = torch.full((m, n + 16), float("nan"), dtype=dtype, device=device)
            assert qgemm(q, x, s, fmt, impl="triton", out=big[:, 8:8 + n], config=config) is not None
            assert torch.equal(big[:, 8:8 + n], y) and big[:, :8].isnan().all() and big[:, 8 + n:].isnan().all()


SMALL = [(1, 16, 128), (9, 64, 256), (17, 200, 384), (33, 130, 200), (70, 96, 512), (130, 48, 256)]


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and Triton")
def test_kernel_interpreter():
    _check_kernel("cpu", torch.float16, SMALL)  # (K split where the tiles are few: the interpreter has 8 "SMs")
    _check_kernel("cpu", torch.float16, SMALL[:3], ("w4a16", "w4a16t"), dict(UNPACK=1, SPLIT_K=1))
    _check_kernel("cpu", torch.float16, SMALL[3:], ("w4a16", "w4a16t"), dict(UNPACK=1, SPLIT_K=3))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_gpu(requires_gpus, dtype):
    requires_gpus(1)
    # tails, then Llama-3.1-8B's projections at decode batches past gemv's 8 rows and at a prefill
    _check_kernel("cuda", dtype, SMALL + [(16, 6144, 4096), (64, 28672, 4096), (100, 4096, 14336),
                                          (1024, 4096, 4096), (777, 1000, 1152)])
    _check_kernel("cuda", dtype, [(16, 6144, 4096), (300, 1008, 1152)], ("w4a16", "w4a16t"), dict(UNPACK=1))
    _check_kernel("cuda", dtype, [(40, 4096, 4096)], config=dict(SPLIT_K=5))  # a split count not dividing K


@pytest.mark.gpu
def test_kernel_in_a_cuda_graph(requires_gpus):
    requires_gpus(1)
    q, s, x, exact = _case("w4a16", 24, 512, 1024, torch.bfloat16, "cuda")
    y = qgemm(q, x, s, "w4a16")  # auto: the kernel
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = qgemm(q, x, s, "w4a16")
    x.copy_(torch.randn(24, 1024, device="cuda").bfloat16())  # new inputs, replayed
    g.replay()
    assert not torch.equal(out, y) and _rel(out, x, exact) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_remembered_calls_change_shape_format_and_out(requires_gpus):
    # Eager calls remember their checks (a repeated call skips them): back-to-back calls that change the format,
    # the rows, the dtype, a 1-D x, out= and impl each give their own result, and an out= overlapping x is still
    # refused after the same geometry was remembered without it.
    requires_gpus(1)
    cases = [("w4a16", 24, torch.bfloat16), ("w8a16", 24, torch.bfloat16), ("w4a16", 100, torch.bfloat16),
             ("w4a16", 24, torch.float16), ("w4a16", 24, torch.bfloat16)]
    for rnd in range(2):
        for i, (fmt, m, dtype) in enumerate(cases):
            q, s, x, exact = _case(fmt, m, 512, 1024, dtype, "cuda", seed=10 * rnd + i)
            for impl in ("auto", "triton", "reference"):
                assert _rel(qgemm(q, x, s, fmt, impl), x, exact) < TOL[dtype], (rnd, fmt, m, dtype, impl)
            y = qgemm(q, x[0], s, fmt)
            assert y.shape == (512,) and _rel(y[None], x[:1], exact) < TOL[dtype]
            out = torch.full((m, 600), float("nan"), device="cuda", dtype=dtype)
            assert qgemm(q, x, s, fmt, out=out[:, 44:556]) is not None
            assert _rel(out[:, 44:556], x, exact) < TOL[dtype] and out[:, :44].isnan().all()
    q, s, x, _ = _case("w4a16", 8, 512, 1024, torch.bfloat16, "cuda")
    # (column blocks of one buffer count as overlapping: check_no_overlap compares address ranges)
    a, b = (torch.empty(8 * 1024 + 8 * 512, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    xa, xb = a[:8192].view(8, 1024), b[:8192].view(8, 1024)
    xa.copy_(x)
    xb.copy_(x)
    qgemm(q, xa, s, "w4a16", out=a[8192:].view(8, 512))  # remembered: x and out views of one buffer, apart
    with pytest.raises(ValueError, match="qgemm: out overlaps x"):  # the same geometry, out overlapping x
        qgemm(q, xb, s, "w4a16", out=b[4096:8192].view(8, 512))

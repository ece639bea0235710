"""GEMM: the reference against float64, argument checks, the custom op, and the Triton kernels (GPU; and
the CPU interpreter when TRITON_INTERPRET=1 with Triton installed)."""
import importlib.util
import os
import random

import pytest
import torch

from xelink.kernels.gemm import GEMM_IMPLS, gemm, reference_gemm

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON
TOL = {torch.bfloat16: 8e-3, torch.float16: 1e-3}


def _operand(rows, cols, dtype, row_major, device="cpu", gen=None):
    if row_major:
        return torch.randn(rows, cols, generator=gen, device=device).to(dtype)
    return torch.randn(cols, rows, generator=gen, device=device).to(dtype).T


def _relerr(out, a, b):
    ref = a.double() @ b.double()
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 5, 3), (33, 17, 65)])
@pytest.mark.parametrize("layout", ["rr", "rc", "cr", "cc"])
def test_reference_matches_float64(dtype, shape, layout):
    M, N, K = shape
    a = _operand(M, K, dtype, layout[0] == "r")
    b = _operand(K, N, dtype, layout[1] == "r")
    out = reference_gemm(a, b)
    assert out.shape == (M, N) and out.dtype == dtype
    assert _relerr(out, a, b) < TOL[dtype]
    auto = gemm(a, b)  # CPU tensors: auto is the reference
    assert torch.equal(auto, out)


def test_empty_and_zero_k():
    a = torch.randn(0, 4, dtype=torch.bfloat16)
    assert gemm(a, torch.randn(4, 3, dtype=torch.bfloat16)).shape == (0, 3)
    out = gemm(torch.randn(2, 0, dtype=torch.bfloat16), torch.randn(0, 3, dtype=torch.bfloat16), impl="reference")
    assert torch.equal(out, torch.zeros(2, 3, dtype=torch.bfloat16))


@pytest.mark.parametrize("a, b, impl, error, match", [
    ("x", None, "auto", TypeError, "gemm: a must be a torch.Tensor"),
    (torch.ones(2, 3), torch.ones(3, 2), "auto", TypeError, r"gemm: a.dtype=torch.float32"),
    (torch.ones(2, 3, dtype=torch.bfloat16), torch.ones(3, 2, dtype=torch.float16), "auto", TypeError,
     r"gemm: b.dtype=torch.float16 must equal a.dtype=torch.bfloat16"),
    (torch.ones(2, 3, dtype=torch.bfloat16), torch.ones(4, 2, dtype=torch.bfloat16), "auto", ValueError,
     r"gemm: a.shape\[1\]=3 != b.shape\[0\]=4"),
    (torch.ones(2, 3, 1, dtype=torch.bfloat16), torch.ones(3, 2, dtype=torch.bfloat16), "auto", ValueError,
     "gemm: a and b must be 2-D"),
    (torch.ones(2, 3, dtype=torch.bfloat16), torch.ones(3, 2, dtype=torch.bfloat16), "fast", ValueError,
     "gemm: impl='fast' is not one of auto, triton, hopper, reference"),
    (torch.ones(2, 3, dtype=torch.bfloat16), torch.ones(3, 2, dtype=torch.bfloat16), 3, TypeError,
     "gemm: impl=3 must be a str"),
])
def test_bad_arguments(a, b, impl, error, match):
    with pytest.raises(error, match=match):
        gemm(a, b, impl=impl)


@pytest.mark.skipif(INTERPRET, reason="the interpreter runs Triton on CPU tensors")
@pytest.mark.parametrize("impl", ["triton", "hopper"])
def test_triton_impl_on_cpu_is_refused(impl):
    a = torch.ones(2, 8, dtype=torch.bfloat16)
    with pytest.raises((RuntimeError, ValueError), match=f"gemm: impl='{impl}'"):
        gemm(a, torch.ones(8, 8, dtype=torch.bfloat16), impl=impl)


def test_custom_op_fake_and_compile():
    a, b = torch.randn(5, 7, dtype=torch.bfloat16), torch.randn(7, 3, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.xelink.gemm.default, (a, b, "reference"),
                          test_utils=("test_schema", "test_faketensor"))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fa, fb = torch.empty(9, 4, dtype=torch.float16), torch.empty(4, 6, dtype=torch.float16)
        assert torch.ops.xelink.gemm(fa, fb, "triton").shape == (9, 6)
    assert set(GEMM_IMPLS) == {"auto", "triton", "hopper", "reference"}


@pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("impl", ["triton", "hopper"])
@pytest.mark.parametrize("layout", ["rr", "cc"])
def test_interpreted_kernels(impl, layout):
    # fp16 only: the interpreter's bf16 dot is wrong (Triton 3.6 + numpy); bf16 runs in the GPU tests.
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=1, num_stages=1)
    for M, N, K in [(1, 8, 8), (16, 16, 16), (40, 24, 56)] + ([(33, 17, 9)] if impl == "triton" else []):
        a = _operand(M, K, torch.float16, layout[0] == "r")
        b = _operand(K, N, torch.float16, layout[1] == "r")
        assert _relerr(gemm(a, b, impl=impl, config=cfg), a, b) < TOL[torch.float16]


# -- GPU ------------------------------------------------------------------------------------------------

def _poison_allocator(nbytes: int, device="cuda"):
    # The caching allocator hands freed blocks back to the next torch.empty of that size: the kernel's
    # output then starts as NaN, so an element it fails to write shows up.
    torch.full((nbytes // 4 + 1024,), float("nan"), device=device)


# Shapes every path takes (TMA needs 16-byte strides: dims that are strides in some layout are multiples
# of 8, or the dim is 1), and shapes only the portable path takes.
GPU_SHAPES = [(1, 8, 8), (64, 64, 64), (200, 264, 136), (136, 1032, 520), (1000, 136, 2056)]
ODD_SHAPES = [(1, 1, 1), (33, 17, 9), (300, 5, 77), (129, 1032, 520), (130, 259, 1031)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("impl", ["triton", "hopper"])
@pytest.mark.parametrize("layout", ["rr", "rc", "cr", "cc"])
def test_gpu_kernels_match_reference(requires_gpus, dtype, impl, layout):
    requires_gpus(1)
    if impl == "hopper" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("hopper path needs compute capability 9.x")
    seed = random.SystemRandom().randrange(2**31)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = GPU_SHAPES + (ODD_SHAPES if impl == "triton" else [])
    for M, N, K in shapes:
        a = _operand(M, K, dtype, layout[0] == "r", "cuda", gen)
        b = _operand(K, N, dtype, layout[1] == "r", "cuda", gen)
        _poison_allocator(M * N * 2)
        out = gemm(a, b, impl=impl)
        torch.cuda.synchronize()
        assert not out.isnan().any(), f"unwritten output at {M}x{N}x{K} (seed {seed})"
        err = _relerr(out, a, b)
        assert err < TOL[dtype], f"{impl} {layout} {M}x{N}x{K} {dtype}: rel err {err:.2e} (seed {seed})"
        ref_err = float((out.float() - reference_gemm(a, b).float()).norm() / reference_gemm(a, b).float().norm())
        assert ref_err < TOL[dtype]


@pytest.mark.gpu
def test_gpu_hopper_refuses_unaligned_strides(requires_gpus):
    requires_gpus(1)
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("hopper path needs compute capability 9.x")
    a = torch.randn(520, 129, device="cuda", dtype=torch.bfloat16).T  # column-major, 258-byte columns
    b = torch.randn(520, 1032, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="gemm: impl='hopper' needs"):
        gemm(a, b, impl="hopper")
    assert _relerr(gemm(a, b), a, b) < TOL[torch.bfloat16]  # auto takes the portable kernel


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "hopper"])
def test_gpu_large_tiles_and_graph_capture(requires_gpus, impl):
    requires_gpus(1)
    if impl == "hopper" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("hopper path needs compute capability 9.x")
    a = torch.randn(1536, 1024, device="cuda", dtype=torch.bfloat16)  # 128x256 tiles, persistent waves
    b = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
    assert _relerr(gemm(a, b, impl=impl), a, b) < TOL[torch.bfloat16]
    out = gemm(a, b, impl=impl)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemm(a, b, impl=impl)
    a.copy_(torch.randn_like(a))
    graph.replay()
    torch.cuda.synchronize()
    assert _relerr(out, a, b) < TOL[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_auto_and_compile(requires_gpus):
    requires_gpus(1)
    a = torch.randn(96, 80, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(80, 48, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(lambda x, y: gemm(x, y) * 2, fullgraph=True, backend="aot_eager")
    assert _relerr(compiled(a, b) / 2, a, b) < TOL[torch.bfloat16]

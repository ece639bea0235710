"""GEMM: the reference against float64, argument checks (out= and pdl= included), the custom op, and the
Triton kernels (GPU; and the CPU interpreter when TRITON_INTERPRET=1 with Triton installed)."""
import importlib
import importlib.util
import os
import random

import pytest
import torch

from xelink.kernels.common import TensorDescriptor
from xelink.kernels.gemm import GEMM_IMPLS, gemm, reference_gemm

from out_blocks import only_block_written, poisoned

gemm_module = importlib.import_module("xelink.kernels.gemm")  # xelink.kernels.gemm is also the function's name
HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON
TOL = {torch.bfloat16: 8e-3, torch.float16: 1e-3}
# The TMA kernel needs Triton's host tensor descriptors (NVIDIA's Triton; Intel's 3.3 has none).
needs_descriptors = pytest.mark.skipif(TensorDescriptor is None, reason="this Triton has no host tensor descriptors")


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
     "gemm: impl='fast' is not one of auto, triton, cuda, reference"),
    (torch.ones(2, 3, dtype=torch.bfloat16), torch.ones(3, 2, dtype=torch.bfloat16), 3, TypeError,
     "gemm: impl=3 must be a str"),
])
def test_bad_arguments(a, b, impl, error, match):
    with pytest.raises(error, match=match):
        gemm(a, b, impl=impl)


@pytest.mark.skipif(INTERPRET, reason="the interpreter runs Triton on CPU tensors")
@pytest.mark.parametrize("impl, named", [("triton", "triton"), ("cuda", "cuda"), ("hopper", "cuda")])
def test_triton_impl_on_cpu_is_refused(impl, named):
    a = torch.ones(2, 8, dtype=torch.bfloat16)
    with pytest.raises((RuntimeError, ValueError), match=f"gemm: impl='{named}'"):
        gemm(a, torch.ones(8, 8, dtype=torch.bfloat16), impl=impl)


def test_custom_op_fake_and_compile():
    a, b = torch.randn(5, 7, dtype=torch.bfloat16), torch.randn(7, 3, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.xelink.gemm.default, (a, b, "reference", "off", torch.empty(5, 3, dtype=a.dtype)),
                          test_utils=("test_schema", "test_faketensor"))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fa, fb = torch.empty(9, 4, dtype=torch.float16), torch.empty(4, 6, dtype=torch.float16)
        assert torch.ops.xelink.gemm(fa, fb, "triton", "off", torch.empty(9, 6, dtype=torch.float16)) is None
    assert set(GEMM_IMPLS) == {"auto", "triton", "cuda", "reference"}


@pytest.mark.parametrize("where", ["rows", "cols"])
def test_out_writes_only_its_block(where):
    # CPU: the reference path copies into out; the rest of the larger buffer stays untouched.
    a, b = torch.randn(6, 16).to(torch.bfloat16), torch.randn(16, 5).to(torch.bfloat16)
    big = poisoned(10, 9)
    block = big[3:9, :5] if where == "rows" else big[2:8, 3:8]
    assert gemm(a, b, out=block) is block
    assert torch.equal(block, reference_gemm(a, b))
    only_block_written(big, block)


_A, _B = torch.ones(4, 8, dtype=torch.bfloat16), torch.ones(8, 6, dtype=torch.bfloat16)


@pytest.mark.parametrize("out, error, match", [
    ("x", TypeError, "gemm: out must be a torch.Tensor, got str"),
    (torch.empty(4, 5, dtype=torch.bfloat16), ValueError, r"gemm: out.shape=\(4, 5\) must be \(4, 6\)"),
    (torch.empty(4, 6, dtype=torch.float16), TypeError, "gemm: out.dtype=torch.float16 must be torch.bfloat16"),
    (torch.empty(4, 6, dtype=torch.bfloat16, device="meta"), ValueError, "gemm: out is on meta, the inputs on cpu"),
    (torch.empty(6, 4, dtype=torch.bfloat16).T, ValueError, r"gemm: out.stride\(\)=\(1, 4\) must be 1 along the last"),
    (torch.empty(1, 6, dtype=torch.bfloat16).expand(4, 6), ValueError, "puts several elements at one address"),
    (_A[:, :6], ValueError, "gemm: out overlaps a in memory"),
])
def test_bad_out(out, error, match):
    with pytest.raises(error, match=match):
        gemm(_A, _B, out=out)


def test_pdl_is_checked():
    for bad in ("soon", 1, "EARLY"):
        with pytest.raises(ValueError, match=f"gemm: pdl={bad!r} must be None, True, False, 'early' or 'late'"):
            gemm(_A, _B, pdl=bad)
    for want in (True, "early", "late"):  # PDL is a CUDA sm90 launch: refused on the CPU, even by the reference
        with pytest.raises(ValueError, match="gemm: pdl=.* needs a Triton kernel on a CUDA GPU"):
            gemm(_A, _B, pdl=want)
    for off in (None, False):
        assert torch.equal(gemm(_A, _B, pdl=off), reference_gemm(_A, _B))


def test_compiled_out_goes_through_the_custom_op():
    a, b = torch.randn(6, 8).to(torch.bfloat16), torch.randn(8, 4).to(torch.bfloat16)
    big = poisoned(10, 6)
    compiled = torch.compile(lambda x, y, o: gemm(x, y, out=o), backend="aot_eager", fullgraph=True)
    compiled(a, b, big[2:8, 1:5])
    assert torch.equal(big[2:8, 1:5], reference_gemm(a, b))
    only_block_written(big, big[2:8, 1:5])


@pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("impl", ["triton", pytest.param("cuda", marks=needs_descriptors)])
@pytest.mark.parametrize("layout", ["rr", "cc"])
def test_interpreted_kernels(impl, layout):
    # fp16 only: the interpreter's bf16 dot is wrong (Triton 3.6 + numpy); bf16 runs in the GPU tests.
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=1, num_stages=1)
    for M, N, K in [(1, 8, 8), (16, 16, 16), (40, 24, 56)] + ([(33, 17, 9)] if impl == "triton" else []):
        a = _operand(M, K, torch.float16, layout[0] == "r")
        b = _operand(K, N, torch.float16, layout[1] == "r")
        assert _relerr(gemm(a, b, impl=impl, config=cfg), a, b) < TOL[torch.float16]


@pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("impl", ["triton", pytest.param("cuda", marks=needs_descriptors)])
@pytest.mark.parametrize("where", ["rows", "cols"])
def test_interpreted_out_blocks(impl, where):
    # The kernels store into a row block or a column block of a poisoned buffer: that block only. The
    # column block starts 8 elements (16 bytes) in, so TMA's alignment holds for impl="cuda".
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=1, num_stages=1)
    M, N, K = 24, 24, 32
    a, b = _operand(M, K, torch.float16, True), _operand(K, N, torch.float16, True)
    big = poisoned(40, 40, dtype=torch.float16)
    block = big[8:8 + M, :N] if where == "rows" else big[3:3 + M, 8:8 + N]
    assert gemm(a, b, impl=impl, out=block, config=cfg) is block
    only_block_written(big, block)
    assert _relerr(block, a, b) < TOL[torch.float16]


# -- GPU ------------------------------------------------------------------------------------------------

def _need_sm90(impl):
    if impl == "cuda" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("impl='cuda' (the TMA kernel) needs compute capability 9.x")


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
@pytest.mark.parametrize("impl", ["triton", "cuda"])
@pytest.mark.parametrize("layout", ["rr", "rc", "cr", "cc"])
def test_gpu_kernels_match_reference(requires_gpus, dtype, impl, layout):
    requires_gpus(1)
    _need_sm90(impl)
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
def test_gpu_cuda_refuses_unaligned_strides(requires_gpus):
    requires_gpus(1)
    _need_sm90("cuda")
    a = torch.randn(520, 129, device="cuda", dtype=torch.bfloat16).T  # column-major, 258-byte columns
    b = torch.randn(520, 1032, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="gemm: impl='cuda' needs"):
        gemm(a, b, impl="cuda")
    assert _relerr(gemm(a, b), a, b) < TOL[torch.bfloat16]  # auto takes the portable kernel


@pytest.mark.gpu
def test_gpu_hopper_alias_is_the_cuda_kernel(requires_gpus):
    requires_gpus(1)
    _need_sm90("cuda")
    a = torch.randn(300, 264, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(264, 520, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(gemm(a, b, impl="hopper"), gemm(a, b, impl="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "cuda", "auto"])
@pytest.mark.parametrize("where", ["rows", "cols"])
def test_gpu_out_blocks(requires_gpus, impl, where):
    # out= a row block (rows 8..) or a column block (columns 16..) of a poisoned bf16 buffer 1048 wide:
    # base and row stride stay 16-byte aligned, so the TMA kernel takes it (and auto picks it on sm90).
    requires_gpus(1)
    _need_sm90(impl)
    for M, N, K in [(1, 8, 8), (200, 264, 136), (136, 1032, 520)]:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        big = poisoned(M + 24, 1048, device="cuda")
        block = big[8:8 + M, :N] if where == "rows" else big[3:3 + M, 16:16 + N]
        if impl == "auto" and torch.cuda.get_device_capability()[0] == 9:
            assert gemm_module._pick_gemm_impl(a, b, "auto", block) == "cuda"
        assert gemm(a, b, impl=impl, out=block) is block
        torch.cuda.synchronize()
        only_block_written(big, block)
        assert _relerr(block, a, b) < TOL[torch.bfloat16], f"{impl} {where} {M}x{N}x{K}"


@pytest.mark.gpu
def test_gpu_unaligned_out_takes_the_portable_kernel(requires_gpus):
    # A column block one element in (a base 2 bytes off 16) and a buffer 1041 wide (row stride 2082 bytes):
    # TMA cannot store there, so auto takes the portable kernel and impl="cuda" refuses.
    requires_gpus(1)
    a = torch.randn(200, 136, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(136, 264, device="cuda", dtype=torch.bfloat16)
    for width, col in [(1048, 1), (1041, 0)]:
        big = poisoned(216, width, device="cuda")
        block = big[8:208, col:col + 264]
        assert gemm_module._pick_gemm_impl(a, b, "auto", block) == "triton"
        gemm(a, b, out=block)
        torch.cuda.synchronize()
        only_block_written(big, block)
        assert _relerr(block, a, b) < TOL[torch.bfloat16]
        if torch.cuda.get_device_capability()[0] == 9:
            with pytest.raises(ValueError, match="gemm: impl='cuda' stores through TMA, which needs out at a 16-byte"):
                gemm(a, b, impl="cuda", out=block)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_gpu_out_graph_capture_and_replay(requires_gpus, impl):
    # gemm(out=) captured into a CUDA graph writes the same block again on replay, from the new inputs.
    requires_gpus(1)
    _need_sm90(impl)
    a = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    big = poisoned(1024, 512, device="cuda")
    block = big[256:768, 64:448]
    gemm(a, b, impl=impl, out=block)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm(a, b, impl=impl, out=block)
    for _ in range(2):
        a.copy_(torch.randn_like(a))
        b.copy_(torch.randn_like(b))
        block.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        only_block_written(big, block)
        assert _relerr(block, a, b) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_gpu_pdl_chain(requires_gpus, impl):
    # Each GEMM reads the one before's output: with programmatic dependent launch a kernel that read a or b
    # before its griddepcontrol.wait would see stale or poisoned values. Every pdl value, eager and in a CUDA
    # graph, must give the chain without it bit for bit.
    requires_gpus(1)
    _need_sm90(impl)
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0")
    ws = [torch.randn(512, 512, device="cuda", dtype=torch.bfloat16) / 512 ** 0.5 for _ in range(4)]
    x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)

    def chain(pdl):
        ys, y = [], x
        for w in ws:
            y = gemm(y, w, impl=impl, pdl=pdl)
            ys.append(y)
        return ys

    plain = chain(False)
    for pdl in (True, "early", "late"):
        _poison_allocator(8 << 20)
        assert all(torch.equal(g, p) for g, p in zip(chain(pdl), plain)), f"eager pdl={pdl}"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ys = chain(pdl)
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(g, p) for g, p in zip(ys, plain)), f"graph pdl={pdl}"


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_gpu_large_tiles_and_graph_capture(requires_gpus, impl):
    requires_gpus(1)
    _need_sm90(impl)
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

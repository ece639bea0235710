"""RMSNorm (+ fused residual, out=), RoPE, rope_kv (RoPE + KV-cache write) and silu_mul: references against
float64, argument checks, custom ops, and the Triton kernels (GPU: every dtype, tails, wide rows, cos/sin layouts;
CPU interpreter with TRITON_INTERPRET=1)."""
import importlib.util
import os
import random

import pytest
import torch

from xelink.kernels import norm as norm_module
from xelink.kernels.norm import (reference_rmsnorm, reference_rope_kv, reference_silu_mul, rmsnorm,
                                 rope, rope_kv, silu_mul)

from out_blocks import only_block_written, poisoned

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON
TOL = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-5}


def _rel(out, ref):
    ref = ref.double()
    return float((out.double() - ref).norm() / ref.norm())


def _rms64(x, w, eps):
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _rope64(x, cos, sin):
    c, s = norm_module._cos_sin_4d(cos).double(), norm_module._cos_sin_4d(sin).double()
    half = x.shape[-1] // 2
    x = x.double()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c[..., :half] - x2 * s[..., :half], x2 * c[..., half:] + x1 * s[..., half:]), dim=-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (2, 3, 64)])
def test_rmsnorm_reference_matches_float64(dtype, shape):
    x, w, r = torch.randn(shape).to(dtype), torch.randn(shape[-1]), torch.randn(shape).to(dtype)
    out = rmsnorm(x, w, 1e-5)  # CPU: auto is the reference
    assert out.shape == x.shape and out.dtype == dtype
    assert _rel(out, _rms64(x, w, 1e-5)) < TOL[dtype]
    out2, h = rmsnorm(x, w, 1e-5, residual=r)
    assert torch.equal(h, (x.float() + r.float()).to(dtype))
    assert _rel(out2, _rms64(h, w, 1e-5)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cos_shape", ["SD", "BSD", "1SD", "B1SD"])
def test_rope_reference_matches_float64(dtype, cos_shape):
    B, HQ, HK, S, D = 2, 4, 2, 5, 8
    q, k = torch.randn(B, HQ, S, D).to(dtype), torch.randn(B, HK, S, D).to(dtype)
    shape = {"SD": (S, D), "BSD": (B, S, D), "1SD": (1, S, D), "B1SD": (B, 1, S, D)}[cos_shape]
    cos, sin = torch.randn(shape), torch.randn(shape)
    qo, ko = rope(q, k, cos, sin)
    assert qo.shape == q.shape and ko.shape == k.shape and qo.dtype == dtype
    assert _rel(qo, _rope64(q, cos, sin)) < TOL[dtype] and _rel(ko, _rope64(k, cos, sin)) < TOL[dtype]
    # rotate-half: with cos = 1, sin = 0 RoPE is the identity; with cos = 0, sin = 1 it maps (x1, x2) -> (-x2, x1)
    qi, _ = rope(q, k, torch.ones(S, D), torch.zeros(S, D))
    assert torch.equal(qi, q)
    qr, _ = rope(q, k, torch.zeros(S, D), torch.ones(S, D))
    assert torch.equal(qr, torch.cat((-q[..., D // 2:], q[..., :D // 2]), dim=-1))


X = torch.ones(2, 8)
Q, K = torch.ones(1, 2, 3, 8), torch.ones(1, 1, 3, 8)


@pytest.mark.parametrize("call, error, match", [
    (lambda: rmsnorm(X.int(), torch.ones(8)), TypeError, r"rmsnorm: x.dtype=torch.int32"),
    (lambda: rmsnorm(X, torch.ones(7)), ValueError, r"rmsnorm: w.shape=\(7,\) must be \(8,\)"),
    (lambda: rmsnorm(X, torch.ones(8), eps=-1.0), ValueError, "rmsnorm: eps=-1.0 must be a float >= 0"),
    (lambda: rmsnorm(X, torch.ones(8), residual=torch.ones(2, 7)), ValueError,
     r"rmsnorm: residual.shape=\(2, 7\) != x.shape=\(2, 8\)"),
    (lambda: rmsnorm(X, torch.ones(8), residual=X.half()), TypeError, "rmsnorm: residual.dtype=torch.float16"),
    (lambda: rmsnorm(X, torch.ones(8), impl="cuda"), ValueError,
     r"rmsnorm: impl='cuda' is not one of auto, triton, reference \(rmsnorm has no cuda kernel\)"),
    (lambda: rope(Q, K, torch.ones(3, 8), torch.ones(3, 8), impl="hopper"), ValueError,
     "rope: impl='hopper' is not one of auto, triton, reference"),
    (lambda: rmsnorm(X, torch.ones(8), out=torch.empty(2, 7)), ValueError,
     r"rmsnorm: out.shape=\(2, 7\) must be \(2, 8\)"),
    (lambda: rmsnorm(X, torch.ones(8), out=X.half()), TypeError, "rmsnorm: out.dtype=torch.float16 must be"),
    (lambda: rmsnorm(X, torch.ones(8), out=torch.empty(2, 8, device="meta")), ValueError, "rmsnorm: out is on meta"),
    (lambda: rmsnorm(X, torch.ones(8), out=torch.empty(8, 2).T), ValueError, "must be 1 along the last dim"),
    (lambda: rmsnorm(torch.ones(2, 3, 8), torch.ones(8), out=torch.empty(2, 4, 8)[:, :3]), ValueError,
     r"must let out be viewed as rows \[-1, H\]"),
    (lambda: rmsnorm(X, torch.ones(8), residual=X.clone(), out=X), ValueError, "rmsnorm: out overlaps x in memory"),
    (lambda: rmsnorm([1.0], torch.ones(8)), TypeError, "rmsnorm: x must be a torch.Tensor"),
    (lambda: rope(Q, K.half(), torch.ones(3, 8), torch.ones(3, 8)), TypeError, "rope: k.dtype=torch.float16"),
    (lambda: rope(Q[0], K, torch.ones(3, 8), torch.ones(3, 8)), ValueError, "rope: q and k must be"),
    (lambda: rope(Q, torch.ones(1, 1, 4, 8), torch.ones(3, 8), torch.ones(3, 8)), ValueError,
     r"rope: k.shape=\(1, 1, 4, 8\) must match"),
    (lambda: rope(Q[..., :7], K[..., :7], torch.ones(3, 7), torch.ones(3, 7)), ValueError,
     "rope: head dim D=7 must be even"),
    (lambda: rope(Q, K, torch.ones(4, 8), torch.ones(3, 8)), ValueError, r"rope: cos.shape=\(4, 8\) must be"),
    (lambda: rope(Q, K, torch.ones(3, 8), torch.ones(2, 3, 8)), ValueError, r"rope: sin.shape=\(2, 3, 8\)"),
    (lambda: rope(Q, K, torch.ones(3, 8, dtype=torch.int32), torch.ones(3, 8)), TypeError,
     "rope: cos.dtype=torch.int32"),
])
def test_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.skipif(INTERPRET, reason="the interpreter runs Triton on CPU tensors")
def test_triton_impl_on_cpu_is_refused():
    with pytest.raises((RuntimeError, ValueError), match="rmsnorm: impl='triton'"):
        rmsnorm(X, torch.ones(8), impl="triton")
    with pytest.raises((RuntimeError, ValueError), match="rope: impl='triton'"):
        rope(Q, K, torch.ones(3, 8), torch.ones(3, 8), impl="triton")


def test_pdl_is_checked_before_running():
    # Programmatic dependent launch exists on CUDA sm90+ only: asking for it elsewhere is an error, a
    # bad value is an error everywhere; the default (None) and False run.
    for bad in ("soon", 1, "EARLY"):
        with pytest.raises(ValueError, match=f"rmsnorm: pdl={bad!r} must be"):
            rmsnorm(X, torch.ones(8), pdl=bad)
        with pytest.raises(ValueError, match=f"rope: pdl={bad!r} must be"):
            rope(Q, K, torch.ones(3, 8), torch.ones(3, 8), pdl=bad)
    for want in (True, "early", "late"):
        with pytest.raises(ValueError, match="rmsnorm: pdl=.* needs a Triton kernel on a CUDA GPU"):
            rmsnorm(X, torch.ones(8), pdl=want)
        with pytest.raises(ValueError, match="rope: pdl=.* needs a Triton kernel on a CUDA GPU"):
            rope(Q, K, torch.ones(3, 8), torch.ones(3, 8), pdl=want)
    for off in (None, False):
        torch.testing.assert_close(rmsnorm(X, torch.ones(8), pdl=off), reference_rmsnorm(X, torch.ones(8)))
        torch.testing.assert_close(rope(Q, K, torch.ones(3, 8), torch.zeros(3, 8), pdl=off), (Q, K))


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("where", ["rows", "cols"])
def test_rmsnorm_out_writes_only_its_block(residual, where):
    # CPU: the reference path copies the normalized rows into out (a row or column block of a poisoned
    # buffer); the new residual is returned as a new tensor. torch.compile goes through the custom ops.
    x, w = torch.randn(3, 16).to(torch.bfloat16), torch.randn(16)
    r = torch.randn(3, 16).to(torch.bfloat16) if residual else None
    want = reference_rmsnorm(x, w, 1e-6, r)

    def check(fn):
        big = poisoned(6, 24)
        block = big[2:5, :16] if where == "rows" else big[1:4, 5:21]
        got = fn(x, r, block)
        out, h = got if residual else (got, None)
        assert out is block and torch.equal(out, want[0] if residual else want)
        only_block_written(big, block)
        if residual:
            assert torch.equal(h, want[1])

    check(lambda a, res, o: rmsnorm(a, w, residual=res, out=o))
    check(torch.compile(lambda a, res, o: rmsnorm(a, w, residual=res, out=o), backend="aot_eager", fullgraph=True))


def test_fake_impls():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(4, 6, 32, dtype=torch.bfloat16)
        assert torch.ops.xelink.rmsnorm(x, torch.empty(32), 1e-6, "triton", "off", torch.empty_like(x)) is None
        h = torch.ops.xelink.rmsnorm_residual(x, x, torch.empty(32), 1e-6, "triton", "auto", torch.empty_like(x))
        assert h.shape == x.shape
        qo, ko = torch.ops.xelink.rope(torch.empty(1, 4, 5, 16), torch.empty(1, 2, 5, 16), torch.empty(5, 16),
                                       torch.empty(5, 16), "triton", "late")
        assert qo.shape == (1, 4, 5, 16) and ko.shape == (1, 2, 5, 16)


@pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_interpreted_kernels(dtype, monkeypatch):
    x, r, w = torch.randn(3, 40).to(dtype), torch.randn(3, 40).to(dtype), torch.randn(40)
    assert _rel(rmsnorm(x, w, 1e-6, impl="triton"), _rms64(x, w, 1e-6)) < TOL[dtype]
    out, h = rmsnorm(x, w, 1e-6, residual=r, impl="triton")
    assert torch.equal(h, (x.float() + r.float()).to(dtype)) and _rel(out, _rms64(h, w, 1e-6)) < TOL[dtype]
    monkeypatch.setattr(norm_module, "_ONE_PASS_MAX", 16)  # the two-pass path for wide rows
    out, h = rmsnorm(x, w, 1e-6, residual=r, impl="triton")
    assert torch.equal(h, (x.float() + r.float()).to(dtype)) and _rel(out, _rms64(h, w, 1e-6)) < TOL[dtype]
    for one_pass in (16, 16384):  # out= a row block and a column block, both passes
        monkeypatch.setattr(norm_module, "_ONE_PASS_MAX", one_pass)
        for where in ("rows", "cols"):
            big = poisoned(6, 56, dtype=dtype)
            block = big[2:5, :40] if where == "rows" else big[1:4, 9:49]
            out, h = rmsnorm(x, w, 1e-6, residual=r, impl="triton", out=block)
            assert out is block and torch.equal(h, (x.float() + r.float()).to(dtype))
            only_block_written(big, block)
            assert _rel(out, _rms64(h, w, 1e-6)) < TOL[dtype]
    q, k = torch.randn(2, 3, 5, 12).to(dtype), torch.randn(2, 1, 5, 12).to(dtype)
    cos, sin = torch.randn(2, 5, 12), torch.randn(1, 5, 12)
    qo, ko = rope(q, k, cos, sin, impl="triton")
    assert _rel(qo, _rope64(q, cos, sin)) < TOL[dtype] and _rel(ko, _rope64(k, cos, sin)) < TOL[dtype]


def _check_decode_fusions(device, dtype, impl, cases=((1, 4, 2, 8, 16), (3, 32, 8, 40, 128), (2, 6, 3, 9, 96))):
    """rope_kv against float64 RoPE at per-sequence positions (only those cache slots written, the rest
    untouched) and silu_mul against float64, for ``impl`` on ``device``."""
    g = torch.Generator().manual_seed(5)
    for B, HQ, HK, S, D in cases:
        qkv = torch.randn(B, HQ + 2 * HK, 1, D, generator=g).to(dtype).to(device)  # views of one projection
        q, k, v = qkv[:, :HQ], qkv[:, HQ:HQ + HK], qkv[:, HQ + HK:]
        cos, sin = torch.randn(S + 3, D, generator=g).to(device), torch.randn(S + 3, D, generator=g).to(device)
        kc = torch.full((B + 1, HK, S, D), float("nan"), dtype=dtype, device=device)
        vc = torch.full((B + 1, HK, S, D), float("nan"), dtype=dtype, device=device)
        pos = torch.randperm(S, generator=g)[:B].to(device)
        qo = rope_kv(q, k, v, cos, sin, pos, kc, vc, impl=impl)
        c, s_ = cos[pos.long()][:, None, None].cpu(), sin[pos.long()][:, None, None].cpu()
        assert _rel(qo.cpu(), _rope64(q.cpu(), c, s_)) < TOL[dtype], (B, HQ, HK, S, D)
        for b in range(B):
            p = int(pos[b])
            assert _rel(kc[b, :, p].cpu(), _rope64(k[b:b + 1].cpu(), c[b:b + 1], s_[b:b + 1])[0, :, 0]) < TOL[dtype]
            assert torch.equal(vc[b, :, p], v[b, :, 0])
            kc[b, :, p] = vc[b, :, p] = float("nan")
        assert kc.isnan().all() and vc.isnan().all(), "rope_kv wrote outside the token's slots"
        x = torch.randn(B, 3, 2 * D + 6, generator=g).to(dtype).to(device)
        got = silu_mul(x, impl=impl)
        g64, u64 = x.cpu().double().chunk(2, dim=-1)
        assert got.shape == (B, 3, D + 3) and _rel(got.cpu(), torch.nn.functional.silu(g64) * u64) < TOL[dtype]
        # out= a column block of a wider buffer: the same values, nothing else written
        big = torch.full((B, 3, D + 8), float("nan"), dtype=dtype, device=device)
        assert silu_mul(x, impl=impl, out=big[..., 2:D + 5]) is not None
        assert torch.equal(big[..., 2:D + 5], got) and big[..., :2].isnan().all() and big[..., D + 5:].isnan().all()


def test_decode_fusions_reference():
    for dtype in (torch.bfloat16, torch.float32):
        _check_decode_fusions("cpu", dtype, "reference")
    x = torch.randn(4, 10)
    assert torch.equal(reference_silu_mul(x), silu_mul(x))  # auto on the CPU: the reference
    with pytest.raises(ValueError, match="silu_mul: x.shape=.3,. must end in an even dimension"):
        silu_mul(torch.ones(3))
    with pytest.raises(ValueError, match=r"silu_mul: out.shape=\(4, 4\) must be \(4, 5\)"):
        silu_mul(x, out=torch.empty(4, 4))
    with pytest.raises(ValueError, match="silu_mul: out overlaps x"):
        silu_mul(x, out=x[:, :5])
    with pytest.raises(ValueError, match="silu_mul: out.stride.. = .* does not view as rows of 5|does not view"):
        silu_mul(torch.randn(2, 3, 10), out=torch.empty(3, 2, 5).transpose(0, 1))
    q, kv = torch.ones(1, 2, 1, 4), torch.ones(1, 1, 1, 4)
    cache = torch.zeros(1, 1, 5, 4)
    with pytest.raises(ValueError, match="rope_kv: positions must be"):
        rope_kv(q, kv, kv, torch.ones(5, 4), torch.ones(5, 4), torch.zeros(2, dtype=torch.int64), cache, cache)
    with pytest.raises(ValueError, match="rope_kv: k_cache must be"):
        rope_kv(q, kv, kv, torch.ones(5, 4), torch.ones(5, 4), torch.zeros(1, dtype=torch.int64), cache[:, :, :, :2],
                cache)
    with pytest.raises(TypeError, match="rope_kv: q, k, v, k_cache and v_cache must share one float dtype"):
        rope_kv(q, kv, kv, torch.ones(5, 4), torch.ones(5, 4), torch.zeros(1, dtype=torch.int64), cache.half(), cache)
    assert torch.equal(reference_rope_kv(q, kv, kv, torch.ones(5, 4), torch.zeros(5, 4), torch.tensor([3]), cache,
                                         cache), q) and cache[0, 0, 3].eq(1).all()


@pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_interpreted_decode_fusions(dtype):
    _check_decode_fusions("cpu", dtype, "triton", cases=((1, 4, 2, 8, 16), (2, 9, 3, 6, 12)))


# -- GPU ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_decode_fusions(requires_gpus, dtype):
    requires_gpus(1)
    _check_decode_fusions("cuda", dtype, "triton")


def _poison(nbytes: int):
    # The next torch.empty of this size reuses the freed NaN block: an unwritten output stays NaN.
    torch.full((nbytes // 4 + 4096,), float("nan"), device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("residual", [False, True])
def test_gpu_rmsnorm(requires_gpus, dtype, residual):
    requires_gpus(1)
    gen = torch.Generator(device="cuda").manual_seed(random.SystemRandom().randrange(2**31))
    for shape in [(1, 1), (3, 17), (5, 4096), (2, 3, 5000), (7, 8192), (2, 20000)]:
        x = torch.randn(shape, device="cuda", generator=gen).to(dtype)
        w = torch.randn(shape[-1], device="cuda", generator=gen)
        r = torch.randn(shape, device="cuda", generator=gen).to(dtype) if residual else None
        _poison(2 * x.numel() * x.element_size())
        got = rmsnorm(x, w, 1e-6, residual=r, impl="triton")
        torch.cuda.synchronize()
        out, h = got if residual else (got, x)
        assert not out.isnan().any() and not h.isnan().any(), f"unwritten output {shape} {dtype}"
        if residual:
            assert torch.equal(h, (x.float() + r.float()).to(dtype)), f"residual {shape} {dtype}"
        assert _rel(out, _rms64(h, w, 1e-6)) < TOL[dtype], f"{shape} {dtype}"
        ref = reference_rmsnorm(x, w, 1e-6, r)
        assert _rel(out, ref[0] if residual else ref) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_rope(requires_gpus, dtype):
    requires_gpus(1)
    gen = torch.Generator(device="cuda").manual_seed(random.SystemRandom().randrange(2**31))
    for B, HQ, HK, S, D in [(1, 2, 1, 5, 8), (2, 32, 8, 33, 128), (1, 3, 2, 100, 96), (2, 9, 17, 17, 256)]:
        q = torch.randn(B, HQ, S, D, device="cuda", generator=gen).to(dtype)
        k = torch.randn(B, HK, S, D, device="cuda", generator=gen).to(dtype)
        for shape in [(S, D), (B, S, D), (1, 1, S, D)]:
            cos = torch.randn(shape, device="cuda", generator=gen).to(dtype)
            sin = torch.randn(shape, device="cuda", generator=gen)
            _poison(2 * (q.numel() + k.numel()) * q.element_size())
            qo, ko = rope(q, k, cos, sin, impl="triton")
            torch.cuda.synchronize()
            assert not qo.isnan().any() and not ko.isnan().any(), f"unwritten output {B, HQ, HK, S, D} {shape}"
            assert _rel(qo, _rope64(q, cos, sin)) < TOL[dtype] and _rel(ko, _rope64(k, cos, sin)) < TOL[dtype]
    # non-contiguous q (a transposed view) goes through the strides
    qt = torch.randn(1, 5, 4, 64, device="cuda").to(dtype).transpose(1, 2)
    cos, sin = torch.randn(5, 64, device="cuda"), torch.randn(5, 64, device="cuda")
    qo, _ = rope(qt, qt[:, :1], cos, sin, impl="triton")
    assert _rel(qo, _rope64(qt, cos, sin)) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("residual", [False, True])
def test_gpu_rmsnorm_out_blocks(requires_gpus, residual):
    # out= a row block and a column block of a poisoned buffer, one-pass and two-pass rows, with PDL at
    # its default: only the block is written.
    requires_gpus(1)
    gen = torch.Generator(device="cuda").manual_seed(random.SystemRandom().randrange(2**31))
    for rows, H in [(1, 4096), (7, 5000), (3, 20000)]:
        x = torch.randn(rows, H, device="cuda", generator=gen).to(torch.bfloat16)
        w = torch.randn(H, device="cuda", generator=gen)
        r = torch.randn(rows, H, device="cuda", generator=gen).to(torch.bfloat16) if residual else None
        for where in ("rows", "cols"):
            big = poisoned(rows + 4, H + 24, device="cuda")
            block = big[2:2 + rows, :H] if where == "rows" else big[1:1 + rows, 9:9 + H]
            got = rmsnorm(x, w, 1e-6, residual=r, out=block)
            out, h = got if residual else (got, x)
            torch.cuda.synchronize()
            assert out is block
            only_block_written(big, block)
            if residual:
                assert torch.equal(h, (x.float() + r.float()).to(torch.bfloat16))
            assert _rel(out, _rms64(h, w, 1e-6)) < TOL[torch.bfloat16], f"{rows}x{H} {where}"


@pytest.mark.gpu
def test_gpu_auto_graph_and_compile(requires_gpus):
    requires_gpus(1)
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    rmsnorm(x, w)
    with torch.cuda.graph(graph):
        out = rmsnorm(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out, _rms64(x, w, 1e-6)) < TOL[torch.bfloat16]
    compiled = torch.compile(lambda a, r: rmsnorm(a, w, 1e-6, residual=r), fullgraph=True, backend="aot_eager")
    out, h = compiled(x, x)
    assert _rel(out, _rms64(h, w, 1e-6)) < TOL[torch.bfloat16]


def test_custom_ops_pass_opcheck_on_strided_inputs():
    """The fake implementations' contiguous results match the real ones for strided inputs (a Hugging Face
    q/k is a transposed view; a residual stream may be strided): torch.compile checks their strides."""
    ops = torch.ops.xelink
    q = torch.randn(2, 5, 4, 8).transpose(1, 2)  # (B, H, S, D) of a (B, S, H, D) projection
    k = torch.randn(2, 5, 2, 8).transpose(1, 2)
    cos = torch.randn(5, 8)
    torch.library.opcheck(ops.rope.default, (q, k, cos, cos, "reference", "off"))
    x = torch.randn(4, 3, 16).transpose(0, 1)
    torch.library.opcheck(ops.rmsnorm_residual.default, (x, x.clone(), torch.randn(16), 1e-6, "reference", "off",
                                                         torch.empty(3, 4, 16)))
    assert all(t.is_contiguous() for t in rope(q, k, cos, cos, impl="reference"))
    assert all(t.is_contiguous() for t in rmsnorm(x, torch.randn(16), residual=x.clone(), impl="reference"))


def _decode_fusions_compiled(device, dtype, impl):
    """rope_kv and silu_mul under torch.compile(fullgraph=True) (their custom ops; rope_kv's caches marked as
    written), twice with new positions, against eager calls on copies of the caches: bit for bit."""
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(2, 12, 1, 64, generator=gen).to(device=device, dtype=dtype)
    q, k, v = qkv[:, :8], qkv[:, 8:10], qkv[:, 10:]
    cos, sin = (torch.randn(50, 64, generator=gen).to(device) for _ in range(2))
    kc = torch.randn(2, 2, 50, 64, generator=gen).to(device=device, dtype=dtype)
    vc, kc2 = torch.randn_like(kc), kc.clone()
    vc2 = vc.clone()
    x = torch.randn(3, 2, 96, generator=gen).to(device=device, dtype=dtype)
    out = torch.empty(3, 2, 48, device=device, dtype=dtype)

    def step(q, k, v, kc, vc, pos, x, out):
        silu_mul(x, impl=impl, out=out)
        return rope_kv(q, k, v, cos, sin, pos, kc, vc, impl=impl), silu_mul(x * 2, impl=impl) + out

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for pos in ([3, 49], [4, 0]):
        pos = torch.tensor(pos, device=device)
        got = compiled(q, k, v, kc, vc, pos, x, out)
        want = step(q, k, v, kc2, vc2, pos, x, torch.empty_like(out))
        assert all(torch.equal(a, b) for a, b in zip(got, want)), pos
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2) and torch.equal(out, silu_mul(x, impl=impl)), pos


def test_decode_fusions_custom_ops():
    """rope_kv's and silu_mul's custom ops pass torch.library.opcheck (schema, the caches / out they write, fake
    implementations) on strided views; fullgraph torch.compile traces them as eager runs them."""
    ops = torch.ops.xelink
    qkv = torch.randn(2, 12, 1, 16)
    q, k, v = qkv[:, :8], qkv[:, 8:10], qkv[:, 10:]
    cos = torch.randn(9, 16)
    kc, vc = torch.randn(3, 2, 9, 16), torch.randn(3, 2, 9, 16)
    torch.library.opcheck(ops.rope_kv.default, (q, k, v, cos, cos, torch.tensor([2, 8]), kc, vc, "reference", "off"))
    x = torch.randn(6, 4, 10).transpose(0, 1)
    torch.library.opcheck(ops.silu_mul.default, (x, "reference", "off", torch.empty(4, 6, 5)))
    assert rope_kv(q, k, v, cos, cos, torch.tensor([2, 8]), kc, vc, impl="reference").is_contiguous()
    _decode_fusions_compiled("cpu", torch.float32, "reference")


@pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
def test_decode_fusions_compiled_interpreter():
    _decode_fusions_compiled("cpu", torch.float16, "triton")


@pytest.mark.gpu
def test_decode_fusions_compiled_gpu(requires_gpus):
    requires_gpus(1)
    _decode_fusions_compiled("cuda", torch.bfloat16, "triton")


def test_numpy_scalars_are_taken_where_a_float_is():
    np = pytest.importorskip("numpy")
    x, w = torch.randn(3, 16), torch.randn(16)
    assert torch.equal(rmsnorm(x, w, np.float32(1e-6)), rmsnorm(x, w, 1e-6))

"""The GEMVs with an RMSNorm folded in (``gemv_norm``): ``gemv_residual`` (the residual add at the store, the
next norm's weight applied) and ``gemv_rms`` (each row scaled by 1 / rms): the references against the unfolded
chain (rmsnorm, then gemv), the argument checks (before anything is written), and on a GPU the one-launch CUDA C++
path against the references, the unfolded kernels bit for bit where the sums are the same, a graph of the folded
chain replayed with new inputs, and the composed paths."""
import importlib

import pytest
import torch

from xelink.kernels import (gemv, gemv_residual, gemv_rms, norm_folds, pack_w4a16, pack_w8a16, reference_gemv,
                            reference_gemv_residual, reference_gemv_rms, reference_rmsnorm, reference_silu_mul,
                            tile_w4a16)


def _weights(fmt, n, k, dtype, device="cpu", gen=None):
    w = torch.randn(n, k, generator=gen, device=device) * k ** -0.5
    if fmt in ("bf16", "fp16"):
        return w.to(dtype), None
    if fmt == "w8a16":
        return pack_w8a16(w, dtype)
    q, s = pack_w4a16(w, dtype)
    return (tile_w4a16(q), s) if fmt == "w4a16t" else (q, s)


def _close(got, want, what, rel=2 ** -6):
    err = (got.float() - want.float()).abs().max().item()
    assert err <= rel * want.float().abs().max().item() + 1e-6, f"{what}: max error {err:.3g}"


@pytest.mark.parametrize("fmt", ["bf16", "w8a16", "w4a16", "w4a16t"])
@pytest.mark.parametrize("M", [1, 3])
def test_references_are_the_unfolded_chain(fmt, M):
    """o = gemv(W_o, a); normed, h = rmsnorm(o, g, residual=h); y = gemv(W, normed) (act: SwiGLU) against
    z = gemv_residual(W_o, a, h, g); y = gemv_rms(W, z, h): the residual bit for bit, y within rounding."""
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(M)
    H, F = 256, 384
    wo, so = _weights(fmt, H, H, dtype, gen=gen)
    wgu, sgu = _weights(fmt, 2 * F, H, dtype, gen=gen)
    a = torch.randn(M, H, generator=gen).to(dtype)
    h = torch.randn(M, H, generator=gen).to(dtype)
    g = (torch.rand(H, generator=gen) + 0.5).to(dtype)
    o = reference_gemv(wo, a, so, fmt)
    normed, want_h = reference_rmsnorm(o, g, 1e-5, h)
    for fold in (gemv_residual, reference_gemv_residual):
        hf = h.clone()
        z = fold(wo, a, so, fmt, hf, g)
        assert torch.equal(hf, want_h), fold.__name__
        assert torch.equal(z, (want_h.float() * g.float()).to(dtype)), fold.__name__
        hf = h.clone()
        assert torch.equal(fold(wo, a, so, fmt, hf), o) and torch.equal(hf, want_h), fold.__name__
    z = (want_h.float() * g.float()).to(dtype)
    for act in (None, "silu_mul"):
        want = reference_gemv(wgu, normed, sgu, fmt)
        want = reference_silu_mul(want) if act else want
        for fn in (gemv_rms, reference_gemv_rms):
            got = fn(wgu, z, sgu, fmt, want_h, 1e-5, act=act) if fn is reference_gemv_rms else \
                fn(wgu, z, sgu, fmt, want_h, 1e-5, act=act)
            assert got.shape == want.shape and got.dtype == dtype
            _close(got, want, f"{fn.__name__} {fmt} M={M} act={act}")
    # one row as 1-D tensors
    h1 = h[0].clone()
    z1 = gemv_residual(wo, a[0], so, fmt, h1, g)
    assert z1.shape == (H,) and torch.equal(h1, want_h[0])
    y1 = gemv_rms(wgu, z1, sgu, fmt, h1, 1e-5)
    assert y1.shape == (2 * F,) and torch.equal(y1, gemv_rms(wgu, z1[None], sgu, fmt, h1[None], 1e-5)[0])


def test_bad_arguments_name_the_function_and_write_nothing():
    dtype = torch.bfloat16
    w, s = _weights("w4a16", 64, 256, dtype)
    x, h = torch.randn(2, 256).to(dtype), torch.randn(2, 256).to(dtype)
    with pytest.raises(ValueError, match=r"gemv_rms: rms_of.shape=\(2, 128\) must be \(2, 256\)"):
        gemv_rms(w, x, s, "w4a16", h[:, :128], 1e-5)
    with pytest.raises(TypeError, match="gemv_rms: rms_of.dtype=torch.float32 must equal x.dtype=torch.bfloat16"):
        gemv_rms(w, x, s, "w4a16", h.float(), 1e-5)
    with pytest.raises(ValueError, match="gemv_rms: eps=-1 must be a float >= 0"):
        gemv_rms(w, x, s, "w4a16", h, -1)
    with pytest.raises(ValueError, match="gemv_rms: rms_of needs unit stride"):
        gemv_rms(w, x, s, "w4a16", torch.randn(256, 2).to(dtype).t(), 1e-5)
    with pytest.raises(ValueError, match="gemv_rms: act='gelu' is not None or one of silu_mul"):
        gemv_rms(w, x, s, "w4a16", h, 1e-5, act="gelu")
    with pytest.raises(ValueError, match="gemv_rms: x has M=9 rows"):
        gemv_rms(w, torch.randn(9, 256).to(dtype), s, "w4a16", torch.randn(9, 256).to(dtype), 1e-5)
    res = torch.randn(2, 64).to(dtype)
    before = res.clone()
    with pytest.raises(ValueError, match=r"gemv_residual: residual.shape=\(2, 32\) must be \(2, 64\)"):
        gemv_residual(w, x, s, "w4a16", res[:, :32])
    with pytest.raises(ValueError, match=r"gemv_residual: norm_weight.shape=\(63,\) must be \(64,\)"):
        gemv_residual(w, x, s, "w4a16", res, torch.ones(63, dtype=dtype))
    with pytest.raises(TypeError, match="gemv_residual: residual.dtype=torch.float16 must equal"):
        gemv_residual(w, x, s, "w4a16", res.half())
    with pytest.raises(ValueError, match=r"gemv_residual: w4a16 w.shape\[1\]=128 != K/2=64"):  # gemv's checks
        gemv_residual(w, x[:, :128], s, "w4a16", res)
    buf = torch.randn(2 * 256 + 2 * 64).to(dtype)  # residual inside x's memory
    with pytest.raises(ValueError, match="gemv_residual: residual overlaps x in memory"):
        gemv_residual(w, buf[:512].view(2, 256), s, "w4a16", buf[256:384].view(2, 64))
    g = torch.ones(64 + 64, dtype=dtype)
    with pytest.raises(ValueError, match="gemv_residual: residual overlaps norm_weight in memory"):
        gemv_residual(w, x, s, "w4a16", g[:128].view(2, 64), g[64:])
    assert torch.equal(res, before)
    assert not norm_folds("cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_folded_gemvs(requires_gpus, dtype, cu_gemv, monkeypatch):
    """On the CUDA C++ kernel (one launch each, norm_folds): Llama-3.1-8B's shapes at 1-8 rows. gemv_residual's
    sums are gemv's own (same kernel and config): its residual and its output bit for bit the unfolded ops';
    gemv_rms within rounding of the reference (the act too); with the switch off (the composed path) the same within
    rounding; rms_of off 16 bytes (the composed path); a graph of the folded chain replayed with new inputs; a kernel
    that cannot be built (a warning, the composed path)."""
    requires_gpus(1)
    gemv_module, norm_module = cu_gemv
    monkeypatch.setattr(norm_module, "CU_FOLD", True)  # (off by default until this test has run on a GPU)
    assert norm_folds("cuda")
    gen = torch.Generator(device="cuda").manual_seed(5)
    H, F, QKV = 4096, 2048, 6144
    wo, so = _weights("w4a16t", H, H, dtype, "cuda", gen)
    wd, sd = _weights("w4a16t", H, 2 * F, dtype, "cuda", gen)
    wq, sq = _weights("w4a16t", QKV, H, dtype, "cuda", gen)
    wgu, sgu = _weights("w4a16t", 2 * F, H, dtype, "cuda", gen)
    g = (torch.rand(H, device="cuda", generator=gen) + 0.5).to(dtype)
    for M in (1, 2, 3, 8):
        a = torch.randn(M, H, device="cuda", generator=gen).to(dtype)
        d = torch.randn(M, 2 * F, device="cuda", generator=gen).to(dtype)
        h = torch.randn(M, H, device="cuda", generator=gen).to(dtype)
        for w, s, x in ((wo, so, a), (wd, sd, d)):
            y = gemv(w, x, s, "w4a16t")
            want_h = (h.float() + y.float()).to(dtype)
            hf = h.clone()
            assert torch.equal(gemv_residual(w, x, s, "w4a16t", hf), y) and torch.equal(hf, want_h), M
            hf = h.clone()
            z = gemv_residual(w, x, s, "w4a16t", hf, g)
            assert torch.equal(hf, want_h) and torch.equal(z, (want_h.float() * g.float()).to(dtype)), M
        z = (h.float() * g.float()).to(dtype)
        for w, s, act in ((wq, sq, None), (wgu, sgu, None), (wgu, sgu, "silu_mul")):
            got = gemv_rms(w, z, s, "w4a16t", h, 1e-5, act=act)
            want = reference_gemv_rms(w, z, s, "w4a16t", h, 1e-5, act)
            _close(got, want, f"gemv_rms {dtype} M={M} N={w.shape[0]} act={act}", 2 ** -7)
            unfolded = gemv(w, reference_rmsnorm(h, g, 1e-5), s, "w4a16t", act=act)
            _close(got, unfolded, f"gemv_rms against the unfolded M={M} act={act}", 2 ** -6)
            off = torch.empty(M * H + 1, device="cuda", dtype=dtype)[1:].view(M, H)
            off.copy_(h)
            _close(gemv_rms(w, z, s, "w4a16t", off, 1e-5, act=act), want, f"rms_of off 16 bytes M={M}", 2 ** -6)
    monkeypatch.setattr(gemv_module, "CU_W4", False)
    norm_module._PATHS.clear()
    assert not norm_folds("cuda")
    h = torch.randn(2, H, device="cuda", generator=gen).to(dtype)
    z = (h.float() * g.float()).to(dtype)
    _close(gemv_rms(wgu, z, sgu, "w4a16t", h, 1e-5, act="silu_mul"),
           reference_gemv_rms(wgu, z, sgu, "w4a16t", h, 1e-5, "silu_mul"), "composed gemv_rms", 2 ** -6)
    hf, hr = h.clone(), h.clone()
    a = torch.randn(2, H, device="cuda", generator=gen).to(dtype)
    _close(gemv_residual(wo, a, so, "w4a16t", hf, g), reference_gemv_residual(wo, a, so, "w4a16t", hr, g),
           "composed gemv_residual", 2 ** -6)
    _close(hf, hr, "composed gemv_residual's residual", 2 ** -7)
    monkeypatch.setattr(gemv_module, "CU_W4", True)
    norm_module._PATHS.clear()
    # the folded chain of a layer's MLP half in a graph (each launch under PDL reads what the one before wrote)
    a = torch.randn(1, H, device="cuda", generator=gen).to(dtype)
    h = torch.randn(1, H, device="cuda", generator=gen).to(dtype)

    def chain(a, h):
        z = gemv_residual(wo, a, so, "w4a16t", h, g)
        u = gemv_rms(wgu, z, sgu, "w4a16t", h, 1e-5, act="silu_mul")
        return gemv_residual(wd, u, sd, "w4a16t", h, g)

    chain(a.clone(), h.clone())
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    ga, gh = a.clone(), h.clone()
    with torch.cuda.graph(graph):
        out = chain(ga, gh)
    for _ in range(3):
        a.copy_(torch.randn(1, H, device="cuda", generator=gen).to(dtype))
        h.copy_(torch.randn(1, H, device="cuda", generator=gen).to(dtype))
        ga.copy_(a)
        gh.copy_(h)
        graph.replay()
        he = h.clone()
        want = chain(a, he)
        assert torch.equal(out, want) and torch.equal(gh, he)
    # a kernel NVRTC or the driver cannot build: a warning naming the function, then gemv and torch ops
    gemv_cu = importlib.import_module("xelink.kernels.gemv_cu")

    def broken(*args):
        raise RuntimeError("CUDA error: CUDA_ERROR_UNSUPPORTED_PTX_VERSION (test)")

    monkeypatch.setattr(gemv_cu, "_kernel", broken)
    for m in (gemv_module, norm_module):
        m._PATHS.clear()
    z = (h.float() * g.float()).to(dtype)
    with pytest.warns(RuntimeWarning, match="gemv_rms: the CUDA C\\+\\+ W4A16 kernel could not be built"):
        got = gemv_rms(wq, z, sq, "w4a16t", h, 1e-5)
    _close(got, reference_gemv_rms(wq, z, sq, "w4a16t", h, 1e-5), "gemv_rms after a failed build", 2 ** -6)

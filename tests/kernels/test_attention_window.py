"""Sliding-window attention (``window=``) of flash_attention, decode_attention and rope_decode_attention, and of the
flash attention backward (``flash_attention_backward(..., window=)``, the autograd node of a windowed call with grad).

Each query sees the ``window`` keys ending at its last visible one (Mistral's and Phi-3's ``sliding_window``). The
references against float64 attention with the mask written out element by element (CPU), the backward's against
autograd of it; the kernels against the references: the Triton interpreter on the CPU (TRITON_INTERPRET=1) and the
GPU (marked), with the cache rows before each sequence's window and past its end NaN, so a decode split that read one
shows."""
import os

import pytest
import torch

from xelink.kernels import attention as A

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1" and A.triton is not None
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3, torch.float32: 1e-5}


def _rel(out, ref):
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def _qkv(b, hq, hkv, sq, sk, d, dtype, device="cpu", gen=None):
    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    return r(b, hq, sq, d), r(b, hkv, sk, d), r(b, hkv, sk, d)


def _window64(q, k, v, causal, window, lse=False):
    """float64 attention with every (query, key) pair's visibility decided one by one; rows that see nothing: 0
    (LSE -inf). Differentiable (built from torch ops on q, k, v). ``lse``: (out, lse)."""
    B, Hq, Sq, D = q.shape
    Sk, g = k.shape[2], Hq // k.shape[1]
    kk, vv = (t.double().repeat_interleave(g, dim=1) for t in (k, v))
    outs, lses = [], []
    for i in range(Sq):
        last = i + Sk - Sq if causal else Sk - 1
        keys = [j for j in range(Sk) if last - window < j <= last]
        if not keys:
            outs.append(torch.zeros(B, Hq, D, dtype=torch.float64))
            lses.append(torch.full((B, Hq), float("-inf"), dtype=torch.float64))
            continue
        s = (q[:, :, i:i + 1].double() @ kk[:, :, keys].transpose(-1, -2))[:, :, 0] / D ** 0.5  # (B, Hq, keys)
        outs.append((torch.softmax(s, dim=-1)[:, :, None] @ vv[:, :, keys])[:, :, 0])
        lses.append(torch.logsumexp(s, dim=-1))
    out = torch.stack(outs, dim=2)
    return (out, torch.stack(lses, dim=2)) if lse else out


WINDOW_SHAPES = [  # (B, Hq, Hkv, Sq, Sk, causal, window)
    (2, 4, 2, 9, 9, True, 3), (1, 4, 1, 7, 19, True, 5), (2, 2, 2, 13, 5, True, 2), (1, 3, 1, 1, 40, True, 8),
    (1, 2, 1, 6, 17, False, 4), (2, 4, 4, 9, 9, True, 1), (1, 2, 2, 9, 9, True, 100),
]


@pytest.mark.parametrize("shape", WINDOW_SHAPES)
def test_reference_against_float64(shape):
    b, hq, hkv, sq, sk, causal, window = shape
    q, k, v = _qkv(b, hq, hkv, sq, sk, 16, torch.float32)
    out = A.reference_flash_attention(q, k, v, causal=causal, window=window)
    assert _rel(out, _window64(q, k, v, causal, window)) < 1e-5
    if window >= sk:  # a window over every key is no window
        assert torch.equal(out, A.reference_flash_attention(q, k, v, causal=causal))


def test_reference_decode_is_attention_over_each_sequence():
    q, kc, vc = _qkv(3, 4, 2, 3, 30, 16, torch.float32)
    lens = torch.tensor([30, 4, 17])
    for causal in (False, True):
        out = A.reference_decode_attention(q, kc, vc, lens, causal=causal, window=6)
        for b, n in enumerate(lens.tolist()):
            want = _window64(q[b:b + 1], kc[b:b + 1, :, :n], vc[b:b + 1, :, :n], causal, 6)
            assert _rel(out[b:b + 1], want) < 1e-5, (causal, b)


@pytest.mark.parametrize("window", [0, -3, True, 2.5, "8"])
def test_bad_window(window):
    q, k, v = _qkv(1, 2, 1, 3, 5, 16, torch.float32)
    with pytest.raises(ValueError, match=f"^flash_attention: window={window!r} must be None or an int >= 1"):
        A.flash_attention(q, k, v, causal=True, window=window)
    with pytest.raises(ValueError, match=f"^decode_attention: window={window!r}"):
        A.decode_attention(q, k, v, torch.tensor([5]), window=window)
    with pytest.raises(ValueError, match=f"^reference_flash_attention: window={window!r}"):
        A.reference_flash_attention(q, k, v, window=window)


def test_a_kernel_with_grad_takes_a_window():
    # A named kernel path with grad and a window is refused only for what refuses it without a window (here: CPU
    # tensors outside the interpreter), never for the window: its backward takes one.
    q, k, v = _qkv(1, 2, 1, 3, 5, 64, torch.bfloat16)
    if INTERPRET:
        out = A.flash_attention(q.requires_grad_(), k, v, causal=True, impl="triton", window=4)
        assert out.grad_fn is not None
        return
    with pytest.raises((ValueError, RuntimeError)) as err:
        A.flash_attention(q.requires_grad_(), k, v, causal=True, impl="triton", window=4)
    assert "window" not in str(err.value) and "impl='triton' needs" in str(err.value), err.value


def test_grad_runs_through_the_autograd_node():
    # With grad, a window runs as the forward of the autograd node whose backward is flash_attention_backward: it
    # keeps q, k, v, the output and the LSE (no score matrix), and the gradients of a loss of the output and the LSE
    # are those of float64 attention with the mask written out; out= is refused as for any call with grad.
    q, k, v = (t.double() for t in _qkv(1, 4, 2, 6, 11, 16, torch.float32))
    for causal, window in ((True, 3), (False, 4), (True, 1), (True, 20)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = A.flash_attention(*leaves, causal=causal, window=window, return_lse=True)
        saved = out.grad_fn.saved_tensors
        assert sorted(tuple(t.shape) for t in saved) == [(1, 2, 11, 16), (1, 2, 11, 16), (1, 4, 6), (1, 4, 6, 16),
                                                         (1, 4, 6, 16)], [t.shape for t in saved]
        (out.square().sum() + lse.sum()).backward()
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        want, want_lse = _window64(*full, causal, window, lse=True)
        (want.square().sum() + want_lse.sum()).backward()
        for name, a, b in zip("qkv", leaves, full):
            assert a.grad.dtype == torch.float64 and torch.allclose(a.grad, b.grad, atol=1e-5), (causal, window, name)
    with pytest.raises(ValueError, match="out= is not differentiable"):
        A.flash_attention(*leaves, causal=True, window=3, out=torch.empty(1, 4, 6, 16, dtype=torch.float64))


@pytest.mark.parametrize("shape", WINDOW_SHAPES)
def test_backward_is_autograd_of_windowed_attention(shape):
    # flash_attention_backward with a window (the forward's out and LSE given, the LSE's gradient too) against autograd
    # of the float64 windowed attention; rows that see nothing (LSE -inf) get no gradient; a window over every key
    # gives exactly the unwindowed result.
    b, hq, hkv, sq, sk, causal, window = shape
    gen = torch.Generator().manual_seed(sq * 31 + sk + window)
    q, k, v = (t.double() for t in _qkv(b, hq, hkv, sq, sk, 16, torch.float32, gen=gen))
    dout = torch.randn(b, hq, sq, 16, generator=gen, dtype=torch.float64)
    dlse = torch.randn(b, hq, sq, generator=gen, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = _window64(*leaves, causal, window, lse=True)
    seen = torch.isfinite(lse)
    ((out * dout).sum() + (torch.where(seen, lse, 0.0) * dlse).sum()).backward()
    args = (dout, q, k, v, out.detach(), lse.detach().float())
    got = A.flash_attention_backward(*args, causal=causal, dlse=dlse, window=window)
    for name, a, t in zip(("dq", "dk", "dv"), got, leaves):
        assert a.dtype == torch.float64 and a.shape == t.shape, name
        assert torch.allclose(a, t.grad, atol=1e-5), (shape, name, (a - t.grad).abs().max())
    assert torch.equal(got[0][~seen], torch.zeros_like(got[0][~seen]))
    ref = A.reference_flash_attention_backward(*args, causal=causal, dlse=dlse, window=window)
    assert all(torch.equal(a, r) for a, r in zip(got, ref))
    if window >= sk:  # a window over every key is no window
        plain = A.flash_attention_backward(*args, causal=causal, dlse=dlse)
        assert all(torch.equal(a, r) for a, r in zip(got, plain))


@pytest.mark.parametrize("window", [0, -3, True, 2.5, "8"])
def test_backward_bad_window(window):
    q, k, v = _qkv(1, 2, 1, 3, 5, 16, torch.float32)
    out, lse = A.reference_flash_attention(q, k, v, causal=True, return_lse=True)
    for fn in (A.flash_attention_backward, A.reference_flash_attention_backward):
        with pytest.raises(ValueError, match=f"^{fn.__name__}: window={window!r} must be None or an int >= 1"):
            fn(out, q, k, v, out, lse, causal=True, window=window)


# -- the kernels: the interpreter on the CPU, and the GPU ---------------------------------------------------

def _check_flash(device, d, dtype, shapes, seed, impl="triton"):
    gen = torch.Generator().manual_seed(seed)
    for b, hq, hkv, sq, sk, causal, window in shapes:
        q, k, v = _qkv(b, hq, hkv, sq, sk, d, dtype, device, gen)
        out, lse = A.flash_attention(q, k, v, causal=causal, return_lse=True, impl=impl, window=window)
        ref, ref_lse = A.reference_flash_attention(q, k, v, causal=causal, return_lse=True, window=window)
        where = (impl, d, dtype, b, hq, hkv, sq, sk, causal, window)
        assert not torch.isnan(out).any(), where
        assert _rel(out, ref) < TOL[dtype], (where, _rel(out, ref))
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite), where
        assert (lse[finite] - ref_lse[finite]).abs().max() < 2e-3, where


def _poisoned_caches(b, hq, hkv, sq, smax, d, dtype, device, gen, lens, back):
    """q and caches whose rows outside [len - back, len) of each sequence are NaN (a kernel that reads one shows)."""
    q, kc, vc = _qkv(b, hq, hkv, sq, smax, d, dtype, device, gen)
    for i, n in enumerate(lens):
        for c in (kc, vc):
            c[i, :, n:] = float("nan")
            c[i, :, :max(n - back, 0)] = float("nan")
    return q, kc, vc


def _rope_tables(n, d, device):
    ang = torch.arange(n, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, d, 2) / d)[None, :]
    return (torch.cat([f(ang)] * 2, dim=1).float().to(device) for f in (torch.cos, torch.sin))


def _check_decode(device, d, dtype, cases, seed):
    gen = torch.Generator().manual_seed(seed)
    for b, hq, hkv, sq, smax, lens, splits, causal, window in cases:
        back = window + (sq - 1 if causal else 0)
        q, kc, vc = _poisoned_caches(b, hq, hkv, sq, smax, d, dtype, device, gen, lens, back)
        kv_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        out, lse = A.decode_attention(q, kc, vc, kv_lens, causal=causal, return_lse=True, num_splits=splits,
                                      impl="triton", window=window)
        ref, ref_lse = A.reference_decode_attention(q, kc.nan_to_num(), vc.nan_to_num(), kv_lens, causal=causal,
                                                    return_lse=True, window=window)
        where = (d, dtype, b, hq, hkv, sq, smax, lens, splits, causal, window)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"NaN: a row outside the window read {where}"
        assert _rel(out, ref) < TOL[dtype], (where, _rel(out, ref))


def _check_rope_decode(device, d, dtype, seed):
    # The fused decode step with a window equals rope_kv then the windowed decode attention (the reference); the new
    # row written, the rows before the window never read (NaN there).
    gen = torch.Generator().manual_seed(seed)
    b, hq, hkv, smax, window = 3, 8, 2, 300, 37
    lens = [300, 20, 130]
    qkv = torch.randn(b, hq + 2 * hkv, 1, d, generator=gen).to(device=device, dtype=dtype)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    cos, sin = _rope_tables(smax, d, device)
    _, kc, vc = _poisoned_caches(b, hq, hkv, 1, smax, d, dtype, device, gen, lens, window)
    kv_lens = torch.tensor(lens, device=device)
    clean = kc.nan_to_num(), vc.nan_to_num()
    out = A.rope_decode_attention(q, k, v, cos, sin, kc, vc, kv_lens, impl="triton", window=window)
    ref = A.reference_rope_decode_attention(q, k, v, cos, sin, *clean, kv_lens, window=window)
    assert not torch.isnan(out).any(), "a row outside the window was read"
    assert _rel(out, ref) < TOL[dtype], _rel(out, ref)
    for i, n in enumerate(lens):  # the new row written where the reference wrote it
        assert torch.equal(vc[i, :, n - 1], clean[1][i, :, n - 1])


def _ring_case(b, hq, hkv, d, ring_rows, lens, dtype, device, gen):
    """One decode step of sequences of ``lens`` tokens (the new one included) over a full cache and over a ring of
    ``ring_rows`` rows holding each sequence's latest positions (position p at row p % ring_rows; rows not in use
    NaN): (q, k, v, cos, sin, full caches, ring caches, kv_lens)."""
    qkv = torch.randn(b, hq + 2 * hkv, 1, d, generator=gen).to(device=device, dtype=dtype)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    cos, sin = _rope_tables(max(lens), d, device)
    full = tuple(torch.randn(b, hkv, max(lens), d, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    ring = tuple(torch.full((b, hkv, ring_rows, d), float("nan"), dtype=dtype, device=device) for _ in range(2))
    for i, n in enumerate(lens):
        for p in range(max(n - 1 - ring_rows, 0), n - 1):  # the latest cached positions before the new token's
            for f, r in zip(full, ring):
                r[i, :, p % ring_rows] = f[i, :, p]
    return q, k, v, cos, sin, full, ring, torch.tensor(lens, device=device)


RING_LENS = [[1, 9, 16, 17], [40, 5, 33, 64]]  # with 16 ring rows: empty, partly filled, full, wrapped (twice)


def test_ring_reference_is_the_window_over_a_full_cache():
    # A ring of W rows holding the latest positions (in ring order) gives the window of W over the whole cache.
    gen = torch.Generator().manual_seed(11)
    for lens in RING_LENS:
        q, k, v, cos, sin, full, ring, kv_lens = _ring_case(4, 4, 2, 16, 16, lens, torch.float64, "cpu", gen)
        want = A.reference_rope_decode_attention(q, k, v, cos, sin, *full, kv_lens, window=16)
        got = A.reference_rope_decode_attention(q, k, v, cos, sin, *ring, kv_lens, ring=True)
        assert _rel(got, want) < 1e-12, lens
        for i, n in enumerate(lens):  # the new key and value written at the position's ring row
            assert torch.equal(ring[0][i, :, (n - 1) % 16], full[0][i, :, n - 1])
            assert torch.equal(ring[1][i, :, (n - 1) % 16], full[1][i, :, n - 1])
    # a ring at least as long as the sequences is the plain cache
    q, k, v, cos, sin, full, ring, kv_lens = _ring_case(2, 4, 2, 16, 64, [30, 64], torch.float64, "cpu", gen)
    assert torch.equal(A.reference_rope_decode_attention(q, k, v, cos, sin, *ring, kv_lens, ring=True),
                       A.reference_rope_decode_attention(q, k, v, cos, sin, *full, kv_lens))


def test_bad_ring():
    q, k, v, cos, sin, full, ring, kv_lens = _ring_case(1, 2, 1, 16, 8, [5], torch.float32, "cpu",
                                                        torch.Generator().manual_seed(0))
    for fn in (A.rope_decode_attention, A.reference_rope_decode_attention):
        with pytest.raises(TypeError, match="ring=1 must be a bool"):
            fn(q, k, v, cos, sin, *ring, kv_lens, ring=1)
        with pytest.raises(ValueError, match="window=4 with ring=True"):
            fn(q, k, v, cos, sin, *ring, kv_lens, ring=True, window=4)


def _check_rope_ring(device, d, dtype, seed, hq=8, hkv=2, ring_rows=16, lens_list=RING_LENS):
    # The fused decode step over ring caches against the ring reference: the output, no row out of use read (NaN
    # there), the caches after the call (the new value at p % rows, the new key within one rounding: FMAs, every
    # other row untouched); eager and then remembered (a second call of the same geometry).
    gen = torch.Generator().manual_seed(seed)
    for lens in lens_list:
        q, k, v, cos, sin, _, ring, kv_lens = _ring_case(len(lens), hq, hkv, d, ring_rows, lens, dtype, device, gen)
        ref_caches = tuple(c.clone() for c in ring)
        want = A.reference_rope_decode_attention(q, k, v, cos, sin, *ref_caches, kv_lens, ring=True)
        rows = [(n - 1) % ring_rows for n in lens]
        for _ in range(2):
            caches = tuple(c.clone() for c in ring)
            out = A.rope_decode_attention(q, k, v, cos, sin, *caches, kv_lens, impl="triton", ring=True)
            assert not torch.isnan(out).any(), (lens, "a ring row out of use was read")
            assert _rel(out, want) < TOL[dtype], (lens, _rel(out, want))
            assert torch.equal(caches[1].nan_to_num(7.0), ref_caches[1].nan_to_num(7.0)), lens
            got_k, want_k = caches[0].clone(), ref_caches[0].clone()
            for i, row in enumerate(rows):
                assert torch.allclose(got_k[i, :, row].float(), want_k[i, :, row].float(), rtol=2 ** -7, atol=0)
                got_k[i, :, row] = want_k[i, :, row] = 0.0
            assert torch.equal(got_k.nan_to_num(7.0), want_k.nan_to_num(7.0)), lens


FLASH_CASES = [(1, 4, 2, 200, 200, True, 64), (2, 2, 1, 77, 300, True, 50), (1, 2, 2, 130, 130, False, 33),
               (1, 4, 4, 65, 65, True, 1), (1, 2, 1, 40, 90, True, 500),
               (1, 2, 1, 150, 40, True, 16)]  # more queries than keys: the first 110 rows see none
DECODE_CASES = [  # (B, Hq, Hkv, Sq, Smax, kv_lens, num_splits, causal, window)
    (3, 8, 2, 1, 400, [400, 5, 260], None, True, 100), (2, 4, 1, 3, 300, [300, 70], 4, True, 64),
    (2, 4, 1, 3, 300, [300, 70], 3, False, 50), (1, 8, 2, 1, 200, [200], 7, False, 1),
    (1, 4, 4, 2, 100, [100], None, True, 1000)]


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and Triton")
def test_kernels_interpreter():
    _check_flash("cpu", 64, torch.float16, FLASH_CASES, 1)
    _check_decode("cpu", 64, torch.float16, DECODE_CASES, 2)
    _check_rope_decode("cpu", 64, torch.float16, 3)
    _check_rope_ring("cpu", 64, torch.float16, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", A.HEAD_DIMS)
def test_kernels_gpu(requires_gpus, d, dtype):
    requires_gpus(1)
    for impl in ("triton", "cuda"):  # the portable kernel, and on sm90 the TMA one (elsewhere "cuda" is refused)
        if impl == "cuda" and torch.cuda.get_device_capability()[0] != 9:
            continue
        _check_flash("cuda", d, dtype, FLASH_CASES + [(1, 8, 2, 2048, 2048, True, 1024),
                                                      (1, 4, 1, 1000, 5000, True, 700)], d, impl)
    _check_decode("cuda", d, dtype, DECODE_CASES + [(1, 32, 8, 1, 32768, [32768], None, True, 4096),
                                                    (2, 32, 8, 1, 9000, [9000, 3000], None, True, 4096)], d + 1)
    _check_rope_decode("cuda", d, dtype, d + 2)
    _check_rope_ring("cuda", d, dtype, d + 3)
    _check_rope_ring("cuda", d, dtype, d + 4, 32, 8, 4096, [[70000, 4096, 100, 8193]])  # Mistral's, splits of a ring


# -- the backward kernel with a window: the interpreter on the CPU, and the GPU -------------------------------------

# (B, Hq, Hkv, Sq, Sk, D, causal, window): tile tails, GQA, Sq < Sk and Sq > Sk (rows that see no key), window 1,
# windows within one tile and over several, a window past every key, non-causal windows (the key tiles before every
# row's window seen by none). The first two have window - 2 - (Sk - Sq) a multiple of 16: on 16 x 16 tiles the last
# row that sees a key tile starts a query tile, and the first key a query tile sees ends a key tile (a bound one off
# shows)
BWD_WINDOW_SHAPES = [(1, 2, 1, 70, 70, 64, True, 18), (2, 4, 2, 33, 97, 64, True, 2), (1, 2, 2, 100, 40, 64, True, 1),
                     (1, 2, 1, 30, 90, 64, True, 70), (1, 2, 2, 17, 100, 64, False, 20),
                     (1, 4, 1, 50, 20, 64, True, 200), (1, 2, 1, 40, 90, 64, False, 75)]


def _check_bwd_window(shape, device, dtype, tol):
    """The Triton backward with a window against the reference (the LSE's gradient included), the results stored
    in dtype= as in float32 less the rounding, the same bits on a second call."""
    b, hq, hkv, sq, sk, d, causal, window = shape
    gen = torch.Generator().manual_seed(sq * 7 + sk + window)
    q, k, v = _qkv(b, hq, hkv, sq, sk, d, dtype, device, gen)
    out, lse = A.reference_flash_attention(q, k, v, causal=causal, return_lse=True, window=window)
    dout = torch.randn(b, hq, sq, d, generator=gen).to(device, dtype)
    dlse = torch.randn(b, hq, sq, generator=gen).to(device)
    args, kw = (dout, q, k, v, out, lse), dict(causal=causal, dlse=dlse, window=window)
    got = A.flash_attention_backward(*args, impl="triton", **kw)
    want = A.flash_attention_backward(*args, impl="reference", **kw)
    for name, a, w in zip(("dq", "dk", "dv"), got, want):
        assert a.dtype == torch.float32 and a.shape == w.shape, (name, a.dtype, a.shape)
        err = _rel(a, w)
        assert err <= tol and torch.isfinite(a).all(), f"{shape} {dtype} {name}: relative error {err:.3g}"
    eps = torch.finfo(dtype).eps
    for name, a, r in zip(("dq", "dk", "dv"), got, A.flash_attention_backward(*args, impl="triton", dtype=dtype, **kw)):
        assert r.dtype == dtype and bool(((r.float() - a).abs() <= a.abs() * eps + 1e-6).all()), (shape, name)
    assert all(torch.equal(a, r) for a, r in zip(got, A.flash_attention_backward(*args, impl="triton", **kw)))


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and Triton")
@pytest.mark.parametrize("tiles", ["kept", "16x16"])
@pytest.mark.parametrize("shape", BWD_WINDOW_SHAPES)
def test_interpreter_flash_backward_kernel_with_a_window(shape, tiles, monkeypatch):
    # float16 (the interpreter's bfloat16 dot is wrong); "16x16": both passes on 16 x 16 tiles, so that these short
    # sequences span many key and query tiles and the windowed loop bounds (where dk/dv stops, where dq starts, the
    # key tiles nobody sees) are crossed at every offset
    if tiles == "16x16":
        from xelink.kernels import attention_bwd
        monkeypatch.setitem(attention_bwd.BWD_CONFIGS, shape[5], {"dkdv": (16, 16, 4, 1), "dq": (16, 16, 4, 1)})
    _check_bwd_window(shape, "cpu", torch.float16, 2e-3)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and Triton")
def test_interpreter_windowed_grad_runs_the_kernels():
    # A windowed call with grad on the named Triton path: the kernel forward, then the kernel backward; gradients
    # within float16 rounding of the reference path's
    gen = torch.Generator().manual_seed(5)
    q, k, v = _qkv(1, 4, 2, 40, 70, 64, torch.float16, gen=gen)
    up = torch.randn(1, 4, 40, 64, generator=gen).half()
    grads = {}
    for impl in ("triton", "reference"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = A.flash_attention(*leaves, causal=True, window=24, return_lse=True, impl=impl)
        grads[impl] = torch.autograd.grad((out.float() * up).sum() + lse.sum(), leaves)
    for name, a, b in zip("qkv", grads["triton"], grads["reference"]):
        assert a.dtype == torch.float16 and _rel(a, b) < 5e-3, (name, _rel(a, b))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", BWD_WINDOW_SHAPES + [(2, 32, 8, 1000, 1000, 128, True, 256),
                                                       (1, 8, 8, 513, 2048, 64, False, 300),
                                                       (1, 8, 2, 700, 1500, 256, True, 100)])
def test_gpu_flash_backward_kernel_with_a_window(shape, dtype, requires_gpus):
    requires_gpus(1)
    _check_bwd_window(shape, "cuda", dtype, 2e-3 if dtype == torch.float16 else 1.5e-2)


@pytest.mark.gpu
def test_gpu_windowed_grad_is_remembered_apart(requires_gpus):
    # impl="auto" with grad and a window: the forward kernel (on sm90 the Gluon one, the keys a multiple of its
    # tile) and the backward kernel, gradients within bfloat16 rounding of the reference's autograd; remembered
    # under a key of its own: windowed and unwindowed calls of one geometry, alternating, each keep their values.
    requires_gpus(1)
    q, k, v = _qkv(1, 8, 2, 1024, 1024, 128, torch.bfloat16, "cuda")
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    want = {}
    for window in (256, None):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = A.reference_flash_attention(*leaves, causal=True, window=window)
        want[window] = (out, torch.autograd.grad(out, leaves, dout))
    for _ in range(2):
        for window in (256, None):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = A.flash_attention(*leaves, causal=True, window=window)
            grads = torch.autograd.grad(out, leaves, dout)
            assert _rel(out, want[window][0]) < TOL[torch.bfloat16], window
            for name, a, b in zip("qkv", grads, want[window][1]):
                assert a.dtype == torch.bfloat16 and _rel(a, b) < 2e-2, (window, name, _rel(a, b))
    hits = [(key, hit) for key, hit in A._PATHS.items() if isinstance(key, tuple) and key[1] == "flash-grad"]
    windows = {key[11]: hit for key, hit in hits}  # (class, value) pairs: window is the 6th option
    assert {256, None} <= set(windows), list(windows)
    if torch.cuda.get_device_capability()[0] == 9:
        assert windows[256][3].fn is _ws_kernel() and windows[256][3].kwargs["WINDOWED"]


def _ws_kernel():
    from xelink.kernels.flash_ws import _flash_ws_kernel

    return _flash_ws_kernel


# (B, Hq, Hkv, Sq, Sk, causal, window) the Gluon kernel takes (Sk a multiple of its key tile: 128, or 64 at head
# dim 256): a window of one key, windows cut inside a tile and across tiles, Sq below and above Sk (the first rows
# see none), a window over every key, a non-causal window, a query block whose rows' windows start in 3 tiles
WS_CASES = [(1, 4, 2, 256, 256, True, 1), (2, 4, 1, 200, 384, True, 100), (1, 2, 2, 300, 256, True, 64),
            (1, 4, 2, 384, 384, False, 100), (1, 4, 4, 1024, 1024, True, 129), (1, 8, 2, 640, 640, True, 640),
            (1, 2, 1, 512, 512, True, 200), (1, 8, 2, 2048, 2048, True, 1024)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", A.HEAD_DIMS)
def test_gpu_gluon_kernel_with_a_window(requires_gpus, d, dtype):
    # impl="cuda" (and "auto") on sm90 with a window: the warp-specialized Gluon kernel where it applies (its key loop
    # from the tile of each block's first row's first key, the tiles before the last row's first key masked), the
    # reference's values; the TMA kernel where it does not (Sk not a multiple of the tile)
    requires_gpus(1)
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is sm90's")
    for b, hq, hkv, sq, sk, causal, window in WS_CASES:
        q, k, v = _qkv(b, hq, hkv, sq, sk, d, dtype, "cuda")
        plan = A._FlashLaunch(q, k, v, None, causal, 0.1, "cuda", "off", None, False, window)
        assert plan.fn is _ws_kernel() and plan.kwargs["WINDOWED"], (sq, sk)
    _check_flash("cuda", d, dtype, WS_CASES, d + 5, "cuda")
    _check_flash("cuda", d, dtype, WS_CASES[:2], d + 6, "auto")
    q, k, v = _qkv(1, 8, 2, 1000, 1000, d, dtype, "cuda")
    plan = A._FlashLaunch(q, k, v, None, True, 0.1, "cuda", "off", None, False, 256)
    assert plan.fn is A._flash_fwd_tma_kernel and plan.kwargs["WINDOWED"]
    out = A.flash_attention(q, k, v, causal=True, window=256)
    assert _rel(out, A.reference_flash_attention(q, k, v, causal=True, window=256)) < TOL[dtype]
    assert _rel(A.flash_attention(q, k, v, causal=True), out) > 0.05  # (the window changes the values)

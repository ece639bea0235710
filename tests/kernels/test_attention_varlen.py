"""flash_attention_varlen / flash_attention_varlen_backward: attention over packed sequences of different lengths
(FlashAttention's ``flash_attn_varlen_func``; ``cu_seqlens`` offsets, LSE (Hq, total_q)).

The reference path against float64 attention written out sequence by sequence (CPU); a batch of equal lengths against
``flash_attention`` of its (B, H, S, D) view, bit for bit on the reference path; the portable kernel's VARLEN mode
(forward and the backward's three passes) against the reference in Triton's interpreter (TRITON_INTERPRET=1, float16:
the interpreter's bfloat16 dot is wrong), on default tiles and on 16 x 16 ones so that short sequences cross many
tiles; autograd against float64 autograd; every bad argument; and on a GPU (marked) bfloat16 / float16 at head dims
64 / 128 / 256 on a larger ragged batch, a batch of more sequence-heads than a grid's second dimension takes, and a
CUDA graph replayed with new inputs and new offsets."""
import itertools
import os

import pytest
import torch

import xelink.kernels
import xelink.ops
from xelink.kernels import attention as A
from xelink.kernels import common
from xelink.kernels import flash_attention, flash_attention_varlen, flash_attention_varlen_backward

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1" and A.triton is not None
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3, torch.float32: 1e-5, torch.float64: 1e-12}
FN = "flash_attention_varlen"


def _rel(out, ref):
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def _cu(lens, device="cpu", dtype=torch.int32):
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=dtype, device=device)


def _packed(lq, lk, hq, hkv, d, dtype=torch.float32, device="cpu", gen=None):
    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    return r(sum(lq), hq, d), r(sum(lk), hkv, d), r(sum(lk), hkv, d)


def _attn64(q, k, v, lq, lk, causal, window=None):
    """float64 attention of each sequence alone, the mask written out: query i of Sq sees keys j with
    ``last - window < j <= last``, last = i + Sk - Sq (causal) or Sk - 1; rows that see nothing give 0 and LSE -inf.
    Differentiable. Returns out (total_q, Hq, D) and lse (Hq, total_q)."""
    hq, d = q.shape[1], q.shape[2]
    g = hq // k.shape[1]
    outs, lses = [], []
    q0 = k0 = 0
    for sq, sk in zip(lq, lk):
        qb = q[q0:q0 + sq].double().transpose(0, 1)  # (Hq, Sq, D)
        kb = k[k0:k0 + sk].double().repeat_interleave(g, dim=1).transpose(0, 1)
        vb = v[k0:k0 + sk].double().repeat_interleave(g, dim=1).transpose(0, 1)
        i = torch.arange(sq)[:, None]
        j = torch.arange(sk)[None, :]
        last = i + sk - sq if causal else torch.full_like(i, sk - 1)
        vis = j <= last
        if window is not None:
            vis = vis & (j > last - window)
        seen = vis.any(-1, keepdim=True)  # (Sq, 1)
        s = torch.where(vis, qb @ kb.transpose(-1, -2) / d ** 0.5, float("-inf"))
        s = torch.where(seen, s, 0.0)  # a row that sees nothing: no NaN, weight 0 below
        outs.append(((torch.softmax(s, -1) * seen) @ vb).transpose(0, 1))
        lses.append(torch.where(seen[:, 0], torch.logsumexp(s, -1), float("-inf")))
        q0, k0 = q0 + sq, k0 + sk
    return torch.cat(outs), torch.cat(lses, dim=1)


# (lengths q, lengths k, Hq, Hkv, D, causal, window): zero-length sequences on either side, Sq > Sk (rows that see
# nothing under causal) and Sq < Sk, GQA 4/2 and MHA, windows of 1, 3 and past every sequence
CASES = [
    ([5, 0, 17, 1], [5, 0, 17, 1], 4, 2, 16, True, None),
    ([5, 0, 17, 1], [9, 3, 4, 0], 4, 2, 16, True, None),
    ([5, 0, 17, 1], [2, 7, 30, 6], 2, 2, 64, False, None),
    ([5, 0, 17, 1], [2, 7, 30, 6], 4, 2, 16, True, 1),
    ([5, 0, 17, 1], [9, 3, 4, 0], 4, 4, 16, True, 3),
    ([5, 0, 17, 1], [2, 7, 30, 6], 4, 2, 64, False, 3),
    ([5, 0, 17, 1], [5, 0, 17, 1], 4, 2, 16, True, 100),
    ([3], [0], 2, 1, 16, False, None),
]


@pytest.mark.parametrize("case", CASES)
def test_reference_against_float64(case):
    lq, lk, hq, hkv, d, causal, window = case
    q, k, v = _packed(lq, lk, hq, hkv, d)
    for dtype in (torch.float32, torch.float64):
        args = (q.to(dtype), k.to(dtype), v.to(dtype), _cu(lq), _cu(lk))
        out, lse = flash_attention_varlen(*args, causal=causal, return_lse=True, window=window)
        want, want_lse = _attn64(q, k, v, lq, lk, causal, window)
        assert out.dtype == dtype and out.shape == q.shape and lse.dtype == torch.float32
        assert lse.shape == (hq, sum(lq))
        assert _rel(out, want) < TOL[dtype], (case, dtype, _rel(out, want))
        finite = torch.isfinite(want_lse)
        assert torch.equal(torch.isfinite(lse), finite), case
        assert torch.allclose(lse[finite].double(), want_lse[finite], rtol=0, atol=1e-5), case
        assert torch.equal(out[(~finite).T], torch.zeros_like(out[(~finite).T]))  # rows that see nothing: 0
        assert torch.equal(flash_attention_varlen(*args, causal=causal, window=window), out)  # return_lse=False
    # int64 offsets, given longest lengths (longer than needed too), an explicit scale
    got = flash_attention_varlen(q, k, v, _cu(lq, dtype=torch.int64), _cu(lk, dtype=torch.int64), max(lq) + 3,
                                 max(lk), causal=causal, window=window, scale=0.3)
    want = _attn64(q * (0.3 * d ** 0.5), k, v, lq, lk, causal, window)[0]
    assert _rel(got, want) < 1e-5


def test_exported():
    assert xelink.ops.flash_attention_varlen is flash_attention_varlen
    assert xelink.ops.flash_attention_varlen_backward is flash_attention_varlen_backward
    assert {"flash_attention_varlen", "flash_attention_varlen_backward"} <= set(xelink.ops.__all__)
    assert {"flash_attention_varlen", "flash_attention_varlen_backward"} <= set(xelink.kernels.__all__)


@pytest.mark.parametrize("causal,window,sq,sk", [(True, None, 12, 12), (False, None, 7, 11), (True, 4, 9, 5),
                                                 (False, 3, 12, 12)])
def test_equal_lengths_are_flash_attention(causal, window, sq, sk):
    # A batch of equal lengths is flash_attention of its (B, H, S, D) view on the reference path, bit for bit sequence
    # by sequence (the same torch ops on the same views; the batched call's matmuls may round otherwise, by the BLAS
    # kernels a CPU picks: within float32 rounding); its backward is flash_attention_backward's
    B, hq, hkv, d = 3, 4, 2, 16
    q, k, v = _packed([sq] * B, [sk] * B, hq, hkv, d)
    cu_q, cu_k = _cu([sq] * B), _cu([sk] * B)
    out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, causal=causal, return_lse=True, window=window)

    def padded(t, s):  # (B*S, H, D) -> (B, H, S, D)
        return t.reshape(B, s, t.shape[1], d).transpose(1, 2)
    qp, kp, vp = padded(q, sq), padded(k, sk), padded(v, sk)
    want, want_lse = flash_attention(qp, kp, vp, causal=causal, return_lse=True, impl="reference", window=window)
    got_lse = lse.reshape(hq, B, sq).transpose(0, 1)
    torch.testing.assert_close(padded(out, sq), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-5, atol=1e-6)
    for b in range(B):
        one, one_lse = flash_attention(qp[b:b + 1], kp[b:b + 1], vp[b:b + 1], causal=causal, return_lse=True,
                                       impl="reference", window=window)
        assert torch.equal(padded(out, sq)[b:b + 1], one) and torch.equal(got_lse[b:b + 1], one_lse), b
    dout = torch.randn_like(q)
    dlse = torch.randn_like(lse)
    got = flash_attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=causal, dlse=dlse, window=window)
    ref = A.flash_attention_backward(padded(dout, sq), qp, kp, vp, want, want_lse, causal=causal, impl="reference",
                                     dlse=dlse.reshape(hq, B, sq).transpose(0, 1), window=window)
    for a, r, s in zip(got, ref, (sq, sk, sk)):
        torch.testing.assert_close(padded(a, s), r, rtol=1e-5, atol=1e-5)


# -- autograd ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[5], ([4, 6], [6, 4], 2, 1, 16, True, None)])
def test_autograd_against_float64(case):
    # Gradients of a loss of the output and the LSE against autograd of the float64 attention written out (to the
    # float32 LSE's rounding, which the backward's probabilities start from, as flash_attention's); the node keeps q,
    # k, v, the output, the LSE and the offsets, nothing of the score matrix's size
    lq, lk, hq, hkv, d, causal, window = case
    gen = torch.Generator().manual_seed(len(lq) + sum(lk))
    q, k, v = (t.double() for t in _packed(lq, lk, hq, hkv, d, gen=gen))
    up = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    w = torch.randn(hq, sum(lq), generator=gen, dtype=torch.float64)
    cu_q, cu_k = _cu(lq), _cu(lk)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, lse = flash_attention_varlen(*leaves, cu_q, cu_k, causal=causal, return_lse=True, window=window)
    assert out.grad_fn is not None and lse.grad_fn is out.grad_fn
    kept = {t.data_ptr() for t in (*leaves, out, lse, cu_q, cu_k)}
    assert len(saved) == 7 and {t.data_ptr() for t in saved} == kept, [tuple(t.shape) for t in saved]
    seen = torch.isfinite(lse)
    ((out * up).sum() + (torch.where(seen, lse, 0.0) * w).sum()).backward()
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want, want_lse = _attn64(*full, lq, lk, causal, window)
    ((want * up).sum() + (torch.where(seen, want_lse, 0.0) * w).sum()).backward()
    for name, a, b in zip("qkv", leaves, full):
        assert a.grad.dtype == torch.float64 and torch.allclose(a.grad, b.grad, atol=1e-6), (case, name)
    # only the output used (the LSE's gradient None), only the LSE used (the output's None)
    for use_out in (True, False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = flash_attention_varlen(*leaves, cu_q, cu_k, causal=causal, return_lse=True, window=window)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        want, want_lse = _attn64(*full, lq, lk, causal, window)
        for o, s, ls in ((out, lse, leaves), (want, want_lse, full)):
            loss = (o * up).sum() if use_out else (torch.where(seen, s, 0.0) * w).sum()
            loss.backward()
        for a, b in zip(leaves, full):  # (the LSE does not depend on v: autograd of it leaves v's gradient None)
            assert torch.allclose(a.grad, torch.zeros_like(a) if b.grad is None else b.grad, atol=1e-6), (case, use_out)


def test_backward_reference_float32():
    lq, lk, hq, hkv, d, causal, window = CASES[5]
    q, k, v = _packed(lq, lk, hq, hkv, d)
    out, lse = flash_attention_varlen(q, k, v, _cu(lq), _cu(lk), causal=causal, return_lse=True, window=window)
    dout = torch.randn_like(q)
    got = flash_attention_varlen_backward(dout, q, k, v, out, lse, _cu(lq), _cu(lk), causal=causal, window=window)
    assert all(g.dtype == torch.float32 for g in got)
    half = flash_attention_varlen_backward(dout, q, k, v, out, lse, _cu(lq), _cu(lk), causal=causal, window=window,
                                           dtype=torch.float16)
    assert all(h.dtype == torch.float16 and torch.equal(h, g.half()) for h, g in zip(half, got))
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    (_attn64(*leaves, lq, lk, causal, window)[0] * dout.double()).sum().backward()
    for a, t in zip(got, leaves):
        assert _rel(a, t.grad) < 1e-5


# -- bad arguments -----------------------------------------------------------------------------------------------

def _good():
    q, k, v = _packed([3, 2], [4, 1], 4, 2, 16)
    return dict(q=q, k=k, v=v, cu_seqlens_q=_cu([3, 2]), cu_seqlens_k=_cu([4, 1]))


def _bad_cases():
    g = _good()
    q, k, v = g["q"], g["k"], g["v"]
    i32 = torch.int32
    return [  # (changes, exception, message after "flash_attention_varlen: ")
        (dict(q=q[None]), ValueError, r"q.shape=\(1, 5, 4, 16\) must have 3 dims"),
        (dict(q="q"), TypeError, "q must be a torch.Tensor, got str"),
        (dict(q=q.long(), k=k.long(), v=v.long()), TypeError, "q.dtype=torch.int64 must be a floating-point"),
        (dict(k=k.double()), TypeError, "dtypes differ: q.dtype=torch.float32, k.dtype=torch.float64"),
        (dict(v=v[:, :1]), ValueError, r"k.shape=\(5, 2, 16\) != v.shape=\(5, 1, 16\)"),
        (dict(k=k[..., :8], v=v[..., :8]), ValueError, "head_dim differs: q.shape.2.=16 != k.shape.2.=8"),
        (dict(q=q[:, :3]), ValueError, "q heads 3 must be a multiple of k heads 2"),
        (dict(cu_seqlens_q=[0, 3, 5]), TypeError, "cu_seqlens_q must be a torch.Tensor, got list"),
        (dict(cu_seqlens_k=_cu([4, 1]).float()), TypeError, "cu_seqlens_k.dtype=torch.float32 must be torch.int32"),
        (dict(cu_seqlens_q=_cu([3, 2])[None]), ValueError, r"cu_seqlens_q.shape=\(1, 3\) must have 1 dims"),
        (dict(cu_seqlens_q=torch.tensor([5], dtype=i32), cu_seqlens_k=torch.tensor([5], dtype=i32)), ValueError,
         r"cu_seqlens_q.shape=\(1,\) must hold B \+ 1 >= 2 offsets"),
        (dict(cu_seqlens_k=_cu([4, 1, 0])), ValueError, "cu_seqlens_q has 3 offsets, cu_seqlens_k 4"),
        (dict(cu_seqlens_q=torch.tensor([1, 3, 5], dtype=i32)), ValueError, r"cu_seqlens_q\[0\]=1 must be 0"),
        (dict(cu_seqlens_k=torch.tensor([0, 4, 3, 5], dtype=i32), cu_seqlens_q=_cu([3, 2, 0])), ValueError,
         r"cu_seqlens_k must be nondecreasing: cu_seqlens_k\[1\]=4 > cu_seqlens_k\[2\]=3"),
        (dict(cu_seqlens_q=_cu([3, 1])), ValueError, r"cu_seqlens_q\[-1\]=4 must equal the packed rows 5"),
        (dict(cu_seqlens_k=_cu([4, 2])), ValueError, r"cu_seqlens_k\[-1\]=6 must equal the packed rows 5"),
        (dict(cu_seqlens_q=_cu([3, 2]).to("meta")), ValueError, "cu_seqlens_q on meta, q on cpu"),
        (dict(max_seqlen_q=2), ValueError, "max_seqlen_q=2 is less than the longest sequence's 3"),
        (dict(max_seqlen_k=3), ValueError, "max_seqlen_k=3 is less than the longest sequence's 4"),
        (dict(max_seqlen_q=2.5), TypeError, "max_seqlen_q=2.5 must be None or an int >= 0"),
        (dict(max_seqlen_k=True), TypeError, "max_seqlen_k=True must be None or an int >= 0"),
        (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q=-1 must be None or an int >= 0"),
        (dict(causal=1), TypeError, "causal=1 must be a bool"),
        (dict(scale=0.0), ValueError, "scale=0.0 must be finite and > 0"),
        (dict(scale="s"), TypeError, "scale='s' must be a float or None"),
        (dict(return_lse=None), TypeError, "return_lse=None must be a bool"),
        (dict(window=0), ValueError, "window=0 must be None or an int >= 1"),
        (dict(impl="cuda"), ValueError, "impl='cuda' has no kernel here .no TMA / Gluon varlen kernel.; use "
                                        "impl='triton' or 'auto'"),
        (dict(impl="hopper"), ValueError, "impl='hopper' has no kernel here"),
        (dict(impl="fast"), ValueError, "impl='fast' is not one of auto, triton, reference"),
        (dict(impl=None), TypeError, "impl=None must be a str"),
    ]


@pytest.mark.parametrize("index", range(len(_bad_cases())))
def test_bad_arguments(index):
    changes, exc, msg = _bad_cases()[index]
    kw = dict(_good(), **changes)
    with pytest.raises(exc, match=f"^{FN}: {msg}"):
        flash_attention_varlen(**kw)


def _backward_kw():
    g = _good()
    out, lse = flash_attention_varlen(**g, return_lse=True)
    return dict(dout=torch.randn_like(out), out=out, lse=lse, **g)


@pytest.mark.parametrize("changes,exc,msg", [
    (dict(dout=torch.zeros(5, 4, 8)), ValueError, r"dout.shape=\(5, 4, 8\) != q.shape=\(5, 4, 16\)"),
    (dict(out=torch.zeros(5, 4, 16, dtype=torch.int32)), TypeError, "out.dtype=torch.int32 must be a floating"),
    (dict(lse=torch.zeros(5, 4)), ValueError, r"lse.shape=\(5, 4\) must be \(Hq, total_q\)=\(4, 5\)"),
    (dict(lse=torch.zeros(4, 5, dtype=torch.float64)), TypeError, "lse.dtype=torch.float64 must be torch.float32"),
    (dict(dlse=torch.zeros(4, 4)), ValueError, r"dlse \(shape \(4, 4\), torch.float32\) must be a floating tensor"),
    (dict(dtype=torch.int32), TypeError, "dtype=torch.int32 must be None or a floating torch.dtype"),
    (dict(impl="cuda"), ValueError, "impl='cuda' has no kernel here .no TMA / Gluon varlen kernel.; use "
                                    "impl='triton' or 'auto'"),
    (dict(cu_seqlens_q=_cu([2, 2])), ValueError, r"cu_seqlens_q\[-1\]=4 must equal the packed rows 5"),
    (dict(cu_seqlens_k=_cu([4, 2])), ValueError, r"cu_seqlens_k\[-1\]=6 must equal the packed rows 5"),
    (dict(max_seqlen_k=1), ValueError, "max_seqlen_k=1 is less than the longest sequence's 4"),
    (dict(window=-2), ValueError, "window=-2 must be None or an int >= 1"),
])
def test_backward_bad_arguments(changes, exc, msg):
    kw = dict(_backward_kw(), **changes)
    with pytest.raises(exc, match=f"^{FN}_backward: {msg}"):
        flash_attention_varlen_backward(**kw)


def test_capture_needs_the_longest_lengths(monkeypatch):
    # Inside CUDA-graph capture the offsets cannot be read on the host: max_seqlen_q and max_seqlen_k must be given
    # (and are then not checked), and the reference path, which reads them, is refused
    monkeypatch.setattr(A, "_capturing", lambda device: True)
    g = _good()
    for missing in (dict(max_seqlen_q=3), dict(max_seqlen_k=4), {}):
        with pytest.raises(ValueError, match=f"^{FN}: max_seqlen_q=.*inside CUDA-graph capture both must be given"):
            flash_attention_varlen(**g, **missing)
    with pytest.raises(ValueError, match=f"^{FN}: impl='reference' takes the reference path here .*cannot run inside "
                                         f"CUDA-graph capture"):
        flash_attention_varlen(**g, max_seqlen_q=3, max_seqlen_k=4, impl="reference")


@pytest.mark.skipif(INTERPRET, reason="outside the interpreter a kernel path refuses CPU tensors")
def test_kernel_path_refuses_cpu_tensors():
    g = _good()
    with pytest.raises(ValueError, match=f"^{FN}: impl='triton' needs CUDA or XPU tensors"):
        flash_attention_varlen(**g, impl="triton")


# -- the Triton kernels in the interpreter -------------------------------------------------------------------------

# (lengths q, lengths k, Hq, Hkv, causal, window), D = 64: zero-length sequences on both sides, tails of 128 / 64
# tiles (130 queries, 140 keys), Sq > Sk, single rows
KERNEL_CASES = [([5, 0, 17, 1, 130], [9, 3, 17, 0, 140], 4, 2, True, None),
                ([5, 0, 17, 1, 130], [9, 3, 17, 0, 140], 2, 2, False, None),
                ([40, 3, 0, 21], [7, 0, 33, 21], 4, 1, True, 5),
                ([40, 3, 0, 21], [7, 0, 33, 21], 2, 1, False, 9)]


def _small_tiles(monkeypatch):
    """16 x 16 tiles for the forward and both backward passes, so short sequences cross many of them."""
    from xelink.kernels import attention_bwd
    monkeypatch.setitem(A._FWD_CONFIGS, ("triton", 64), (16, 16, 4, 1))
    monkeypatch.setitem(attention_bwd.BWD_CONFIGS, 64, {"dkdv": (16, 16, 4, 1), "dq": (16, 16, 4, 1)})


def _check_kernel(q, k, v, lq, lk, causal, window, tol, max_q=None, max_k=None, dtype_grad=torch.float32):
    """The kernel forward and backward against the reference path (the LSE and its gradient included)."""
    cu_q, cu_k = _cu(lq, q.device), _cu(lk, q.device, torch.int64)
    args = (q, k, v, cu_q, cu_k, max_q, max_k)
    out, lse = flash_attention_varlen(*args, causal=causal, return_lse=True, impl="triton", window=window)
    ref, ref_lse = flash_attention_varlen(*args, causal=causal, return_lse=True, impl="reference", window=window)
    where = (lq, lk, q.shape, k.shape, causal, window)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (q.shape[1], q.shape[0])
    assert not torch.isnan(out).any() and _rel(out, ref) < tol, (where, _rel(out, ref))
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), where
    if finite.any():
        assert (lse[finite] - ref_lse[finite]).abs().max() < 2e-3, where
    gen = torch.Generator().manual_seed(sum(lq))
    dout = torch.randn(q.shape, generator=gen).to(q.device, q.dtype)
    dlse = torch.randn(lse.shape, generator=gen).to(q.device)
    bargs = (dout, q, k, v, ref, ref_lse, *args[3:])
    got = flash_attention_varlen_backward(*bargs, causal=causal, impl="triton", dlse=dlse, window=window,
                                          dtype=dtype_grad)
    want = flash_attention_varlen_backward(*bargs, causal=causal, impl="reference", dlse=dlse, window=window)
    for name, a, w in zip(("dq", "dk", "dv"), got, want):
        assert a.dtype == dtype_grad and a.shape == w.shape, name
        assert torch.isfinite(a).all() and _rel(a, w) < tol, (where, name, _rel(a, w))
    return out, lse, got


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and Triton")
@pytest.mark.parametrize("tiles", ["kept", "16x16"])
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_interpreter_kernel_against_reference(case, tiles, monkeypatch):
    if tiles == "16x16":
        _small_tiles(monkeypatch)
    lq, lk, hq, hkv, causal, window = case
    q, k, v = _packed(lq, lk, hq, hkv, 64, torch.float16, gen=torch.Generator().manual_seed(sum(lq) + hq))
    _check_kernel(q, k, v, lq, lk, causal, window, 3e-3)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and Triton")
def test_interpreter_strided_inputs_and_isolated_sequences(monkeypatch):
    # q, k, v slices of one packed (total, 3, H, D) projection (row stride 3 H D); larger max_seqlen than needed; a
    # sequence whose rows are NaN leaves the others untouched (no tile reads across a sequence's end)
    _small_tiles(monkeypatch)
    lens = [19, 0, 33, 2]
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(sum(lens), 3, 2, 64, generator=gen).half()
    q, k, v = qkv.unbind(1)
    assert q.stride(0) == 3 * 2 * 64 and not q.is_contiguous()
    out, _, grads = _check_kernel(q, k, v, lens, lens, True, None, 3e-3, max_q=50, max_k=40)
    flat = [t.contiguous() for t in (q, k, v)]
    out2, _, grads2 = _check_kernel(*flat, lens, lens, True, None, 3e-3)
    assert torch.equal(out, out2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))
    # GQA heads of one (total, Hq + 2 Hkv, D) projection
    qkv = torch.randn(sum(lens), 4 + 2 + 2, 64, generator=gen).half()
    _check_kernel(qkv[:, :4], qkv[:, 4:6], qkv[:, 6:], lens, lens, False, 7, 3e-3)
    # NaN rows of sequence 2 (rows 19..52): the other sequences' outputs, LSE and gradients as before, finite
    poisoned = [t.clone() for t in flat]
    for t in poisoned:
        t[19:52] = float("nan")
    cu = _cu(lens)
    got, got_lse = flash_attention_varlen(*poisoned, cu, cu, causal=True, return_lse=True, impl="triton")
    keep = torch.ones(sum(lens), dtype=torch.bool)
    keep[19:52] = False
    assert torch.equal(got[keep], out[keep])
    grads = flash_attention_varlen_backward(torch.ones_like(got), *poisoned, got, got_lse, cu, cu, causal=True,
                                            impl="triton")
    clean = flash_attention_varlen_backward(torch.ones_like(got), *flat, out, got_lse.nan_to_num(), cu, cu,
                                            causal=True, impl="triton")
    for g, c in zip(grads, clean):
        assert torch.equal(g[keep], c[keep])


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and Triton")
def test_interpreter_strided_offsets(monkeypatch):
    # cu_seqlens that are strided views (a column of a (B + 1, 2) table, every other entry of a longer one): the
    # kernels read the offsets at CU + b, so the wrappers must hand them a contiguous copy, not the view's storage
    _small_tiles(monkeypatch)
    lq, lk = [5, 0, 20, 3], [9, 3, 17, 1]
    q, k, v = _packed(lq, lk, 2, 1, 64, torch.float16, gen=torch.Generator().manual_seed(4))
    cu_q = torch.stack([_cu(lq), torch.full((5,), 10 ** 6, dtype=torch.int32)], 1)[:, 0]
    cu_k = torch.stack([_cu(lk, dtype=torch.int64), torch.full((5,), -7, dtype=torch.int64)], 1).flatten()[::2]
    assert cu_q.stride() == (2,) and cu_k.stride() == (2,)
    out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True, impl="triton")
    ref, ref_lse = flash_attention_varlen(q, k, v, _cu(lq), _cu(lk), causal=True, return_lse=True, impl="reference")
    assert _rel(out, ref) < 3e-3
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).half()
    got = flash_attention_varlen_backward(dout, q, k, v, ref, ref_lse, cu_q, cu_k, causal=True, impl="triton")
    want = flash_attention_varlen_backward(dout, q, k, v, ref, ref_lse, _cu(lq), _cu(lk), causal=True,
                                           impl="reference")
    for name, a, w in zip(("dq", "dk", "dv"), got, want):
        assert _rel(a, w) < 3e-3, name


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and Triton")
def test_interpreter_grad_runs_the_kernels():
    # With grad on the named Triton path: the kernel forward, then the kernels backward (dtype of the inputs);
    # gradients within float16 rounding of the reference path's
    lq, lk = [7, 0, 40], [12, 5, 40]
    gen = torch.Generator().manual_seed(5)
    q, k, v = _packed(lq, lk, 4, 2, 64, torch.float16, gen=gen)
    up = torch.randn(q.shape, generator=gen).half()
    grads = {}
    for impl in ("triton", "reference"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = flash_attention_varlen(*leaves, _cu(lq), _cu(lk), causal=True, return_lse=True, impl=impl,
                                          window=20)
        grads[impl] = torch.autograd.grad((out.float() * up).sum() + lse.sum(), leaves)
    for name, a, b in zip("qkv", grads["triton"], grads["reference"]):
        assert a.dtype == torch.float16 and _rel(a, b) < 5e-3, (name, _rel(a, b))


# -- the GPU ------------------------------------------------------------------------------------------------------

GPU_LENS = [([1000, 1, 513, 2048, 0, 77], [1000, 1, 513, 2048, 0, 77]),
            ([1000, 1, 513, 2048, 0, 77], [1500, 9, 0, 2048, 31, 300])]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", A.HEAD_DIMS)
def test_gpu_kernel_against_reference(requires_gpus, d, dtype):
    requires_gpus(1)
    gen = torch.Generator().manual_seed(d)
    tol = TOL[dtype] if dtype == torch.bfloat16 else 3e-3
    for (lq, lk), causal, window in itertools.product(GPU_LENS, (True, False), (None, 256)):
        q, k, v = _packed(lq, lk, 32, 8, d, dtype, "cuda", gen)
        _check_kernel(q, k, v, lq, lk, causal, window, tol)
    # "auto" takes the kernel on the GPU, with grad too
    lq, lk = GPU_LENS[1]
    q, k, v = _packed(lq, lk, 32, 8, d, dtype, "cuda", gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attention_varlen(*leaves, _cu(lq, "cuda"), _cu(lk, "cuda"), causal=True)
    grads = torch.autograd.grad(out.float().square().sum(), leaves)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = flash_attention_varlen(*ref_leaves, _cu(lq, "cuda"), _cu(lk, "cuda"), causal=True, impl="reference")
    want = torch.autograd.grad(ref.float().square().sum(), ref_leaves)
    assert _rel(out, ref) < tol
    for a, b in zip(grads, want):
        assert a.dtype == dtype and _rel(a, b) < tol


@pytest.mark.gpu
def test_gpu_many_sequences(requires_gpus):
    # 2200 sequences x 32 heads: more sequence-heads than a grid's second dimension takes (65535)
    requires_gpus(1)
    gen = torch.Generator().manual_seed(1)
    lens = torch.randint(0, 9, (2200,), generator=gen).tolist()
    lk = torch.randint(0, 9, (2200,), generator=gen).tolist()
    q, k, v = _packed(lens, lk, 32, 8, 64, torch.float16, "cuda", gen)
    _check_kernel(q, k, v, lens, lk, True, None, 3e-3)


@pytest.mark.gpu
def test_gpu_cuda_graph(requires_gpus):
    # Forward and backward captured with max_seqlen given, replayed with new inputs and new offsets (same totals,
    # other splits within the given longest lengths)
    requires_gpus(1)
    gen = torch.Generator().manual_seed(7)
    total, hq, hkv, d, dtype = 1200, 16, 4, 128, torch.bfloat16
    splits = [[300, 0, 800, 100], [1, 1199, 0, 0], [600, 600, 0, 0], [0, 0, 0, 1200]]
    kv_splits = [[500, 100, 300, 300], [1200, 0, 0, 0], [100, 1000, 50, 50], [0, 600, 0, 600]]
    static = [t.contiguous() for t in _packed([total], [total], hq, hkv, d, dtype, "cuda", gen)]
    cu_q, cu_k = _cu(splits[0], "cuda"), _cu(kv_splits[0], "cuda")
    dout = torch.randn(total, hq, d, generator=gen).to("cuda", dtype)
    kw = dict(causal=True, impl="triton", window=700)

    def step():
        out, lse = flash_attention_varlen(*static, cu_q, cu_k, total, total, return_lse=True, **kw)
        return out, lse, flash_attention_varlen_backward(dout, *static, out, lse, cu_q, cu_k, total, total, **kw)
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step()
    for sq, sk in zip(splits, kv_splits):
        for s_, n in zip(static, _packed([total], [total], hq, hkv, d, dtype, "cuda", gen)):
            s_.copy_(n)
        cu_q.copy_(_cu(sq, "cuda"))
        cu_k.copy_(_cu(sk, "cuda"))
        graph.replay()
        torch.cuda.synchronize()
        want = step()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (sq, sk)
        assert all(torch.equal(a, b) for a, b in zip(got[2], want[2])), (sq, sk)
        ref = flash_attention_varlen(*static, cu_q, cu_k, causal=True, impl="reference", window=700)
        assert _rel(got[0], ref) < TOL[dtype], (sq, sk)


def test_cpu_offsets_are_read_every_call():
    # CPU offsets cost no sync to read: every call reads them, so writes torch does not count (a numpy view, .data)
    # are seen as well as in-place ones, never a stale copy; an invalid write is refused.
    gen = torch.Generator().manual_seed(7)
    q, k, v = _packed([4, 6, 2], [4, 6, 2], 2, 1, 16, torch.float64, gen=gen)
    cu = _cu([4, 6, 2])
    writes = [lambda t: cu.copy_(t), lambda t: cu.numpy().__setitem__(slice(None), t.numpy()),
              lambda t: cu.data.copy_(t)]
    for lens, write in zip(([4, 6, 2], [7, 1, 4], [2, 2, 8], [4, 6, 2]), writes + writes[1:2]):
        write(_cu(lens))
        out = flash_attention_varlen(q, k, v, cu, cu, causal=True)
        assert _rel(out, _attn64(q, k, v, lens, lens, True)[0]) < TOL[torch.float64], lens
    assert id(cu) not in common._HOST_VALUES
    cu[1] = 20  # no longer nondecreasing
    with pytest.raises(ValueError, match=f"^{FN}: cu_seqlens_q must be nondecreasing"):
        flash_attention_varlen(q, k, v, cu, cu, causal=True)


@pytest.mark.gpu
def test_gpu_offsets_are_read_once_a_tensor_and_version(requires_gpus):
    # On a GPU the offsets cross to the host (a sync) once a tensor and version (a training step's layers share one
    # cu_seqlens): a repeated call reuses them, an in-place write (a new layout, then an invalid one) is seen.
    requires_gpus(1)
    gen = torch.Generator().manual_seed(7)
    q, k, v = _packed([4, 6, 2], [4, 6, 2], 2, 1, 64, torch.float64, gen=gen)
    cu = _cu([4, 6, 2], device="cuda")
    for lens in ([4, 6, 2], [4, 6, 2], [7, 1, 4]):
        cu.copy_(_cu(lens))
        out = flash_attention_varlen(*(t.cuda() for t in (q, k, v)), cu, cu, causal=True, impl="reference")
        assert _rel(out.cpu(), _attn64(q, k, v, lens, lens, True)[0]) < TOL[torch.float64], lens
        hit = common._HOST_VALUES[id(cu)]
        assert hit[0]() is cu and hit[1] == cu._version and hit[2] == cu.tolist()
    cu[1] = 20
    with pytest.raises(ValueError, match=f"^{FN}: cu_seqlens_q must be nondecreasing"):
        flash_attention_varlen(q.cuda(), k.cuda(), v.cuda(), cu, cu, causal=True)


def test_torch_compile_traces_the_custom_op():
    # Under torch.compile (fullgraph: no graph break at the host read of the offsets) the call is the custom op: its
    # values equal the eager call's, and a compiled loss of out and lse gives the eager gradients (the backward op).
    gen = torch.Generator().manual_seed(8)
    lens_q, lens_k = [5, 0, 9], [7, 2, 9]
    q, k, v = _packed(lens_q, lens_k, 4, 2, 16, torch.float64, gen=gen)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)

    def f(q, k, v):
        out, lse = flash_attention_varlen(q * 1.0, k, v, cu_q, cu_k, causal=True, window=4, return_lse=True)
        return out + 0.0, lse

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        got, want = compiled(q, k, v), f(q, k, v)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    grads = []
    for fn in (f, compiled):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = fn(*leaves)
        (out.square().sum() + lse[torch.isfinite(lse)].sum()).backward()
        grads.append([t.grad for t in leaves])
    for name, a, b in zip("qkv", *grads):
        assert torch.allclose(a, b, atol=1e-12), name


def test_custom_ops_fakes_match_the_real_results():
    # The custom ops' fake (meta) results must have the real ones' shapes, dtypes and strides, which are
    # contiguous whatever q, k, v's layout: a fake that copied a permuted q's strides failed inductor's
    # assert_size_stride on the backward op's dq (opcheck's test_faketensor catches it without compiling)
    gen = torch.Generator().manual_seed(9)
    lq, lk = [5, 3], [4, 6]
    q, k, v = _packed(lq, lk, 4, 2, 16, torch.float64, gen=gen)
    q, k = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (q, k))  # dense, not contiguous
    cu_q, cu_k = _cu(lq), _cu(lk)
    fwd = (q, k, v, cu_q, cu_k, -1, -1, True, None, "auto", 0)
    torch.library.opcheck(torch.ops.xelink.flash_attention_varlen.default, fwd, test_utils=("test_faketensor",))
    out, lse = torch.ops.xelink.flash_attention_varlen(*fwd)
    bwd = (torch.randn(q.shape, generator=gen, dtype=torch.float64), None, q, k, v, out, lse, cu_q, cu_k, -1, -1,
           True, None, "auto", 0)
    torch.library.opcheck(torch.ops.xelink.flash_attention_varlen_backward.default, bwd,
                          test_utils=("test_faketensor",))


@pytest.mark.parametrize("changes,exc,msg", [
    (dict(window=0), ValueError, "window=0 must be None or an int >= 1"),
    (dict(window=True), ValueError, "window=True must be None or an int >= 1"),
    (dict(max_seqlen_q=-1), ValueError, "max_seqlen_q=-1 must be None or an int >= 0"),
    (dict(max_seqlen_k=2.5), TypeError, "max_seqlen_k=2.5 must be None or an int >= 0"),
    (dict(scale=True), TypeError, "scale=True must be a float or None"),
    (dict(causal=1), TypeError, "causal=1 must be a bool"),
    (dict(return_lse=None), TypeError, "return_lse=None must be a bool"),
    (dict(impl=None), TypeError, "impl=None must be a str"),
])
def test_torch_compile_checks_the_scalar_arguments(changes, exc, msg):
    # Traced, the call's scalars go to the custom op as its sentinels (-1 lengths, window 0) and casts (float(scale),
    # bool(causal)): they are checked while tracing, as the eager call checks them, not taken (window=0 ran
    # unwindowed). The raise is a graph break: the eager call then raises it; fullgraph, Dynamo's error carries it
    g = _good()

    def f(q, k, v):
        return flash_attention_varlen(q, k, v, g["cu_seqlens_q"], g["cu_seqlens_k"], **changes)
    for fullgraph in (False, True):
        torch._dynamo.reset()
        with pytest.raises(Exception if fullgraph else exc, match=("" if fullgraph else "^") + f"{FN}: {msg}"):
            torch.compile(f, backend="aot_eager", fullgraph=fullgraph)(g["q"], g["k"], g["v"])


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and Triton")
def test_interpreter_grids_cover_the_longest_sequence_read(monkeypatch):
    # max_seqlen_q / max_seqlen_k far above the longest sequence (a context limit passed as FlashAttention takes it):
    # outside CUDA-graph capture the offsets are read anyway, so the grids cover the longest sequence read, not the
    # given bound (whose tiles would all return at once: wasted programs, a hang in the interpreter, and past 65535
    # tiles a grid the GPU refuses)
    from xelink.kernels import attention_bwd
    grids = []

    def recording(launch):
        def run(fn, grid, *args, **kwargs):
            grids.append(grid[1])
            assert grid[1] <= 4, grid  # 40 rows, BLOCK_M / BLOCK_N >= 16 (the tiles below)
            return launch(fn, grid, *args, **kwargs)
        return run
    _small_tiles(monkeypatch)
    monkeypatch.setattr(A, "launch", recording(A.launch))
    monkeypatch.setattr(attention_bwd, "launch", recording(attention_bwd.launch))
    lq, lk = [40, 3], [33, 9]
    q, k, v = _packed(lq, lk, 2, 1, 64, torch.float16, gen=torch.Generator().manual_seed(6))
    _check_kernel(q, k, v, lq, lk, True, None, 3e-3, max_q=10 ** 7, max_k=10 ** 7)
    assert len(grids) == 4  # forward, delta, dk/dv, dq


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and Triton")
def test_interpreter_a_sequence_longer_than_the_grid_takes_is_refused(monkeypatch):
    # A sequence whose tiles exceed the grid's second dimension (CUDA: 65535; here lowered) is refused naming
    # the function and the lengths before anything runs: the forward alone, the forward with grad (whose backward
    # needs more tiles), the backward; the reference path takes it.
    monkeypatch.setattr(A, "_GRID_TILES", 1)
    gen = torch.Generator().manual_seed(9)
    lens = [200, 3]
    q, k, v = _packed(lens, lens, 2, 1, 64, torch.float16, gen=gen)
    cu = _cu(lens)
    msg = r"the longest sequence \(max_seqlen_q=200, max_seqlen_k=200\) needs \d+ tiles on the kernel's grid"
    with pytest.raises(ValueError, match=f"^{FN}: {msg}"):
        flash_attention_varlen(q, k, v, cu, cu, causal=True, impl="triton")
    with pytest.raises(ValueError, match=f"^{FN}: {msg}"):
        flash_attention_varlen(q.requires_grad_(), k, v, cu, cu, causal=True, impl="triton")
    q = q.detach()
    out, lse = flash_attention_varlen(q, k, v, cu, cu, causal=True, impl="reference", return_lse=True)
    with pytest.raises(ValueError, match=f"^{FN}_backward: {msg}"):
        flash_attention_varlen_backward(out, q, k, v, out, lse, cu, cu, causal=True, impl="triton")
    monkeypatch.setattr(A, "_GRID_TILES", 2)  # the forward's 2 tiles of 128 rows fit; the backward's 4 of 64 do not
    assert flash_attention_varlen(q, k, v, cu, cu, causal=True, impl="triton").shape == q.shape
    with pytest.raises(ValueError, match=f"^{FN}: {msg}"):
        flash_attention_varlen(q.requires_grad_(), k, v, cu, cu, causal=True, impl="triton")

"""The kernels are forward only, flash attention aside. An input that requires grad (in grad mode) must never get
an output that silently left the autograd graph: ``impl="auto"`` takes the reference path (differentiable:
gradients equal those of an independent torch spelling of the op), a named kernel path raises before any work,
and in ``torch.no_grad()`` / ``torch.inference_mode()`` nothing changes. ``flash_attention`` has a backward
(``flash_attention_backward``): with grad every path is the forward of an autograd node, a named kernel included.
Kernel paths run on CPU tensors only in Triton's interpreter; the raise is checked without it (it comes before
the device checks). On a GPU "auto" runs the kernels, so the switch to the reference shows there (marked test)."""
import pytest
import torch
import torch.nn.functional as F

from xelink.kernels import (decode_attention, flash_attention, gemm, gemv, merge_attention, rmsnorm, rope,
                            rope_decode_attention, rope_kv, silu_mul)
from xelink.kernels.common import forward_only, triton_can_run

HALF = torch.bfloat16


def _leaf(*shape, seed=0, device="cpu", dtype=HALF):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device, dtype).requires_grad_()


def _rope_tables(S, D, device="cpu"):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    ang = torch.arange(S).float()[:, None] * inv[None, :]
    ang = torch.cat((ang, ang), dim=-1)
    return ang.cos().to(device), ang.sin().to(device)


def _rotate(x, c, s):
    x1, x2 = x.chunk(2, dim=-1)
    return x * c + torch.cat((-x2, x1), dim=-1) * s


# name -> (call(impl) -> a tensor to differentiate, its leaves, an independent torch spelling of that tensor)
def _cases(device="cpu", dtype=HALF):
    seeds = iter(range(100))

    def leaf(*shape):
        return _leaf(*shape, seed=next(seeds), device=device, dtype=dtype)

    cases = {}
    a, b = leaf(8, 16), leaf(16, 12)
    cases["gemm"] = (lambda impl: gemm(a, b, impl), (a, b), lambda: a.float() @ b.float())
    w, x = leaf(24, 128), leaf(2, 128)
    fmt = "bf16" if dtype == torch.bfloat16 else "fp16"
    cases["gemv"] = (lambda impl: gemv(w, x, None, fmt, impl), (w, x), lambda: x.float() @ w.float().t())
    h, r, nw = leaf(4, 64), leaf(4, 64), leaf(64)

    def norm_torch():
        s = h.float() + r.float()
        return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.float()
    cases["rmsnorm"] = (lambda impl: rmsnorm(h, nw, 1e-6, residual=r, impl=impl)[0], (h, r, nw), norm_torch)
    gu = leaf(4, 2, 64)
    cases["silu_mul"] = (lambda impl: silu_mul(gu, impl), (gu,),
                         lambda: F.silu(gu.float()[..., :32]) * gu.float()[..., 32:])
    q, k = leaf(1, 4, 8, 64), leaf(1, 2, 8, 64)
    cos, sin = _rope_tables(8, 64, device)
    cases["rope"] = (lambda impl: torch.cat([t.flatten() for t in rope(q, k, cos, sin, impl)]), (q, k),
                     lambda: torch.cat([_rotate(t.float(), cos, sin).flatten() for t in (q, k)]))
    fq, fk, fv = leaf(1, 2, 16, 64), leaf(1, 2, 16, 64), leaf(1, 2, 16, 64)
    cases["flash_attention"] = (lambda impl: flash_attention(fq, fk, fv, causal=True, impl=impl), (fq, fk, fv),
                                lambda: F.scaled_dot_product_attention(fq.float(), fk.float(), fv.float(),
                                                                       is_causal=True))
    dq, kc, vc = leaf(1, 4, 1, 64), leaf(1, 2, 32, 64), leaf(1, 2, 32, 64)
    lens = torch.tensor([20], device=device)
    cases["decode_attention"] = (lambda impl: decode_attention(dq, kc, vc, lens, impl=impl), (dq, kc, vc),
                                 lambda: F.scaled_dot_product_attention(dq.float(), kc.float()[:, :, :20],
                                                                        vc.float()[:, :, :20], enable_gqa=True))
    o1, o2 = leaf(1, 2, 4, 64), leaf(1, 2, 4, 64)
    l1, l2 = torch.randn(1, 2, 4, device=device), torch.randn(1, 2, 4, device=device)

    def merge_torch():
        w1, w2 = torch.sigmoid(l1 - l2), torch.sigmoid(l2 - l1)  # exp(l_i) / (exp(l1) + exp(l2))
        return w1[..., None] * o1.float() + w2[..., None] * o2.float()
    cases["merge_attention"] = (lambda impl: merge_attention([o1, o2], [l1, l2], impl)[0], (o1, o2), merge_torch)
    return cases


CASES = sorted(_cases())
FORWARD_ONLY = [name for name in CASES if name != "flash_attention"]  # flash_attention has a backward


@pytest.mark.parametrize("name", CASES)
def test_auto_with_grad_is_differentiable(name):
    call, leaves, spelled = _cases()[name]
    got = call("auto")
    assert got.requires_grad and got.grad_fn is not None, name
    want = spelled()
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    up = torch.randn(want.shape, generator=torch.Generator().manual_seed(99))
    g_got = torch.autograd.grad(got.float(), leaves, up)
    g_want = torch.autograd.grad(want, leaves, up)
    for x, y in zip(g_got, g_want):
        scale = max(1.0, float(y.abs().max()))
        torch.testing.assert_close(x.float() / scale, y.float() / scale, atol=3e-2, rtol=3e-2,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("name", FORWARD_ONLY)
def test_a_named_kernel_path_with_grad_raises_before_any_work(name):
    call, leaves, _ = _cases()[name]
    fn = name
    with pytest.raises(ValueError, match=rf"^{fn}: \S+ requires grad, but impl='triton' is forward only"):
        call("triton")
    with torch.no_grad():  # nothing to differentiate: the named path is as without grad
        try:
            out = call("triton")
        except (ValueError, RuntimeError, TypeError) as exc:  # no interpreter here: the CPU-tensor error
            assert "requires grad" not in str(exc), exc
        else:
            assert not out.requires_grad


def test_rope_kv_and_rope_decode_attention_take_the_reference_for_grad():
    D = 64
    cos, sin = _rope_tables(32, D)
    q, k, v = _leaf(1, 4, 1, D, seed=20), _leaf(1, 2, 1, D, seed=21), _leaf(1, 2, 1, D, seed=22)
    pos = torch.tensor([7])
    kc, vc = torch.zeros(1, 2, 32, D, dtype=HALF), torch.zeros(1, 2, 32, D, dtype=HALF)
    qr = rope_kv(q, k, v, cos, sin, pos, kc, vc)
    assert qr.requires_grad
    want = _rotate(q.float(), cos[7], sin[7])
    torch.testing.assert_close(qr.float(), want, atol=2e-2, rtol=2e-2)
    (gq,) = torch.autograd.grad(qr.float().sum(), (q,))
    (wq,) = torch.autograd.grad(want.sum(), (q,))
    torch.testing.assert_close(gq.float(), wq.float(), atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match=r"^rope_kv: q requires grad, but impl='triton' is forward only"):
        rope_kv(q, k, v, cos, sin, pos, kc, vc, impl="triton")
    out = rope_decode_attention(q, k, v, cos, sin, kc, vc, torch.tensor([8]))
    assert out.requires_grad and out.shape == q.shape
    with pytest.raises(ValueError, match=r"^rope_decode_attention: k requires grad, but impl='triton'"):
        rope_decode_attention(q.detach(), k, v, cos, sin, kc, vc, torch.tensor([8]), impl="triton")


def test_forward_only_rules():
    t, plain = torch.zeros(2, requires_grad=True), torch.zeros(2)
    assert forward_only("f", "auto", x=t) == "reference"
    assert forward_only("f", "cuda", x=plain, y=None) == "cuda"
    assert forward_only("f", "reference", x=t) == "reference"
    with torch.inference_mode():
        assert forward_only("f", "cuda", x=torch.zeros(2)) == "cuda"
    with torch.no_grad():
        assert forward_only("f", "auto", x=t) == "auto"
    with pytest.raises(ValueError, match=r"^f: y requires grad, but impl='auto' is forward only \(no backward\); "
                                         r"call it under torch.no_grad\(\) or torch.inference_mode\(\)$"):
        forward_only("f", "auto", has_reference=False, x=plain, y=t)


@pytest.mark.skipif(not triton_can_run(torch.device("cpu")), reason="needs Triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("name", CASES)
def test_interpreter_named_kernel_runs_in_no_grad(name):
    call, _, _ = _cases(dtype=torch.float16)[name]  # the interpreter's bfloat16 dot is wrong (Triton 3.6)
    with torch.no_grad():
        got, want = call("triton"), call("reference")
    assert not got.requires_grad
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("name", CASES)
def test_gpu_auto_with_grad_after_a_remembered_kernel_call(name, requires_gpus):
    """On a GPU "auto" runs a kernel; a call of the same geometry without grad is remembered first (the
    eager fast path skips the checks), then the call with grad must still take the reference (flash attention:
    its kernel forward with the backward, gradients within bfloat16 rounding of the reference's)."""
    requires_gpus(1)
    call, leaves, _ = _cases("cuda")[name]
    with torch.no_grad():
        fast = call("auto")
    got = call("auto")
    assert got.requires_grad and not fast.requires_grad
    torch.testing.assert_close(fast.float(), got.float(), atol=2e-2, rtol=2e-2)
    ref = call("reference")
    for x, y in zip(torch.autograd.grad(got.float().sum(), leaves), torch.autograd.grad(ref.float().sum(), leaves)):
        if name == "flash_attention":
            torch.testing.assert_close(x.float(), y.float(), atol=3e-2, rtol=3e-2)
        else:
            assert torch.equal(x, y), name
    if name == "flash_attention":
        assert call("triton").grad_fn is not None
    else:
        with pytest.raises(ValueError, match=rf"^{name}: \S+ requires grad"):
            call("triton")


@pytest.mark.gpu
def test_gpu_flash_attention_with_grad_remembers_its_path(requires_gpus):
    """A differentiable flash_attention call is remembered like a plain one (its checks once a geometry): calls
    that alternate geometry, causal and buffers, with and without the LSE and without grad, each give the
    gradients of flash_attention_backward on its own forward's output, in the inputs' dtype."""
    requires_gpus(1)
    from xelink.kernels import attention as A
    from xelink.kernels import flash_attention_backward

    g = torch.Generator(device="cuda").manual_seed(11)
    shapes = [((1, 4, 96, 64), (1, 2, 96, 64), True), ((2, 8, 130, 128), (2, 8, 130, 128), False)]
    for rnd in range(3):
        for (qs, ks, causal) in shapes:
            q, k, v = (torch.randn(s, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
                       for s in (qs, ks, ks))
            with torch.no_grad():
                ref_out, ref_lse = flash_attention(q, k, v, causal=causal, return_lse=True)
            out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
            assert out.grad_fn is not None and torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
            dout = torch.randn(out.shape, device="cuda", generator=g, dtype=out.dtype)
            dlse = torch.randn(lse.shape, device="cuda", generator=g) if rnd == 1 else None
            grads = torch.autograd.grad((out, lse) if dlse is not None else out,
                                        (q, k, v), (dout, dlse) if dlse is not None else dout)
            want = flash_attention_backward(dout, q.detach(), k.detach(), v.detach(), ref_out, ref_lse, causal=causal,
                                            dlse=dlse)
            for name, a, b in zip("qkv", grads, want):
                assert a.dtype == torch.bfloat16, name
                assert bool(((a.float() - b).abs() <= b.abs() * 2 ** -7 + 1e-6).all()), (rnd, qs, causal, name)
    assert any(key[1] == "flash-grad" for key in A._PATHS if isinstance(key, tuple) and len(key) > 1)


def _attention64(q, k, v, causal):
    """(out, lse) in plain torch float64, GQA by repeated KV heads, causal aligned to the end of the keys."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    sq, sk = q.shape[2], k.shape[2]
    if causal:
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1), float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ v, torch.logsumexp(s, -1)


@pytest.mark.parametrize("sq,sk,causal", [(7, 7, True), (5, 9, True), (9, 5, False), (6, 11, False), (1, 8, True)])
def test_flash_attention_backward_is_autograd_of_attention(sq, sk, causal):
    """flash_attention_backward (the forward's out and LSE given, the LSE's gradient too) against autograd of
    attention written in torch, float64, GQA 4/2; and a key block's share: the LSE of all keys with the block's
    keys alone gives the block's part, which sums over the blocks to the whole."""
    from xelink.kernels import flash_attention_backward

    g = torch.Generator().manual_seed(sq * 31 + sk)
    q, k, v = (torch.randn(2, h, s, 16, generator=g, dtype=torch.float64) for h, s in ((4, sq), (2, sk), (2, sk)))
    dout, dlse = torch.randn(2, 4, sq, 16, generator=g, dtype=torch.float64), torch.randn(2, 4, sq, generator=g)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = _attention64(*leaves, causal)
    ((out * dout).sum() + (lse * dlse).sum()).backward()
    got = flash_attention_backward(dout, q, k, v, out.detach(), lse.detach().float(), causal=causal, dlse=dlse)
    for a, t in zip(got, leaves):
        assert a.dtype == torch.float64 and a.shape == t.shape
        assert torch.allclose(a, t.grad, atol=1e-5), (a - t.grad).abs().max()
    low = flash_attention_backward(dout, q, k, v, out.detach(), lse.detach().float(), causal=causal, dlse=dlse,
                                   dtype=torch.float32)  # the reference path rounds its results to dtype=
    assert all(a.dtype == torch.float32 and torch.equal(a, b.float()) for a, b in zip(low, got))
    if not causal:  # two key blocks with the whole's out and LSE: their parts add up
        cut = sk // 2
        parts = [flash_attention_backward(dout, q, k[:, :, a:b], v[:, :, a:b], out.detach(), lse.detach().float(),
                                          dlse=dlse) for a, b in ((0, cut), (cut, sk))]
        assert torch.allclose(parts[0][0] + parts[1][0], leaves[0].grad, atol=1e-5)
        assert torch.allclose(torch.cat([parts[0][1], parts[1][1]], 2), leaves[1].grad, atol=1e-5)
        assert torch.allclose(torch.cat([parts[0][2], parts[1][2]], 2), leaves[2].grad, atol=1e-5)


def test_flash_attention_backward_bad_input():
    from xelink.kernels import flash_attention_backward

    q = torch.randn(1, 2, 4, 8)
    lse = torch.zeros(1, 2, 4)
    cases = [
        (dict(dout=q[:, :, :3]), ValueError, r"flash_attention_backward: dout.shape=\(1, 2, 3, 8\) != q.shape"),
        (dict(lse=lse.double()), TypeError, r"flash_attention_backward: lse.dtype=torch.float64 must be torch.float32"),
        (dict(lse=lse[..., :3]), ValueError, r"lse.shape=\(1, 2, 3\) must be q.shape\[:3\]"),
        (dict(dlse=lse[0]), ValueError, r"flash_attention_backward: dlse.shape=\(2, 4\) must have 3 dims"),
        (dict(impl="cuda"), ValueError, r"flash_attention_backward: impl='cuda' is not one of auto, triton, reference"),
        (dict(impl="triton", dout=q.double(), q=q.double(), k=q.double(), v=q.double()), (TypeError, ValueError),
         r"flash_attention_backward: (q.dtype=torch.float64 is not supported by impl='triton'|impl='triton' needs)"),
        (dict(causal=1), TypeError, r"causal=1 must be a bool"),
        (dict(dtype=torch.int32), TypeError, r"flash_attention_backward: dtype=torch.int32 must be None or a floating"),
        (dict(dtype="bf16"), TypeError, r"flash_attention_backward: dtype='bf16' must be None or a floating"),
    ]
    for change, exc, match in cases:
        args = dict(dout=q, q=q, k=q, v=q, out=q, lse=lse) | change
        with pytest.raises(exc, match=match):
            flash_attention_backward(**args)


def test_flash_attention_with_grad_keeps_no_score_matrix_and_refuses_out():
    """flash_attention with grad: the autograd node keeps the inputs, output and LSE only (its backward
    recomputes the probabilities), gradients equal autograd of float64 attention (the LSE's too), and out= is
    refused as not differentiable."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 40, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attention(*leaves, causal=True, return_lse=True)
    saved = out.grad_fn.saved_tensors
    assert {tuple(t.shape) for t in saved} <= {(1, 4, 40, 16), (1, 2, 40, 16), (1, 4, 40)}, [t.shape for t in saved]
    (out.sum() + lse.sum()).backward()
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want, want_lse = _attention64(*full, True)
    (want.sum() + want_lse.sum()).backward()
    for a, b in zip(leaves, full):
        assert a.grad.dtype == torch.float64 and torch.allclose(a.grad, b.grad, atol=1e-5)
    for pick in (0, 1):  # a loss of the output alone, then of the LSE alone (the other's gradient comes as None)
        got = torch.autograd.grad(flash_attention(*leaves, causal=True, return_lse=True)[pick].sum(), leaves)
        want = torch.autograd.grad(_attention64(*full, True)[pick].sum(), full, allow_unused=True)  # lse: no v
        assert all(torch.allclose(a, torch.zeros_like(a) if b is None else b, atol=1e-5) for a, b in zip(got, want))
    with pytest.raises(ValueError, match=r"^flash_attention: out= is not differentiable"):
        flash_attention(*leaves, out=torch.empty(1, 4, 40, 16, dtype=torch.float64))


@pytest.mark.skipif(not triton_can_run(torch.device("cpu")), reason="needs Triton and TRITON_INTERPRET=1")
def test_interpreter_named_flash_kernel_with_grad():
    """The named Triton kernel with grad: its forward, the backward's gradients within fp16 rounding of the
    reference's autograd."""
    call, leaves, _ = _cases(dtype=torch.float16)["flash_attention"]
    got = call("triton")
    assert got.grad_fn is not None
    g_got = torch.autograd.grad(got.float().sum(), leaves)
    g_ref = torch.autograd.grad(call("reference").float().sum(), leaves)
    for x, y in zip(g_got, g_ref):
        torch.testing.assert_close(x.float(), y.float(), atol=2e-2, rtol=2e-2)


# (B, Hq, Hkv, Sq, Sk, D, causal): tails of every tile, GQA, rows that see no key (causal, Sq > Sk), one query row
BWD_SHAPES = [(1, 2, 1, 70, 70, 64, True), (2, 4, 2, 33, 97, 64, True), (1, 2, 2, 100, 40, 64, True),
              (1, 2, 2, 17, 130, 64, False), (1, 4, 1, 1, 65, 64, True), (1, 2, 1, 40, 40, 128, True),
              (1, 2, 1, 20, 36, 256, False)]


def _bwd_case(shape, device, dtype, strided=False):
    B, hq, hkv, sq, sk, D, causal = shape
    g = torch.Generator().manual_seed(sq * 7 + sk)

    def make(h, s):
        if strided:  # the (B, H, S, D) transpose of a (B, S, H, D) buffer
            return torch.randn(B, s, h, D, generator=g).to(device, dtype).transpose(1, 2)
        return torch.randn(B, h, s, D, generator=g).to(device, dtype)

    q, k, v = make(hq, sq), make(hkv, sk), make(hkv, sk)
    from xelink.kernels import reference_flash_attention

    out, lse = reference_flash_attention(q, k, v, causal=causal, return_lse=True)
    dout = make(hq, sq)
    dlse = torch.randn(B, hq, sq, generator=g).to(device)
    return (dout, q, k, v, out, lse), dict(causal=causal, dlse=dlse)


def _check_bwd_kernel(shape, device, dtype, strided=False, tol=2e-3):
    from xelink.kernels import flash_attention_backward

    args, kw = _bwd_case(shape, device, dtype, strided)
    got = flash_attention_backward(*args, impl="triton", **kw)
    want = flash_attention_backward(*args, impl="reference", **kw)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert a.dtype == torch.float32 and a.shape == b.shape, (name, a.dtype, a.shape)
        err = ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
        assert err <= tol and torch.isfinite(a).all(), f"{shape} {dtype} {name}: relative error {err:.3g}"
    # dtype=: the kernel stores its float32 sums rounded to dtype (autograd's path), no other change
    eps = torch.finfo(dtype).eps
    for name, a, b in zip(("dq", "dk", "dv"), got, flash_attention_backward(*args, impl="triton", dtype=dtype, **kw)):
        assert b.dtype == dtype and b.shape == a.shape, (name, b.dtype)
        assert bool(((b.float() - a).abs() <= a.abs() * eps + 1e-6).all()), f"{shape} {dtype} {name}: dtype={dtype}"
    again = flash_attention_backward(*args, impl="triton", **kw)  # no atomics: the same bits on every call
    assert all(torch.equal(a, b) for a, b in zip(got, again)), f"{shape} {dtype}: two calls differ"


@pytest.mark.skipif(not triton_can_run(torch.device("cpu")), reason="needs Triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("shape", BWD_SHAPES)
def test_interpreter_flash_backward_kernel_matches_reference(shape):
    """The Triton backward (float16: the interpreter's bfloat16 dot is wrong) against the reference, the LSE's
    gradient included; contiguous and strided inputs."""
    _check_bwd_kernel(shape, torch.device("cpu"), torch.float16, strided=shape[3] == 33)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", BWD_SHAPES + [(2, 32, 8, 1000, 1000, 128, True), (1, 8, 8, 513, 2048, 64, False)])
def test_gpu_flash_backward_kernel_matches_reference(shape, dtype, requires_gpus):
    requires_gpus(1)
    _check_bwd_kernel(shape, torch.device("cuda"), dtype, strided=shape[3] in (33, 513),
                      tol=2e-3 if dtype == torch.float16 else 1.5e-2)

"""Flash attention, decode and merge: references against float64, kernels against references.

CPU tests (always): each reference against a float64 computation written out here, the merge of KV
shards against the full result, the fake implementations, and every bad-input error.
GPU tests (``@pytest.mark.gpu``): each Triton path against its reference on fresh random inputs over a
grid of shapes with tails, Sq != Sk, every head dim and dtype; outputs poisoned with NaN first.
Interpreter tests: with ``TRITON_INTERPRET=1`` (and Triton installed) the same kernel checks run on the
CPU through Triton's interpreter, on tiny float16 shapes (its bfloat16 dot is not exact).
"""
import math
import os

import pytest
import torch

from xelink.kernels import attention as A

from out_blocks import on_two_streams, only_block_written, poisoned

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1" and A.triton is not None
# impl="cuda" needs Triton's host tensor descriptors (NVIDIA's Triton; Intel's 3.3 has none).
needs_descriptors = pytest.mark.skipif(A.TensorDescriptor is None, reason="this Triton has no host tensor descriptors")
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3, torch.float32: 1e-5}


def _rel(out, ref):
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def _attention64(q, k, v, causal, scale, kv_len=None):
    """Float64 attention written the plain way: repeat KV heads, mask, softmax, weighted sum."""
    q, k, v = q.double(), k.double(), v.double()
    if kv_len is not None:
        k, v = k[:, :, :kv_len], v[:, :, :kv_len]
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    sq, sk = q.shape[2], k.shape[2]
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(sq)[:, None]
        j = torch.arange(sk)[None, :]
        s = s.masked_fill(j > i + (sk - sq), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    out = p @ v
    out = torch.where(torch.isfinite(lse)[..., None], out, torch.zeros_like(out))
    return out, lse


def _qkv(b, hq, hkv, sq, sk, d, dtype, device="cpu", gen=None):
    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    return r(b, hq, sq, d), r(b, hkv, sk, d), r(b, hkv, sk, d)


# -- references against float64 (CPU, fast) -----------------------------------------------------

REF_SHAPES = [  # (B, Hq, Hkv, Sq, Sk, D, causal)
    (2, 4, 4, 9, 9, 16, False),
    (1, 4, 2, 7, 19, 32, True),     # Sq < Sk: queries aligned to the end of the keys
    (2, 6, 2, 13, 5, 8, True),      # Sq > Sk: the first rows see no key
    (1, 3, 1, 1, 40, 64, True),     # one query token, GQA 3:1
    (1, 2, 1, 33, 17, 24, False),
]


@pytest.mark.parametrize("shape", REF_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_flash_against_float64(shape, dtype):
    b, hq, hkv, sq, sk, d, causal = shape
    gen = torch.Generator().manual_seed(hash((shape, str(dtype))) % 2**31)
    q, k, v = _qkv(b, hq, hkv, sq, sk, d, dtype, gen=gen)
    scale = 0.7 / math.sqrt(d)
    out, lse = A.reference_flash_attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    want, want_lse = _attention64(q, k, v, causal, scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (b, hq, sq)
    assert _rel(out, want) < TOL[dtype]
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse.double()[finite] - want_lse[finite]).abs().max() < 1e-5
    if causal and sq > sk:  # rows with no visible key: output 0, LSE -inf
        assert torch.all(out[:, :, : sq - sk] == 0) and torch.all(lse[:, :, : sq - sk] == float("-inf"))


def test_reference_default_scale_and_float64():
    gen = torch.Generator().manual_seed(1)
    q, k, v = _qkv(1, 2, 2, 5, 6, 16, torch.float64, gen=gen)
    out = A.reference_flash_attention(q, k, v)
    assert out.dtype == torch.float64
    assert _rel(out, _attention64(q, k, v, False, 1 / 4)[0]) < 1e-12
    # impl="auto" on the CPU is the reference, and so is impl="reference"
    assert torch.equal(A.flash_attention(q, k, v), out)
    assert torch.equal(A.flash_attention(q, k, v, impl="reference"), out)


def test_reference_empty_keys():
    q, k, v = _qkv(1, 2, 2, 3, 0, 8, torch.float32)
    out, lse = A.reference_flash_attention(q, k, v, return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


def _shards(sk, gen):
    cuts = sorted(torch.randint(0, sk + 1, (3,), generator=gen).tolist())
    bounds = [0, *cuts, sk]
    return list(zip(bounds[:-1], bounds[1:]))


def test_merge_of_shards_equals_full():
    gen = torch.Generator().manual_seed(7)
    q, k, v = _qkv(2, 4, 2, 11, 37, 16, torch.float32, gen=gen)
    full, full_lse = A.reference_flash_attention(q, k, v, return_lse=True)
    outs, lses = [], []
    for lo, hi in _shards(37, gen) + [(5, 5)]:  # an empty shard too: it must weigh nothing
        o, s = A.reference_flash_attention(q, k[:, :, lo:hi], v[:, :, lo:hi], return_lse=True)
        outs.append(o)
        lses.append(s)
    out, lse = A.merge_attention(outs, lses)
    assert _rel(out, full) < 1e-6
    assert (lse - full_lse).abs().max() < 1e-5
    # A stacked tensor works the same as a list; so does the reference directly.
    out2, lse2 = A.reference_merge_attention(torch.stack(outs), torch.stack(lses))
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    # The merge is exact against float64 attention over all keys.
    want, want_lse = _attention64(q, k, v, False, 1 / 4)
    assert _rel(out, want) < 1e-6


def test_merge_all_empty_rows():
    outs = [torch.full((1, 1, 2, 4), float("nan")), torch.zeros(1, 1, 2, 4)]
    lses = [torch.full((1, 1, 2), float("-inf")), torch.full((1, 1, 2), float("-inf"))]
    out, lse = A.merge_attention(outs, lses)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


@pytest.mark.parametrize("causal", [False, True])
def test_reference_decode_against_float64(causal):
    gen = torch.Generator().manual_seed(11 + causal)
    b, hq, hkv, sq, smax, d = 4, 8, 2, 3, 29, 16
    q, kc, vc = _qkv(b, hq, hkv, sq, smax, d, torch.float32, gen=gen)
    lens = torch.tensor([29, 0, 1, 17], dtype=torch.int32)
    out, lse = A.reference_decode_attention(q, kc, vc, lens, causal=causal, return_lse=True)
    assert torch.equal(A.decode_attention(q, kc, vc, lens, causal=causal), out)  # auto on CPU
    for i, n in enumerate(lens.tolist()):
        want, want_lse = _attention64(q[i:i + 1], kc[i:i + 1], vc[i:i + 1], causal, 1 / 4, kv_len=n)
        if n == 0:
            assert torch.all(out[i] == 0) and torch.all(lse[i] == float("-inf"))
            continue
        assert (out[i:i + 1].double() - want).abs().max() < 1e-5
        finite = torch.isfinite(want_lse)
        assert (lse[i:i + 1].double()[finite] - want_lse[finite]).abs().max() < 1e-5


def test_fake_implementations_give_shapes():
    """Meta tensors dispatch to the fake implementations torch.compile traces with (no kernel runs)."""
    q = torch.empty(2, 8, 5, 64, dtype=torch.bfloat16, device="meta")
    k = torch.empty(2, 2, 9, 64, dtype=torch.bfloat16, device="meta")
    out = torch.empty_like(q)
    lse = torch.ops.xelink.flash_attention(q, k, k, True, 0.125, "triton", "off", out, 0)
    assert lse.shape == (2, 8, 5) and lse.dtype == torch.float32 and lse.device.type == "meta"
    lens = torch.empty(2, dtype=torch.int32, device="meta")
    lse = torch.ops.xelink.decode_attention(q, k, k, lens, False, 0.125, 0, "triton", "off", out, 0)
    assert lse.shape == (2, 8, 5) and lse.device.type == "meta"
    lse = torch.ops.xelink.merge_attention([q, q], [lse, lse], "triton", "off", out)
    assert lse.shape == (2, 8, 5)


def test_out_writes_only_its_block():
    # CPU (reference paths): flash attention into the (B, H, S, D) transpose of a row block of a poisoned
    # (B, S, H, D) buffer, decode and merge into a head block; the LSE is new each time. torch.compile
    # goes through the custom ops, which write out.
    gen = torch.Generator().manual_seed(3)
    q, k, v = _qkv(1, 4, 2, 6, 9, 16, torch.float32, gen=gen)
    want, want_lse = A.reference_flash_attention(q, k, v, causal=True, return_lse=True)
    for run in (A.flash_attention, torch.compile(A.flash_attention, backend="aot_eager", fullgraph=True)):
        big = poisoned(1, 10, 4, 16, dtype=torch.float32)
        block = big[:, 2:8].transpose(1, 2)
        out, lse = run(q, k, v, causal=True, return_lse=True, out=block)
        assert out is block and torch.equal(out, want) and torch.equal(lse, want_lse)
        only_block_written(big, block)
    lens = torch.tensor([7])
    big = poisoned(1, 6, 6, 16, dtype=torch.float32)
    block = big[:, 1:5]
    assert A.decode_attention(q, k, v, lens, out=block) is block
    assert torch.equal(block, A.reference_decode_attention(q, k, v, lens))
    only_block_written(big, block)
    o1, s1 = A.reference_flash_attention(q, k[:, :, :4], v[:, :, :4], return_lse=True)
    o2, s2 = A.reference_flash_attention(q, k[:, :, 4:], v[:, :, 4:], return_lse=True)
    big = poisoned(1, 6, 6, 16, dtype=torch.float32)
    block = big[:, 2:6]
    out, lse = A.merge_attention([o1, o2], [s1, s2], out=block)
    assert out is block and torch.equal(out, A.reference_merge_attention([o1, o2], [s1, s2])[0])
    only_block_written(big, block)
    out, _ = A.merge_attention([o1, o2], [s1, s2], out=o1)  # the partials are read from a copy
    assert torch.equal(out, block)


@pytest.mark.parametrize("call, error, text", [
    (lambda q, k, v: A.flash_attention(q, k, v, out=q[:, :2]), ValueError, "out.shape=(1, 2, 8, 64) must be"),
    (lambda q, k, v: A.flash_attention(q, k, v, out=q.half()), TypeError, "out.dtype=torch.float16 must be"),
    (lambda q, k, v: A.flash_attention(q, k, v, out=q.to("meta")), ValueError, "out is on meta"),
    (lambda q, k, v: A.flash_attention(q, k, v, out=q.transpose(2, 3).contiguous().transpose(2, 3)), ValueError,
     "must be 1 along the last dim"),
    (lambda q, k, v: A.flash_attention(q, k, v, out=q), ValueError, "out overlaps q in memory"),
    (lambda q, k, v: A.decode_attention(q, k, v, torch.tensor([8]), out=k.repeat(1, 2, 1, 1)[:, :, :, :32]),
     ValueError, "out.shape=(1, 4, 8, 32) must be (1, 4, 8, 64)"),
    (lambda q, k, v: A.decode_attention(q, k, v, torch.tensor([8]), out=torch.empty(1, 4, 8, 64)), TypeError,
     "out.dtype=torch.float32"),
    (lambda q, k, v: A.merge_attention([q], [torch.zeros(1, 4, 8)], out=torch.empty(1, 4, 8, 32, dtype=q.dtype)),
     ValueError, "out.shape=(1, 4, 8, 32) must be (1, 4, 8, 64)"),
])
def test_bad_out(call, error, text):
    with pytest.raises(error) as info:
        call(*_good())
    name = info.value.args[0].split(":")[0]
    assert name in ("flash_attention", "decode_attention", "merge_attention") and text in str(info.value)


# -- bad inputs: clear errors before anything runs ------------------------------------------------

def _good():
    return _qkv(1, 4, 2, 8, 8, 64, torch.bfloat16)


@pytest.mark.parametrize("mutate, error, text", [
    (lambda q, k, v: (q[0], k, v), ValueError, "q.shape=(4, 8, 64) must have 4 dims"),
    (lambda q, k, v: (q.float().numpy(), k, v), TypeError, "q must be a torch.Tensor"),
    (lambda q, k, v: (q, k.half(), v), TypeError, "dtypes differ"),
    (lambda q, k, v: (q.int(), k.int(), v.int()), TypeError, "q.dtype=torch.int32 must be a floating-point dtype"),
    (lambda q, k, v: (q, k[:, :, :4], v), ValueError, "k.shape=(1, 2, 4, 64) != v.shape=(1, 2, 8, 64)"),
    (lambda q, k, v: (q[:, :3], k, v), ValueError, "q heads 3 must be a multiple of k heads 2"),
    (lambda q, k, v: (q[..., :32], k, v), ValueError, "head_dim differs: q.shape[3]=32 != k.shape[3]=64"),
    (lambda q, k, v: (torch.cat([q, q]), k, v), ValueError, "batch differs"),
    (lambda q, k, v: (q, k.to("meta"), v.to("meta")), ValueError, "devices differ"),
])
def test_flash_bad_tensors(mutate, error, text):
    q, k, v = mutate(*_good())
    with pytest.raises(error, match="^flash_attention: ") as info:
        A.flash_attention(q, k, v)
    assert text in str(info.value)


@pytest.mark.parametrize("kwargs, error, text", [
    ({"impl": "fast"}, ValueError, "impl='fast' is not one of auto, triton, cuda, reference"),
    ({"scale": -1.0}, ValueError, "scale=-1.0 must be finite and > 0"),
    ({"scale": float("nan")}, ValueError, "must be finite and > 0"),
    ({"scale": "0.1"}, TypeError, "scale='0.1' must be a float or None"),
    ({"causal": 1}, TypeError, "causal=1 must be a bool"),
    ({"return_lse": None}, TypeError, "return_lse=None must be a bool"),
])
def test_flash_bad_flags(kwargs, error, text):
    with pytest.raises(error, match="^flash_attention: ") as info:
        A.flash_attention(*_good(), **kwargs)
    assert text in str(info.value)


@pytest.mark.skipif(INTERPRET, reason="the interpreter runs kernel paths on the CPU")
@pytest.mark.parametrize("impl, named", [("triton", "triton"), ("cuda", "cuda"), ("hopper", "cuda")])
def test_kernel_path_on_cpu_is_refused(impl, named):
    error = RuntimeError if A.triton is None else ValueError
    with pytest.raises(error, match=f"^flash_attention: impl='{named}'"):
        A.flash_attention(*_good(), impl=impl)


@pytest.mark.skipif(A.triton is None, reason="the kernel checks run only where Triton is installed")
@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 on the CPU")
def test_kernel_rejects_dtype_and_head_dim():
    q, k, v = _qkv(1, 2, 2, 4, 4, 64, torch.float32)
    with pytest.raises(TypeError, match="^flash_attention: q.dtype=torch.float32 is not supported by impl='triton'"):
        A.flash_attention(q, k, v, impl="triton")
    q, k, v = _qkv(1, 2, 2, 4, 4, 96, torch.float16)
    with pytest.raises(ValueError, match="^flash_attention: head_dim=96 is not supported"):
        A.flash_attention(q, k, v, impl="triton")


def test_merge_bad_inputs():
    o = torch.zeros(1, 2, 3, 8)
    s = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match="^merge_attention: outs is empty"):
        A.merge_attention([], [])
    with pytest.raises(ValueError, match=r"^merge_attention: len\(outs\)=2 != len\(lses\)=1"):
        A.merge_attention([o, o], [s])
    with pytest.raises(ValueError, match=r"^merge_attention: outs\[1\].shape=\(1, 2, 4, 8\) != outs\[0\].shape"):
        A.merge_attention([o, torch.zeros(1, 2, 4, 8)], [s, s])
    with pytest.raises(TypeError, match=r"^merge_attention: lses\[0\].dtype=torch.float64 must be torch.float32"):
        A.merge_attention([o], [s.double()])
    with pytest.raises(ValueError, match=r"^merge_attention: lses\[0\].shape=\(1, 2\) must have 3 dims"):
        A.merge_attention([o], [s[..., 0]])
    with pytest.raises(TypeError, match="^merge_attention: outs and lses must be sequences"):
        A.merge_attention(o[0, 0], 3)


def test_decode_bad_inputs():
    q, kc, vc = _qkv(2, 4, 2, 1, 16, 64, torch.float16)
    lens = torch.tensor([16, 3])
    with pytest.raises(TypeError, match="^decode_attention: kv_lens must be a torch.Tensor"):
        A.decode_attention(q, kc, vc, [16, 3])
    with pytest.raises(ValueError, match=r"^decode_attention: kv_lens.shape=\(3,\) must be \(batch,\)=\(2,\)"):
        A.decode_attention(q, kc, vc, torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="^decode_attention: kv_lens.dtype=torch.float32 must be"):
        A.decode_attention(q, kc, vc, lens.float())
    with pytest.raises(ValueError, match="^decode_attention: num_splits=0 must be a positive int"):
        A.decode_attention(q, kc, vc, lens, num_splits=0)
    with pytest.raises(ValueError, match=r"^decode_attention: q.shape=\(2, 4, 0, 64\) needs at least one"):
        A.decode_attention(q[:, :, :0], kc, vc, lens)
    with pytest.raises(ValueError, match="^decode_attention: q heads 4 must be a multiple of k_cache heads 3"):
        A.decode_attention(q, kc[:, :1].expand(2, 3, 16, 64), vc[:, :1].expand(2, 3, 16, 64), lens)
    with pytest.raises(ValueError, match="^decode_attention: pdl='soon' must be None, True, False"):
        A.decode_attention(q, kc, vc, lens, pdl="soon")
    with pytest.raises(ValueError, match="^decode_attention: pdl='late' needs a Triton kernel on a CUDA GPU"):
        A.decode_attention(q, kc, vc, lens, impl="reference", pdl="late")


def test_flash_and_merge_take_the_same_pdl_argument():
    q, k, v = _qkv(1, 2, 2, 8, 8, 64, torch.float32)
    o, lse = A.flash_attention(q, k, v, return_lse=True, impl="reference", pdl=False)  # off: fine anywhere
    assert torch.equal(o, A.flash_attention(q, k, v, impl="reference"))
    with pytest.raises(ValueError, match="^flash_attention: pdl='soon' must be None, True, False"):
        A.flash_attention(q, k, v, pdl="soon")
    with pytest.raises(ValueError, match="^flash_attention: pdl=True needs a Triton kernel on a CUDA GPU"):
        A.flash_attention(q, k, v, impl="reference", pdl=True)
    A.merge_attention([o, o], [lse, lse], impl="reference", pdl=None)
    with pytest.raises(ValueError, match="^merge_attention: pdl='early' needs a Triton kernel on a CUDA GPU"):
        A.merge_attention([o, o], [lse, lse], impl="reference", pdl="early")


# -- kernels against references (GPU, or the interpreter on the CPU) -------------------------------

def _poison(device):
    """Fill the caching allocator's free memory with NaN so outputs the kernels leave unwritten show up."""
    if device == "cuda":
        junk = torch.full((64 << 20,), float("nan"), device=device)
        del junk


def _check_flash(device, impl, d, dtype, causal, shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    for b, hq, hkv, sq, sk in shapes:
        q, k, v = _qkv(b, hq, hkv, sq, sk, d, dtype, device=device, gen=gen)
        _poison(device)
        out, lse = A.flash_attention(q, k, v, causal=causal, return_lse=True, impl=impl)
        ref, ref_lse = A.reference_flash_attention(q, k, v, causal=causal, return_lse=True)
        where = f"{impl} D={d} {dtype} causal={causal} shape={(b, hq, hkv, sq, sk)}"
        assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"NaN left in output: {where}"
        assert _rel(out, ref) < TOL[dtype], f"{where}: rel err {_rel(out, ref):.2e}"
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite), where
        if finite.any():
            assert (lse[finite] - ref_lse[finite]).abs().max() < 2e-3, where


GPU_SHAPES = [  # (B, Hq, Hkv, Sq, Sk): aligned, tails, GQA, Sq < Sk, Sq > Sk, one query
    (1, 2, 2, 256, 256),
    (2, 4, 1, 77, 300),
    (1, 4, 2, 300, 77),
    (1, 3, 3, 1, 333),
    (1, 8, 2, 513, 1000),
]


def _need_sm90(impl):
    if impl == "cuda" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("impl='cuda' needs a compute-capability-9 GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", A.HEAD_DIMS)
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_flash_kernel_gpu(requires_gpus, impl, d, dtype, causal):
    requires_gpus(1)
    _need_sm90(impl)
    _check_flash("cuda", impl, d, dtype, causal, GPU_SHAPES, seed=d * 10 + int(causal))


def test_ws_flash_forward_refuses_what_the_kernel_does_not_take():
    """The warp-specialized kernel's direct launch (benchmarks) names itself and the bad tensors before any
    launch: CPU tensors (no sm90 GPU), mismatched outputs."""
    from xelink.kernels import flash_ws

    q, k, v = _qkv(1, 4, 2, 128, 128, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="ws_flash_forward: q"):
        flash_ws.ws_flash_forward(q, k, v, torch.empty_like(q), torch.empty(1, 4, 128), False, 0.1)
    assert not flash_ws.ws_applies(q, k, v)


WS_SHAPES = [  # (B, Hq, Hkv, Sq, Sk), Sk a multiple of 128: the warp-specialized kernel's; tails of Sq, Sq > Sk
    (1, 2, 2, 128, 128),
    (2, 8, 2, 300, 512),
    (1, 4, 1, 1000, 1024),
    (1, 4, 4, 640, 256),
    (1, 3, 3, 1, 384),
]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_flash_ws_gpu(requires_gpus, d, dtype, causal):
    """impl='cuda' takes the warp-specialized kernel (flash_ws.py) where it applies: the plan says so, and
    its outputs and LSE match the reference; the same call under PDL gives the same bits."""
    requires_gpus(1)
    _need_sm90("cuda")
    q, k, v = _qkv(1, 4, 2, 200, 256, d, dtype, device="cuda")
    from xelink.kernels import flash_ws

    ws = flash_ws._flash_ws_kernel
    assert A._FlashLaunch(q, k, v, None, causal, 0.1, "cuda", "off", None, False).fn is ws
    assert A._FlashLaunch(q, k[:, :, :200], v[:, :, :200], None, causal, 0.1, "cuda", "off", None, False).fn is not ws
    _check_flash("cuda", "cuda", d, dtype, causal, WS_SHAPES, seed=d + 7 * int(causal))
    a = A.flash_attention(q, k, v, causal=causal, impl="cuda", pdl=False)
    b = A.flash_attention(q, k, v, causal=causal, impl="cuda", pdl=True)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="ws_flash_forward: out must be"):  # the direct launch's output checks
        flash_ws.ws_flash_forward(q, k, v, torch.empty_like(q), torch.empty(1, 4, 200, device="cuda",
                                                                              dtype=torch.float16), causal, 0.1)


@pytest.mark.gpu
def test_flash_ws_back_to_back_and_graph_gpu(requires_gpus):
    """Calls that change shape, dtype and causality back to back, and a CUDA graph replayed with new inputs
    between eager calls, all on the warp-specialized kernel."""
    requires_gpus(1)
    _need_sm90("cuda")
    gen = torch.Generator().manual_seed(23)
    cases = [(1, 8, 2, 512, 1024, 128, torch.bfloat16, True), (2, 4, 4, 129, 256, 64, torch.float16, False),
             (1, 32, 8, 2048, 2048, 128, torch.bfloat16, True), (1, 2, 1, 77, 128, 128, torch.float16, True),
             (1, 4, 2, 300, 576, 256, torch.bfloat16, False)]
    made = [(*_qkv(b, h, hk, sq, sk, d, dt, device="cuda", gen=gen), c) for b, h, hk, sq, sk, d, dt, c in cases]
    for _ in range(2):
        for q, k, v, c in made:
            out = A.flash_attention(q, k, v, causal=c, impl="cuda")
            assert _rel(out, A.reference_flash_attention(q, k, v, causal=c)) < TOL[q.dtype]
    q, k, v, c = made[0]
    static = [t.clone() for t in (q, k, v)]
    A.flash_attention(*static, causal=c, impl="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = A.flash_attention(*static, causal=c, impl="cuda")
    for _ in range(3):
        new = _qkv(1, 8, 2, 512, 1024, 128, torch.bfloat16, device="cuda", gen=gen)
        for s_, n in zip(static, new):
            s_.copy_(n)
        graph.replay()
        A.flash_attention(*made[1][:3], causal=made[1][3], impl="cuda")  # another shape between replays
        torch.cuda.synchronize()
        assert _rel(got, A.reference_flash_attention(*new, causal=c)) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_flash_kernel_strided_gpu(requires_gpus, impl):
    """(B, S, H, D) storage seen as (B, H, S, D): the portable kernel takes the strides as they are."""
    requires_gpus(1)
    _need_sm90(impl)
    q = torch.randn(2, 130, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(2, 190, 2, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(2, 190, 2, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    out = A.flash_attention(q, k, v, causal=True, impl=impl)
    assert _rel(out, A.reference_flash_attention(q, k, v, causal=True)) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "cuda", "hopper"])
def test_flash_out_blocks_gpu(requires_gpus, impl):
    """out= the (B, H, S, D) transpose of a block of a poisoned (B, S, H, D) buffer: both kernels store
    there (the TMA kernel loads through descriptors, stores through block pointers), nothing outside it."""
    requires_gpus(1)
    _need_sm90("cuda" if impl == "hopper" else impl)
    gen = torch.Generator().manual_seed(17)
    q, k, v = _qkv(2, 8, 2, 300, 500, 128, torch.bfloat16, device="cuda", gen=gen)
    big = poisoned(2, 320, 12, 128, device="cuda")
    block = big[:, 10:310, 2:10].transpose(1, 2)
    out, lse = A.flash_attention(q, k, v, causal=True, return_lse=True, impl=impl, out=block)
    torch.cuda.synchronize()
    assert out is block
    only_block_written(big, block)
    ref, ref_lse = A.reference_flash_attention(q, k, v, causal=True, return_lse=True)
    assert _rel(out, ref) < TOL[torch.bfloat16] and (lse - ref_lse).abs().max() < 2e-3
    if impl == "hopper":  # the old name runs the same kernel
        assert torch.equal(out, A.flash_attention(q, k, v, causal=True, impl="cuda"))


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and Triton")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("impl", ["triton", pytest.param("cuda", marks=needs_descriptors)])
def test_flash_kernel_interpreter(impl, d, causal):
    shapes = [(1, 2, 1, 40, 70), (1, 2, 2, 150, 100), (1, 1, 1, 1, 200)]
    _check_flash("cpu", impl, d, torch.float16, causal, shapes, seed=d + int(causal))


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and Triton")
def test_out_blocks_interpreter():
    """The flash, decode and merge kernels store into a head block of a poisoned (B, S, H, D) buffer's
    transpose: every element of the block, nothing outside it."""
    gen = torch.Generator().manual_seed(9)
    q, k, v = _qkv(1, 2, 1, 40, 70, 64, torch.float16, gen=gen)

    def block_of(sq):
        big = poisoned(1, sq + 3, 5, 64, dtype=torch.float16)
        return big, big[:, 1:1 + sq, 2:4].transpose(1, 2)

    big, block = block_of(40)
    assert A.flash_attention(q, k, v, causal=True, impl="triton", out=block) is block
    only_block_written(big, block)
    assert _rel(block, A.reference_flash_attention(q, k, v, causal=True)) < TOL[torch.float16]
    qd, lens = q[:, :, :3], torch.tensor([50], dtype=torch.int32)
    big, block = block_of(3)
    assert A.decode_attention(qd, k, v, lens, num_splits=3, impl="triton", out=block) is block
    only_block_written(big, block)
    assert _rel(block, A.reference_decode_attention(qd, k, v, lens)) < TOL[torch.float16]
    parts = [A.reference_flash_attention(q, k[:, :, lo:hi], v[:, :, lo:hi], return_lse=True)
             for lo, hi in ((0, 30), (30, 70))]
    big, block = block_of(40)
    out, _ = A.merge_attention([p[0] for p in parts], [p[1] for p in parts], impl="triton", out=block)
    assert out is block
    only_block_written(big, block)
    assert _rel(block, A.reference_flash_attention(q, k, v)) < TOL[torch.float16]


def _check_decode(device, d, dtype, causal, cases, seed):
    gen = torch.Generator().manual_seed(seed)
    for b, hq, hkv, sq, smax, lens, splits in cases:
        q, kc, vc = _qkv(b, hq, hkv, sq, smax, d, dtype, device=device, gen=gen)
        kv_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        for i, n in enumerate(lens):  # keys past a sequence's length must not be read (NaN would spread)
            kc[i, :, n:] = float("nan")
            vc[i, :, n:] = float("nan")
        _poison(device)
        out, lse = A.decode_attention(q, kc, vc, kv_lens, causal=causal, return_lse=True, num_splits=splits,
                                      impl="triton")
        ref, ref_lse = A.reference_decode_attention(q, kc, vc, kv_lens, causal=causal, return_lse=True)
        where = f"decode D={d} {dtype} causal={causal} case={(b, hq, hkv, sq, smax, lens, splits)}"
        assert not torch.isnan(out).any() and not torch.isnan(lse).any(), f"NaN left in output: {where}"
        assert _rel(out, ref) < TOL[dtype], f"{where}: rel err {_rel(out, ref):.2e}"
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite), where
        assert (lse[finite] - ref_lse[finite]).abs().max() < 2e-3, where


def test_decode_split_counts_and_deeper_pipeline(monkeypatch):
    """The splits fill whole waves (rounded down) of the head dim's programs a multiprocessor: at head dim 128
    one (32/8 heads on 132 multiprocessors: 16 splits at B=1, 2 at B=8, 1 past a wave), 2 at 64. Splits of
    >= _DECODE_DEEP_KEYS keys of the cache in one wave take one more stage, at head dim 128 only (the one
    measured): B=1 at 32K and 128K and B=8 at 32K, not 8K (512 keys a split)."""
    monkeypatch.setattr(A, "sm_count", lambda device: 132)
    stages = A._DECODE_CONFIGS[128][2]

    def meta(b, smax, d):
        return torch.empty(b, 32, 1, d, device="meta"), torch.empty(b, 8, smax, d, device="meta")

    def planned(b, smax, d=128):
        q, kc = meta(b, smax, d)
        return A._DecodeLaunch(q, kc, kc, None, False, 0.1, 0, None, "off", False).kwargs["num_stages"]

    def splits(b, smax, d=128):
        return A._decode_splits(*meta(b, smax, d), A._DECODE_CONFIGS[d][0])

    assert (splits(1, 32768), splits(8, 32768), splits(32, 32768), splits(1, 32768, d=64)) == (16, 2, 1, 33)
    assert splits(1, 512) == 8  # at least _DECODE_MIN_CHUNK keys of the cache a split
    assert planned(1, 32768) == planned(1, 131072) == planned(8, 32768) == stages + 1
    assert planned(1, 8192) == planned(32, 32768) == stages
    assert planned(1, 32768, d=64) == A._DECODE_CONFIGS[64][2]


DECODE_CASES = [  # (B, Hq, Hkv, Sq, Smax, kv_lens, num_splits)
    (3, 32, 8, 1, 4099, [4099, 1, 2500], None),
    (2, 8, 8, 4, 1000, [1000, 0], 3),
    (2, 16, 2, 16, 777, [777, 300], None),
    (1, 4, 1, 5, 2000, [1999], 1),
]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", A.HEAD_DIMS)
def test_decode_kernel_gpu(requires_gpus, d, dtype, causal):
    requires_gpus(1)
    _check_decode("cuda", d, dtype, causal, DECODE_CASES, seed=d + int(causal))


@pytest.mark.gpu
def test_decode_merged_in_one_launch(requires_gpus):
    # The last split of each block merges the partials (split.py), with counters and partials kept per
    # stream: calls that change the split count back to back, the same calls on two streams at once, a CUDA
    # graph replayed (new lengths) between eager calls on its stream; repeated calls give the same bits.
    requires_gpus(1)
    gen = torch.Generator().manual_seed(11)
    made = []
    for b, hq, hkv, sq, smax, lens, splits in [(1, 32, 8, 1, 32768, [32768], None), (8, 32, 8, 1, 4096, [4096] * 8, 5),
                                               (2, 16, 2, 4, 3000, [3000, 17], 64), (1, 8, 8, 1, 700, [700], 1)]:
        q, kc, vc = _qkv(b, hq, hkv, sq, smax, 128, torch.bfloat16, device="cuda", gen=gen)
        made.append((q, kc, vc, torch.tensor(lens, dtype=torch.int32, device="cuda"), splits))

    def run_all():
        return [A.decode_attention(q, kc, vc, n, num_splits=s, impl="triton", return_lse=True)
                for q, kc, vc, n, s in made]

    first = run_all()
    for (q, kc, vc, n, _), (out, lse) in zip(made, first):
        ref, ref_lse = A.reference_decode_attention(q, kc, vc, n, return_lse=True)
        assert _rel(out, ref) < TOL[torch.bfloat16] and (lse - ref_lse).abs().max() < 2e-3

    def same(got):
        return all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, first))

    assert all(same(run_all()) for _ in range(3))
    assert all(same(got) for got in on_two_streams(run_all))
    q, kc, vc, n, splits = made[1]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = A.decode_attention(q, kc, vc, n, num_splits=splits, impl="triton")
    for length in (4096, 1, 2049):
        n.fill_(length)
        graph.replay()
        eager = A.decode_attention(q, kc, vc, n, num_splits=splits, impl="triton")
        run_all()
        torch.cuda.synchronize()
        assert torch.equal(yg, eager) and _rel(yg, A.reference_decode_attention(q, kc, vc, n)) < TOL[torch.bfloat16]
    n.fill_(4096)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_decode_kernel_long_gpu(requires_gpus, causal):
    """A 32K cache (the long splits' deeper pipeline), 64 explicit splits of a 5000-key cache."""
    requires_gpus(1)
    cases = DECODE_CASES + [(1, 32, 8, 1, 32768, [32768], None), (2, 8, 2, 2, 5000, [4999, 130], 64)]
    _check_decode("cuda", 128, torch.bfloat16, causal, cases, seed=3 + int(causal))


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and Triton")
@pytest.mark.parametrize("causal", [False, True])
def test_decode_kernel_interpreter(causal):
    # the last: 24 rows a KV head (GQA 8 x 3 tokens), merged 16 rows at a time
    cases = [(3, 8, 2, 3, 200, [200, 0, 2], 4), (1, 4, 1, 1, 300, [300], None), (2, 8, 1, 3, 300, [300, 3], 5)]
    _check_decode("cpu", 64, torch.float16, causal, cases, seed=int(causal))


# -- rope_decode_attention: rope_kv, then decode attention, in one launch ----------------------------

def _rope_decode_inputs(b, hq, hkv, smax, d, dtype, device, gen):
    """The new token's q, k, v as views of one fused QKV row (B, heads, 1, D) (strided, as the model passes
    them), RoPE tables of smax positions, and caches."""
    qkv = torch.randn(b, hq + 2 * hkv, 1, d, generator=gen).to(device=device, dtype=dtype)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    ang = torch.arange(smax, dtype=torch.float64)[:, None] * 500000.0 ** (-torch.arange(0, d, 2) / d)[None, :]
    cos, sin = (torch.cat([f(ang)] * 2, dim=1).float().to(device) for f in (torch.cos, torch.sin))
    _, kc, vc = _qkv(b, hq, hkv, 1, smax, d, dtype, device=device, gen=gen)
    return q, k, v, cos, sin, kc, vc


def _same(a, b):
    """Equal bit for bit, NaN where the other is NaN."""
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _one_rounding(a, b):
    """Equal up to one rounding of their dtype (the same float32 value rounded after a fused multiply-add or
    after a separate multiply and add), NaN where the other is NaN."""
    eps = torch.finfo(a.dtype).eps
    a, b = a.float(), b.float()
    return torch.equal(torch.isnan(a), torch.isnan(b)) and \
        bool(((a - b).abs() <= eps * b.abs()).logical_or(torch.isnan(b)).all())


def _check_rope_decode(device, d, dtype, cases, seed):
    """The fused call against rope_kv then decode_attention (their Triton kernels): the value cache bit for bit,
    the rotated keys up to one rounding (ptxas may fuse the rotation's multiply-add in one kernel and not in
    the other; the interpreter has them bit for bit), the output within a tenth of the dtype's tolerance; and the
    reference within the tolerance. Cache rows from each sequence's new row on are NaN before the call, so a
    split that read the new row before writing it (or any row past it) shows."""
    from xelink.kernels import rope_kv

    gen = torch.Generator().manual_seed(seed)
    for b, hq, hkv, smax, lens in cases:
        q, k, v, cos, sin, kc, vc = _rope_decode_inputs(b, hq, hkv, smax, d, dtype, device, gen)
        kv_lens = torch.tensor(lens, dtype=torch.int64, device=device)
        for i, n in enumerate(lens):
            kc[i, :, n - 1:] = float("nan")
            vc[i, :, n - 1:] = float("nan")
        kc2, vc2, kc3, vc3 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        _poison(device)
        out = A.rope_decode_attention(q, k, v, cos, sin, kc, vc, kv_lens, impl="triton")
        want = A.decode_attention(rope_kv(q, k, v, cos, sin, kv_lens - 1, kc2, vc2, impl="triton"), kc2, vc2, kv_lens,
                                  impl="triton")
        ref = A.reference_rope_decode_attention(q, k, v, cos, sin, kc3, vc3, kv_lens)
        where = f"rope decode D={d} {dtype} case={(b, hq, hkv, smax, lens)}"
        assert not torch.isnan(out).any(), f"NaN in output: {where}"
        exact = device == "cpu"  # the interpreter: no fused multiply-adds
        assert (_same if exact else _one_rounding)(kc, kc2) and _same(vc, vc2), where
        assert (_same if exact else _one_rounding)(kc, kc3) and _same(vc, vc3), where
        assert torch.equal(out, want) if exact else _rel(out, want) < TOL[dtype] / 10, \
            f"{where}: rel diff to the unfused {_rel(out, want):.2e}"
        assert _rel(out, ref) < TOL[dtype], f"{where}: rel err {_rel(out, ref):.2e}"


def test_rope_decode_reference_against_float64():
    """The reference (and impl="auto" on the CPU) against float64 written out here: q and k rotated at
    position kv_lens - 1, k and v stored in that cache row, attention over rows 0 .. kv_lens - 1."""
    gen = torch.Generator().manual_seed(21)
    q, k, v, cos, sin, kc, vc = _rope_decode_inputs(3, 8, 2, 50, 64, torch.float32, "cpu", gen)
    lens = torch.tensor([1, 50, 23])
    kc0, vc0 = kc.clone(), vc.clone()
    out = A.rope_decode_attention(q, k, v, cos, sin, kc, vc, lens)
    kc2, vc2 = kc0.clone(), vc0.clone()
    assert torch.equal(A.reference_rope_decode_attention(q, k, v, cos, sin, kc2, vc2, lens), out)
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)

    def rot(x, p):
        x, c, s = x.double(), cos[p].double(), sin[p].double()
        return x * c + torch.cat((-x[..., 32:], x[..., :32]), dim=-1) * s

    for b, n in enumerate(lens.tolist()):
        keys, vals = kc0[b:b + 1].double().clone(), vc0[b:b + 1].double().clone()
        keys[:, :, n - 1] = rot(k[b:b + 1, :, 0], n - 1)
        vals[:, :, n - 1] = v[b:b + 1, :, 0].double()
        assert (kc[b:b + 1].double() - keys).abs().max() < 1e-6 and torch.equal(vc[b:b + 1].double(), vals)
        ref, _ = _attention64(rot(q[b:b + 1], n - 1), keys, vals, False, 1 / 8, kv_len=n)
        assert _rel(out[b:b + 1], ref) < 1e-5, (b, n)


def test_rope_decode_bad_inputs():
    gen = torch.Generator().manual_seed(2)
    q, k, v, cos, sin, kc, vc = _rope_decode_inputs(2, 8, 2, 16, 64, torch.float32, "cpu", gen)
    lens = torch.tensor([3, 16])
    f = A.rope_decode_attention
    with pytest.raises(ValueError, match=r"^rope_decode_attention: q must be \(B, Hq, 1, D\)"):
        f(q.expand(2, 8, 2, 64), k, v, cos, sin, kc, vc, lens)
    with pytest.raises(ValueError, match=r"^rope_decode_attention: cos must be a float \(max_positions, 64\) table"):
        f(q, k, v, cos[:, :32], sin, kc, vc, lens)
    with pytest.raises(TypeError, match="^rope_decode_attention: q, k, v, k_cache and v_cache must share one float"):
        f(q, k, v, cos, sin, kc.half(), vc, lens)
    with pytest.raises(TypeError, match="^rope_decode_attention: kv_lens.dtype=torch.float32 must be"):
        f(q, k, v, cos, sin, kc, vc, lens.float())
    with pytest.raises(ValueError, match=r"^rope_decode_attention: batch differs: q.shape\[0\]=2 != k_cache.shape"):
        f(q, k, v, cos, sin, torch.cat([kc, kc]), torch.cat([vc, vc]), lens)
    with pytest.raises(ValueError, match="^rope_decode_attention: scale=0.0 must be"):
        f(q, k, v, cos, sin, kc, vc, lens, scale=0.0)
    with pytest.raises(ValueError, match="^rope_decode_attention: impl='cuda'"):
        f(q, k, v, cos, sin, kc, vc, lens, impl="cuda")
    with pytest.raises(ValueError, match="^rope_decode_attention: out"):
        f(q, k, v, cos, sin, kc, vc, lens, out=torch.empty(2, 8, 1, 32))
    assert torch.isfinite(kc).all() and torch.isfinite(vc).all()  # nothing ran


def _rope_decode_compiled(device, dtype, impl, ring=False):
    """rope_decode_attention under torch.compile(fullgraph=True) (its custom op, the caches marked as written)
    twice as lengths grow, against eager calls on copies of the caches: outputs and caches bit for bit (``ring``:
    ring caches of 64 rows, the lengths past them)."""
    gen = torch.Generator().manual_seed(13)
    q, k, v, cos, sin, kc, vc = _rope_decode_inputs(2, 8, 2, 300, 64, dtype, device, gen)
    if ring:
        kc, vc = kc[:, :, :64].clone(), vc[:, :, :64].clone()
    kc2, vc2 = kc.clone(), vc.clone()

    def step(q, k, v, kc, vc, lens, out):
        A.rope_decode_attention(q, k, v, cos, sin, kc, vc, lens, impl=impl, out=out, ring=ring)
        return A.rope_decode_attention(q * 2, k, v, cos, sin, kc, vc, lens + 1, impl=impl, ring=ring) + out

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for lens in ([5, 200], [6, 201]):
        lens = torch.tensor(lens, device=device)
        got = compiled(q, k, v, kc, vc, lens, torch.empty_like(q))
        want = step(q, k, v, kc2, vc2, lens, torch.empty_like(q))
        assert _same(got, want) and _same(kc, kc2) and _same(vc, vc2), lens


def test_rope_decode_custom_op():
    """The custom op passes torch.library.opcheck (schema, mutated caches and out, fake implementation) on the
    strided views the model passes; fullgraph torch.compile traces the call as eager runs it."""
    gen = torch.Generator().manual_seed(3)
    q, k, v, cos, sin, kc, vc = _rope_decode_inputs(2, 8, 2, 40, 64, torch.float32, "cpu", gen)
    lens = torch.tensor([7, 40])
    torch.library.opcheck(torch.ops.xelink.rope_decode_attention.default,
                          (q, k, v, cos, sin, kc, vc, lens, 0.125, "reference", "off", torch.empty(2, 8, 1, 64), 0,
                           False))
    torch.library.opcheck(torch.ops.xelink.rope_decode_attention.default,  # a sliding window of 5 keys
                          (q, k, v, cos, sin, kc, vc, lens, 0.125, "reference", "off", torch.empty(2, 8, 1, 64), 5,
                           False))
    torch.library.opcheck(torch.ops.xelink.rope_decode_attention.default,  # ring caches of 16 rows
                          (q, k, v, cos, sin, kc[:, :, :16], vc[:, :, :16], lens, 0.125, "reference", "off",
                           torch.empty(2, 8, 1, 64), 0, True))
    _rope_decode_compiled("cpu", torch.float32, "reference")
    _rope_decode_compiled("cpu", torch.float32, "reference", ring=True)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and Triton")
def test_rope_decode_compiled_interpreter():
    _rope_decode_compiled("cpu", torch.float16, "triton")
    _rope_decode_compiled("cpu", torch.float16, "triton", ring=True)


@pytest.mark.gpu
def test_rope_decode_compiled_gpu(requires_gpus):
    requires_gpus(1)
    _rope_decode_compiled("cuda", torch.bfloat16, "triton")
    _rope_decode_compiled("cuda", torch.bfloat16, "triton", ring=True)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and Triton")
def test_rope_decode_kernel_interpreter():
    # the new row first, last, in the middle of a split and at a split's first key; GQA 4 and MHA
    cases = [(2, 8, 2, 200, [37, 130]), (3, 4, 1, 96, [1, 96, 65]), (1, 2, 2, 700, [513])]
    _check_rope_decode("cpu", 64, torch.float16, cases, seed=5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", A.HEAD_DIMS)
def test_rope_decode_kernel_gpu(requires_gpus, d, dtype):
    requires_gpus(1)
    cases = [(1, 32, 8, 8192, [8192]), (1, 32, 8, 8192, [4097]), (3, 32, 8, 4099, [1, 4099, 2500]),
             (2, 16, 2, 777, [777, 300]), (4, 8, 8, 1000, [65, 64, 63, 1000])]
    _check_rope_decode("cuda", d, dtype, cases, seed=d)


@pytest.mark.gpu
def test_rope_decode_in_a_cuda_graph(requires_gpus):
    """Captured once, replayed as the lengths grow (each replay writes the next row), against the eager
    rope_kv + decode_attention on copies of the caches (as _check_rope_decode: keys up to one rounding)."""
    from xelink.kernels import rope_kv

    requires_gpus(1)
    gen = torch.Generator().manual_seed(8)
    q, k, v, cos, sin, kc, vc = _rope_decode_inputs(2, 32, 8, 3000, 128, torch.bfloat16, "cuda", gen)
    kc2, vc2 = kc.clone(), vc.clone()
    lens = torch.tensor([10, 2000], device="cuda")
    A.rope_decode_attention(q, k, v, cos, sin, kc, vc, lens)  # compiled and remembered before the capture
    kc.copy_(kc2)
    vc.copy_(vc2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = A.rope_decode_attention(q, k, v, cos, sin, kc, vc, lens)
    kc.copy_(kc2)
    vc.copy_(vc2)
    for step in range(4):
        lens.copy_(torch.tensor([11 + step, 2001 + 300 * step]))
        q.copy_(torch.randn(q.shape, generator=gen).to(q))  # q, k, v are views of one buffer
        graph.replay()
        want = A.decode_attention(rope_kv(q, k, v, cos, sin, lens - 1, kc2, vc2), kc2, vc2, lens)
        torch.cuda.synchronize()
        assert _rel(yg, want) < TOL[torch.bfloat16] / 10 and _one_rounding(kc, kc2) and torch.equal(vc, vc2), step
        kc2.copy_(kc)  # the next step's unfused call reads the same keys


def _check_merge(device, dtype):
    gen = torch.Generator().manual_seed(5)
    q, k, v = _qkv(2, 8, 2, 100, 700, 128, dtype, device=device, gen=gen)
    outs, lses = [], []
    for lo, hi in [(0, 128), (128, 128), (128, 450), (450, 700)]:
        o, s = A.flash_attention(q, k[:, :, lo:hi], v[:, :, lo:hi], return_lse=True, impl="triton")
        outs.append(o)
        lses.append(s)
    _poison(device)
    out, lse = A.merge_attention(outs, lses, impl="triton")
    ref, ref_lse = A.reference_flash_attention(q, k, v, return_lse=True)
    assert not torch.isnan(out).any()
    assert _rel(out, ref) < TOL[dtype]
    assert (lse - ref_lse).abs().max() < 2e-3
    ref_out, ref_merged = A.reference_merge_attention(outs, lses)
    assert _rel(out, ref_out) < 5e-3
    assert (lse - ref_merged).abs().max() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_merge_kernel_gpu(requires_gpus, dtype):
    requires_gpus(1)
    _check_merge("cuda", dtype)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and Triton")
def test_merge_kernel_interpreter():
    _check_merge("cpu", torch.float16)


@pytest.mark.gpu
def test_auto_compile_and_cuda_graph_gpu(requires_gpus):
    """impl='auto' names a kernel; torch.compile traces the custom ops; decode replays in a CUDA graph."""
    requires_gpus(1)
    device = torch.device("cuda", torch.cuda.current_device())
    want = "cuda" if torch.cuda.get_device_capability()[0] == 9 else "triton"
    assert A.resolve_impl("t", "auto", device) == want
    q, k, v = _qkv(1, 8, 2, 200, 300, 128, torch.bfloat16, device="cuda")

    ref = A.reference_flash_attention(q, k, v, causal=True)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def op(q, k, v):  # the custom op itself: traced through its fake implementation, no graph break
        out = torch.empty_like(q)
        lse = torch.ops.xelink.flash_attention(q, k, v, True, 128 ** -0.5, want, "off", out, 0)
        return out * 2, lse

    @torch.compile(backend="aot_eager")
    def public(q, k, v):  # the public wrapper (its argument checks may break the graph)
        return A.flash_attention(q, k, v, causal=True) * 2

    assert _rel(op(q, k, v)[0] / 2, ref) < TOL[torch.bfloat16]
    assert _rel(public(q, k, v) / 2, ref) < TOL[torch.bfloat16]

    kc = torch.randn(2, 2, 5000, 128, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(2, 2, 5000, 128, device="cuda", dtype=torch.bfloat16)
    qd = torch.randn(2, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([5000, 10], dtype=torch.int32, device="cuda")
    A.decode_attention(qd, kc, vc, lens)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static = A.decode_attention(qd, kc, vc, lens)
    for new_lens in ([5000, 10], [17, 4321]):
        lens.copy_(torch.tensor(new_lens))
        g.replay()
        torch.cuda.synchronize()
        assert _rel(static, A.reference_decode_attention(qd, kc, vc, lens)) < TOL[torch.bfloat16]


def test_merge_fake_result_is_contiguous_like_the_real_one():
    o = torch.randn(1, 4, 5, 8)
    lse = torch.randn(1, 5, 4).transpose(1, 2)  # (B, H, S) views of a (B, S, H) buffer
    torch.library.opcheck(torch.ops.xelink.merge_attention.default, ([o, o], [lse, lse], "reference", "off",
                                                                    torch.empty(1, 4, 5, 8)))
    assert A.merge_attention([o, o], [lse, lse], impl="reference")[1].is_contiguous()


def test_numpy_scale_is_taken_where_a_float_is():
    np = pytest.importorskip("numpy")
    q, k, v = _qkv(1, 2, 1, 3, 4, 8, torch.float32)
    assert torch.equal(A.flash_attention(q, k, v, scale=np.float32(0.5)), A.flash_attention(q, k, v, scale=0.5))

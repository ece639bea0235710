"""GEMV: packing formats and their round trips, the reference against float64, argument checks (out=, pdl=
and its config["PDL"] alias included), and the Triton kernels (GPU: every format, dtype, row count, tails,
split-K; CPU interpreter with TRITON_INTERPRET=1)."""
import importlib.util
import os
import random

import pytest
import torch

from xelink.kernels.gemv import (W4_GROUP, gemv, pack_w4a16, pack_w8a16, reference_gemv, tile_w4a16,
                                 tiled_w4a16_native, unpack_w4a16, unpack_w8a16, untile_w4a16)
from xelink.kernels.qgemm import qgemm
from xelink.kernels.norm import silu_mul

from out_blocks import on_two_streams, only_block_written, poisoned

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON
TOL = {torch.bfloat16: 8e-3, torch.float16: 1e-3}


def _weights(fmt, n, k, dtype, device="cpu", gen=None):
    w = torch.randn(n, k, generator=gen, device=device) * 0.05
    if fmt in ("bf16", "fp16"):
        return w.to(dtype), None, w.to(dtype).double()
    q, s = (pack_w8a16 if fmt == "w8a16" else pack_w4a16)(w, dtype)
    exact = unpack_w8a16(q, s) if fmt == "w8a16" else unpack_w4a16(q, s)
    return q, s, exact.double()


def _relerr(y, x, exact_w):
    # Relative to the result, or to 1% of the sum of |terms| where the result cancels more than that:
    # fp32 accumulation errors scale with the terms, and a single output (N = M = 1) can cancel
    # arbitrarily (a 1-in-2600 failure at N=1, K=128 in a GPU stress run, run 15).
    ref = x.double() @ exact_w.T
    terms = x.double().abs() @ exact_w.abs().T
    return float((y.double() - ref).norm() / max(ref.norm(), 0.01 * terms.norm()))


# -- packing ------------------------------------------------------------------------------------------

def test_w4_layout_low_nibble_is_even_k():
    # One group with w[k] = (k % 15) - 7: max |w| = 7, so the scale is exactly 1 and nibble = w + 8.
    k = torch.arange(W4_GROUP)
    w = ((k % 15) - 7).float()[None]
    packed, scales = pack_w4a16(w, torch.float32)
    assert packed.dtype == torch.uint8 and packed.shape == (1, W4_GROUP // 2) and scales.shape == (1, 1)
    assert float(scales) == 1.0
    assert int(packed[0, 0]) == 0x21  # k=0 -> nibble 1 (low), k=1 -> nibble 2 (high)
    want = ((k[0::2] % 15) + 1) | (((k[1::2] % 15) + 1) << 4)
    assert torch.equal(packed[0].long(), want)
    assert torch.equal(unpack_w4a16(packed, scales), w)


def test_w4_tiles_layout_and_round_trip():
    # "w4a16t": tiles of 16 rows x 64 bytes (one scale group), each contiguous, a 16-row block's tiles in column
    # order, blocks in row order
    n, k = 48, 384
    packed, scales = pack_w4a16(torch.randn(n, k), torch.bfloat16)
    tiled = tile_w4a16(packed)
    assert tiled.shape == packed.shape and tiled.dtype == torch.uint8 and tiled.is_contiguous()
    flat = tiled.reshape(-1)
    for row, byte in ((0, 0), (5, 63), (15, 64), (16, 0), (33, 130), (47, 191)):
        at = (row // 16) * 16 * (k // 2) + (byte // 64) * 1024 + (row % 16) * 64 + byte % 64
        assert flat[at] == packed[row, byte], (row, byte)
    assert not torch.equal(tiled, packed) and torch.equal(untile_w4a16(tiled), packed)
    with pytest.raises(ValueError, match=r"tile_w4a16: packed.shape=\(20, 64\) must be \[N, K/2\] with N a multiple "
                                         r"of 16"):
        tile_w4a16(packed[:20, :64])
    with pytest.raises(ValueError, match="tile_w4a16: .* K of 128"):
        tile_w4a16(packed[:, :100])
    with pytest.raises(TypeError, match="tile_w4a16: packed.dtype=torch.int8 must be torch.uint8"):
        tile_w4a16(packed.view(torch.int8))
    with pytest.raises(ValueError, match="untile_w4a16: a tiled weight is contiguous"):
        untile_w4a16(torch.zeros(16, 128, dtype=torch.uint8)[:, :64])


def test_w4_tiles_off_the_tensor_core_kernel():
    # Where the tensor-core kernel does not run (CPU: the reference), gemv and qgemm give the row layout's results
    w, s, _ = _weights("w4a16", 32, 256, torch.bfloat16)
    t = tile_w4a16(w)
    for m in (1, 3, 8):
        x = torch.randn(m, 256).to(torch.bfloat16)
        assert torch.equal(gemv(t, x, s, "w4a16t"), gemv(w, x, s, "w4a16"))
        assert torch.equal(gemv(t, x, s, "w4a16t", act="silu_mul"), gemv(w, x, s, "w4a16", act="silu_mul"))
        assert torch.equal(qgemm(t, x, s, "w4a16t"), qgemm(w, x, s, "w4a16"))
        assert torch.equal(reference_gemv(t, x, s, "w4a16t"), reference_gemv(w, x, s, "w4a16"))
    assert not tiled_w4a16_native("cpu")
    x = torch.randn(2, 256).to(torch.bfloat16)
    for fn in (gemv, qgemm):
        with pytest.raises(ValueError, match=rf"{fn.__name__}: fmt='w4a16t' takes tile_w4a16's weight: contiguous, "
                                             r"N a multiple of 16 \(got shape \(20, 128\)"):
            fn(t[:20], x, s[:20], "w4a16t")
        with pytest.raises(ValueError, match=rf"{fn.__name__}: fmt='w4a16t' takes tile_w4a16's weight"):
            fn(torch.zeros(32, 256, dtype=torch.uint8)[:, :128], x, s, "w4a16t")


@pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
def test_interpreted_tiles_take_a_row_copy():
    # impl="triton" (the portable kernels) reads a row-layout copy: the row layout's result bit for bit
    w, s, _ = _weights("w4a16", 48, 384, torch.float16)
    x = torch.randn(3, 384).to(torch.float16)
    cfg = dict(KERNEL="words", BLOCK_N=16, BLOCK_K=128, SPLIT_K=2, num_warps=1, num_stages=1)
    assert torch.equal(gemv(tile_w4a16(w), x, s, "w4a16t", "triton", config=cfg), gemv(w, x, s, "w4a16", "triton",
                                                                                         config=cfg))
    assert torch.equal(gemv(tile_w4a16(w), x, s, "w4a16t", "triton"), gemv(w, x, s, "w4a16", "triton"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w8_round_trip(dtype):
    w = torch.randn(17, 40) * 3
    w[3] = 0  # an all-zero row gets scale 1 and zeros
    q, s = pack_w8a16(w, dtype)
    assert q.dtype == torch.int8 and s.dtype == dtype and s.shape == (17,)
    deq = unpack_w8a16(q, s)
    assert torch.equal(deq, q.float() * s.float()[:, None])  # exact by definition
    assert (deq - w).abs().le(s.float()[:, None] * 0.5 + 1e-6).all()
    assert float(s[3]) == 1.0 and (q[3] == 0).all()
    assert int(q.abs().max()) <= 127


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4_round_trip(dtype):
    w = torch.randn(5, 3 * W4_GROUP)
    w[1, W4_GROUP:2 * W4_GROUP] = 0
    p, s = pack_w4a16(w, dtype)
    assert p.shape == (5, 3 * W4_GROUP // 2) and s.shape == (5, 3) and s.dtype == dtype
    deq = unpack_w4a16(p, s)
    step = s.float().repeat_interleave(W4_GROUP, dim=1)
    assert (deq - w).abs().le(step * 0.5 + 1e-6).all()
    assert float(s[1, 1]) == 1.0
    assert torch.equal(unpack_w4a16(*pack_w4a16(deq, torch.float32)), deq)  # a packed weight packs to itself


def test_pack_w8a16_of_a_column_slice_takes_the_whole_rows_scale():
    """A row-parallel projection's slice of columns, scaled by the whole rows' largest: the whole weight's packing,
    cut (each slice's own largest gave another model under TP); a magnitude below the slice's own is refused."""
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))
    q, s = pack_w8a16(w, torch.bfloat16)
    amax = w.abs().amax(1)
    for lo, hi in ((0, 32), (32, 64)):
        qs, ss = pack_w8a16(w[:, lo:hi], torch.bfloat16, amax)
        assert torch.equal(ss, s) and torch.equal(qs, q[:, lo:hi])
    assert not torch.equal(pack_w8a16(w[:, :32], torch.bfloat16)[1], s)  # (its own largest: another scale)
    with pytest.raises(ValueError, match=r"pack_w8a16: amax \(shape \(8,\)\) must give each of w's 8 rows"):
        pack_w8a16(w, torch.bfloat16, amax / 2)


def test_float16_scales_of_tiny_and_huge_weights():
    """float16 scales among the subnormals are rounded up too (a relative bump was lost there: a row of largest
    189 * 2^-24 scaled by 2^-24, its largest weight clipped to 127 steps, 62 scales off; a row of largest 2^-24
    scaled by 0); one past float16's largest is refused (an inf scale dequantized its weights to NaN)."""
    tiny = 2.0 ** -24
    for pack, unpack, width, top in ((pack_w8a16, unpack_w8a16, 8, 189), (pack_w4a16, unpack_w4a16, W4_GROUP, 10),
                                     (pack_w8a16, unpack_w8a16, 4, 1)):
        w = torch.zeros(1, width, dtype=torch.float16)
        w[0, 0], w[0, 1] = top * tiny, -top * tiny / 2
        packed, scales = pack(w)
        assert bool((scales.float() > 0).all())
        step = scales.float().repeat_interleave(width // scales.shape[-1], dim=-1) if scales.dim() == 2 else \
            scales.float()[:, None]
        assert (unpack(packed, scales) - w.float()).abs().le(step * 0.5).all(), (pack.__name__, top, scales)
    with pytest.raises(ValueError, match=r"pack_w4a16: the weights' largest magnitude 500000 needs a scale over "):
        pack_w4a16(torch.full((1, W4_GROUP), 5e5), torch.float16)
    with pytest.raises(ValueError, match=r"pack_w8a16: .* over torch.float16's largest"):
        pack_w8a16(torch.full((1, 16), 1e7), torch.float16)


def test_pack_errors():
    with pytest.raises(ValueError, match="pack_w4a16: K=100 must be a multiple of 128"):
        pack_w4a16(torch.randn(2, 100))
    with pytest.raises(TypeError, match=r"pack_w8a16: w.dtype=torch.int32"):
        pack_w8a16(torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="pack_w8a16: w must be 2-D"):
        pack_w8a16(torch.ones(2))
    # unpack refuses what would silently broadcast or sign-extend into wrong weights
    packed, scales = pack_w4a16(torch.randn(4, 256))
    with pytest.raises(ValueError, match=r"unpack_w4a16: scales.shape=\(4, 1\) must be \(4, 2\)"):
        unpack_w4a16(packed, scales[:, :1])
    with pytest.raises(TypeError, match="unpack_w4a16: the packed weight's dtype is torch.int8, not torch.uint8"):
        unpack_w4a16(packed.view(torch.int8), scales)
    q, s8 = pack_w8a16(torch.randn(4, 16))
    with pytest.raises(ValueError, match=r"unpack_w8a16: scales.shape=\(4, 1\) must be \(4,\)"):
        unpack_w8a16(q, s8[:, None])


# -- reference ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["bf16", "fp16", "w8a16", "w4a16"])
@pytest.mark.parametrize("M", [1, 3, 8])
def test_reference_matches_float64(fmt, M):
    dtype = torch.float16 if fmt == "fp16" else torch.bfloat16
    w, s, exact = _weights(fmt, 33, 256, dtype)
    x = torch.randn(M, 256).to(dtype)
    y = gemv(w, x, s, fmt)  # CPU: auto is the reference
    assert y.shape == (M, 33) and y.dtype == dtype
    assert _relerr(y, x, exact) < TOL[dtype]
    assert torch.equal(y, reference_gemv(w, x, s, fmt))
    y1 = gemv(w, x[0], s, fmt)  # 1-D x gives a 1-D y
    assert y1.shape == (33,) and _relerr(y1[None], x[:1], exact) < TOL[dtype]


def _bad(**kw):
    base = dict(w=torch.ones(4, 256, dtype=torch.bfloat16), x=torch.ones(2, 256, dtype=torch.bfloat16), scales=None,
                fmt="bf16", impl="auto")
    base.update(kw)
    return base


@pytest.mark.parametrize("kwargs, error, match", [
    (_bad(x=torch.ones(9, 256, dtype=torch.bfloat16)), ValueError, "gemv: x has M=9 rows; gemv takes 1 to 8"),
    (_bad(x=torch.ones(2, 256)), TypeError, r"gemv: x.dtype=torch.float32"),
    (_bad(w=torch.ones(4, 256, dtype=torch.float16)), TypeError, "gemv: fmt='bf16' needs w and x in torch.bfloat16"),
    (_bad(w=torch.ones(4, 128, dtype=torch.bfloat16)), ValueError, r"gemv: w.shape\[1\]=128 != K=256"),
    (_bad(fmt="int3"), ValueError, "gemv: fmt='int3' is not one of bf16, fp16, w8a16, w4a16"),
    (_bad(impl="gpu"), ValueError, "gemv: impl='gpu' is not one of auto, triton, cuda, reference"),
    (_bad(fmt="w8a16"), TypeError, r"gemv: fmt='w8a16' needs w.dtype=torch.int8"),
    (_bad(fmt="w8a16", w=torch.ones(4, 256, dtype=torch.int8), scales=torch.ones(3, dtype=torch.bfloat16)),
     ValueError, r"gemv: w8a16 scales.shape=\(3,\) must be \(4,\)"),
    (_bad(fmt="w8a16", w=torch.ones(4, 256, dtype=torch.int8), scales=torch.ones(4)), TypeError,
     r"gemv: scales.dtype=torch.float32 must equal x.dtype=torch.bfloat16"),
    (_bad(fmt="w8a16", w=torch.ones(4, 256, dtype=torch.int8)), TypeError, "gemv: scales must be a torch.Tensor"),
    (_bad(fmt="w4a16", w=torch.ones(4, 128, dtype=torch.uint8), scales=torch.ones(4, 1, dtype=torch.bfloat16)),
     ValueError, r"gemv: w4a16 scales.shape=\(4, 1\) must be \(4, 2\)"),
    (_bad(fmt="w4a16", w=torch.ones(4, 100, dtype=torch.uint8), x=torch.ones(1, 200, dtype=torch.bfloat16),
          scales=torch.ones(4, 1, dtype=torch.bfloat16)),
     ValueError, "gemv: w4a16 needs K=200 to be a multiple of 128"),
    (_bad(fmt="w4a16", w=torch.ones(4, 256, dtype=torch.uint8), scales=torch.ones(4, 2, dtype=torch.bfloat16)),
     ValueError, r"gemv: w4a16 w.shape\[1\]=256 != K/2=128"),
    (_bad(w=torch.ones(256, 4, dtype=torch.bfloat16).T), ValueError, "gemv: w must be contiguous along K"),
    (_bad(scales=torch.ones(4, dtype=torch.bfloat16)), ValueError, "gemv: fmt='bf16' takes no scales"),
])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        gemv(**kwargs)


# -- act="silu_mul": the gate/up projection with SwiGLU at the store -----------------------------------------

def _act_unfused(w, x, s, fmt, impl, cfg=None):
    """What act="silu_mul" must equal: the plain GEMV into x's dtype, then silu_mul."""
    return silu_mul(gemv(w, x, s, fmt, impl=impl, config=cfg), impl="reference" if impl == "reference" else "triton")


@pytest.mark.parametrize("fmt", ["bf16", "w8a16", "w4a16"])
def test_act_reference(fmt):
    w, s, exact = _weights(fmt, 2 * 9, 256, torch.bfloat16)
    x = torch.randn(3, 256).to(torch.bfloat16)
    y = gemv(w, x, s, fmt, impl="reference", act="silu_mul")
    assert y.shape == (3, 9) and torch.equal(y, _act_unfused(w, x, s, fmt, "reference"))
    g, u = (x.double() @ exact.T).chunk(2, dim=-1)
    assert torch.allclose(y.double(), g * torch.sigmoid(g) * u, rtol=0.05, atol=0.02)
    # 1-D x, 1-D y: its one-row batch's (not bitwise y[1]: torch's CPU matmul may sum a 3-row batch in another
    # order than one row; CI once saw one output of the 27 round apart)
    one = gemv(w, x[1], s, fmt, impl="reference", act="silu_mul")
    assert one.shape == (9,) and torch.equal(one, gemv(w, x[1:2], s, fmt, impl="reference", act="silu_mul")[0])
    out = torch.full((3, 20), float("nan"), dtype=torch.bfloat16)
    assert gemv(w, x, s, fmt, impl="reference", act="silu_mul", out=out[:, 5:14]) is not None
    assert torch.equal(out[:, 5:14], y) and out[:, :5].isnan().all() and out[:, 14:].isnan().all()


@pytest.mark.parametrize("kwargs, match", [
    (_bad(act="gelu"), "gemv: act='gelu' is not None or one of silu_mul"),
    (_bad(w=torch.ones(5, 256, dtype=torch.bfloat16), act="silu_mul"), "an even number of rows, got N=5"),
    (_bad(act="silu_mul", out=torch.empty(2, 4, dtype=torch.bfloat16)), r"gemv: out.shape=\(2, 4\) must be \(2, 2\)"),
])
def test_act_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gemv(**kwargs)


@pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("fmt", ["fp16", "w8a16", "w4a16"])
@pytest.mark.parametrize("kernel", ["fma", "mma", "mma-fold", "words"])
def test_interpreted_act(fmt, kernel):
    # One launch with the (gate, up) rows of each output in one tile equals the GEMV then silu_mul with the
    # same tiles, bit for bit: output tails (F not whole tiles), 1-3 rows, a K split in the config (act runs
    # unsplit), out= a column block.
    if kernel == "fma" and fmt == "w4a16" or kernel == "words" and fmt == "fp16" or \
            kernel == "mma-fold" and fmt != "w4a16":
        pytest.skip("not a kernel of this format")
    for M, F, K, block_n in [(1, 20, 256, 16), (3, 9, 384, 4), (2, 1, 256, 2)]:
        w, s, _ = _weights(fmt, 2 * F, K, torch.float16)
        x = torch.randn(M, K).to(torch.float16)
        cfg = dict(KERNEL=kernel.split("-")[0], BLOCK_N=block_n, BLOCK_K=128, SPLIT_K=2, num_warps=1, num_stages=1,
                   FOLD=kernel.endswith("fold"))
        want = _act_unfused(w, x, s, fmt, "triton", dict(cfg, SPLIT_K=1))
        assert torch.equal(gemv(w, x, s, fmt, impl="triton", config=cfg, act="silu_mul"), want), (M, F, K, block_n)
        out = torch.full((M, F + 3), float("nan"), dtype=torch.float16)
        gemv(w, x, s, fmt, impl="triton", config=cfg, act="silu_mul", out=out[:, 1:F + 1])
        assert torch.equal(out[:, 1:F + 1], want) and out[:, 0].isnan().all() and out[:, F + 1:].isnan().all()
    with pytest.raises(ValueError, match="act='silu_mul' needs an even BLOCK_N"):
        gemv(w, x, s, fmt, impl="triton", config=dict(cfg, BLOCK_N=3), act="silu_mul")
    with pytest.raises(ValueError, match=r"gemv: config \{.*\} lacks BLOCK_K, SPLIT_K: KERNEL="):  # (a KeyError)
        gemv(w, x, s, fmt, impl="triton", config={"KERNEL": cfg["KERNEL"], "BLOCK_N": 4})


@pytest.mark.skipif(INTERPRET, reason="the interpreter runs Triton on CPU tensors")
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_triton_impl_on_cpu_is_refused(impl):
    with pytest.raises((RuntimeError, ValueError), match=f"gemv: impl='{impl}'"):
        gemv(**_bad(impl=impl))


def test_fake_impl():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        y = torch.empty(3, 7, dtype=torch.float16)
        assert torch.ops.xelink.gemv(torch.empty(7, 64, dtype=torch.uint8), torch.empty(3, 128, dtype=torch.float16),
                                     torch.empty(7, 1, dtype=torch.float16), "w4a16", "cuda", "auto", None, y) is None


@pytest.mark.parametrize("fmt", ["bf16", "w4a16"])
@pytest.mark.parametrize("where", ["rows", "cols"])
def test_out_writes_only_its_block(fmt, where):
    # CPU: the reference path copies into out, a row or column block of a poisoned buffer; a 1-D x takes a
    # 1-D out. Under torch.compile the same call goes through the custom op, which writes out.
    w, s, _ = _weights(fmt, 12, 256, torch.bfloat16)
    x = torch.randn(3, 256).to(torch.bfloat16)
    want = reference_gemv(w, x, s, fmt)
    big = poisoned(8, 20)
    block = big[4:7, :12] if where == "rows" else big[1:4, 5:17]
    assert gemv(w, x, s, fmt, out=block) is block
    assert torch.equal(block, want)
    only_block_written(big, block)
    row = poisoned(2, 16)
    piece = row[1, 2:14]
    assert gemv(w, x[1], s, fmt, out=piece) is piece
    assert torch.equal(piece, reference_gemv(w, x[1:2], s, fmt)[0])  # a one-row batch's sums (see test_act_reference)
    only_block_written(row, piece)
    big = poisoned(8, 20)
    compiled = torch.compile(lambda a, o: gemv(w, a, s, fmt, out=o), backend="aot_eager", fullgraph=True)
    compiled(x, big[1:4, 5:17])
    assert torch.equal(big[1:4, 5:17], want)
    only_block_written(big, big[1:4, 5:17])


_W, _XG = torch.ones(4, 256, dtype=torch.bfloat16), torch.ones(2, 256, dtype=torch.bfloat16)


@pytest.mark.parametrize("x, out, error, match", [
    (_XG, "y", TypeError, "gemv: out must be a torch.Tensor, got str"),
    (_XG, torch.empty(2, 5, dtype=torch.bfloat16), ValueError, r"gemv: out.shape=\(2, 5\) must be \(2, 4\)"),
    (_XG[0], torch.empty(1, 4, dtype=torch.bfloat16), ValueError, r"gemv: out.shape=\(1, 4\) must be \(4,\)"),
    (_XG, torch.empty(2, 4, dtype=torch.float16), TypeError, "gemv: out.dtype=torch.float16 must be torch.bfloat16"),
    (_XG, torch.empty(2, 4, dtype=torch.bfloat16, device="meta"), ValueError, "gemv: out is on meta"),
    (_XG, torch.empty(4, 2, dtype=torch.bfloat16).T, ValueError, "must be 1 along the last dim"),
    (_XG, _XG[:, :4], ValueError, "gemv: out overlaps x in memory"),
])
def test_bad_out(x, out, error, match):
    with pytest.raises(error, match=match):
        gemv(_W, x, out=out)


def test_pdl_and_its_config_alias():
    # pdl= takes pdl.pdl_option's values; config["PDL"] (the old spelling) is mapped to it, the two must agree.
    want = reference_gemv(_W, _XG)
    for off in (None, False):
        assert torch.equal(gemv(_W, _XG, pdl=off), want)
    assert torch.equal(gemv(_W, _XG, config={"PDL": False}), want)
    assert torch.equal(gemv(_W, _XG, pdl=False, config={"PDL": False}), want)
    for bad in ("soon", 1):
        with pytest.raises(ValueError, match=f"gemv: pdl={bad!r} must be None, True, False, 'early' or 'late'"):
            gemv(_W, _XG, pdl=bad)
    with pytest.raises(ValueError, match=r"gemv: config\['PDL'\]=1 must be None, True, False"):
        gemv(_W, _XG, config={"PDL": 1})
    with pytest.raises(ValueError, match=r"gemv: pdl=True and config\['PDL'\]=False differ; pass one"):
        gemv(_W, _XG, pdl=True, config={"PDL": False})
    for want_on in (True, "late"):  # a CUDA sm90 launch: refused on the CPU, by either spelling
        with pytest.raises(ValueError, match=r"gemv: pdl=.* needs a Triton kernel on a CUDA GPU"):
            gemv(_W, _XG, pdl=want_on)
        with pytest.raises(ValueError, match=r"gemv: config\['PDL'\]=.* needs a Triton kernel on a CUDA GPU"):
            gemv(_W, _XG, config={"PDL": want_on})


@pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("fmt", ["fp16", "w8a16", "w4a16"])
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("kernel", ["fma", "mma", "mma-fold", "words"])
def test_interpreted_kernel(fmt, split, kernel):
    if kernel == "fma" and fmt == "w4a16":
        pytest.skip("W4A16 runs on the word and tensor-core kernels")
    if kernel == "words" and fmt not in ("w8a16", "w4a16"):
        pytest.skip("the word kernel takes quantized weights")
    if kernel == "mma-fold" and fmt != "w4a16":
        pytest.skip("FOLD folds the W4A16 group scales")
    # fp16 activations: the interpreter's bf16 dot is wrong (Triton 3.6 + numpy); bf16 runs on the GPU.
    for M, N, K in [(1, 40, 256), (3, 17, 384)] + ([(2, 5, 200)] if fmt != "w4a16" else []):
        w, s, exact = _weights(fmt, N, K, torch.float16)
        x = torch.randn(M, K).to(torch.float16)
        cfg = dict(KERNEL=kernel.split("-")[0], BLOCK_N=16, BLOCK_K=128, SPLIT_K=split, num_warps=1, num_stages=1,
                   FOLD=kernel.endswith("fold"))
        ref = exact.half().double() if cfg["FOLD"] else exact  # FOLD rounds each weight once to fp16
        assert _relerr(gemv(w, x, s, fmt, impl="triton", config=cfg), x, ref) < TOL[torch.float16]


def test_tensor_core_config():
    # tc_config's defaults (runs 12, 13, 15): 8 warps a program on 4096-row matrices, 4 above; W4A16 at 5-8
    # rows: 4 row tiles (BIASED) from 65536 rows, 2 above 4096; 2 for W8A16 from 65536 rows; a grid split
    # only while warps are short.
    from xelink.kernels.gemv_tc import tc_config
    assert tc_config(8, 4096, 4096, "w4a16", 132) == dict(ROW_TILES=1, num_warps=8, UNROLL=2, SPLIT=1, BIASED=False)
    assert tc_config(8, 128256, 4096, "w4a16", 132) == dict(ROW_TILES=4, num_warps=4, UNROLL=1, SPLIT=1,
                                                            BIASED=True)
    assert tc_config(8, 14336, 4096, "w4a16", 132) == dict(ROW_TILES=2, num_warps=4, UNROLL=2, SPLIT=1,
                                                           BIASED=False)
    assert tc_config(1, 14336, 4096, "w4a16", 132)["ROW_TILES"] == 1
    # W4A16 at 1-4 rows where every program's warps are resident at once: 4 warps, 4 steps in flight a warp
    assert tc_config(1, 6144, 4096, "w4a16", 132) == dict(ROW_TILES=1, num_warps=4, UNROLL=4, SPLIT=1, BIASED=False)
    assert tc_config(4, 4096, 4096, "w4a16", 132) == dict(ROW_TILES=1, num_warps=4, UNROLL=4, SPLIT=1, BIASED=False)
    assert tc_config(1, 28672, 4096, "w4a16", 132)["UNROLL"] == 1  # 7168 warps: more than fit, no unroll
    assert tc_config(1, 6144, 4096, "w4a16", 132, num_warps=8)["UNROLL"] == 1  # a caller's warps: the old rule
    # tiled, the step's shapes (H100 sweeps): O's warps take their whole K slice at once (4 steps), gate/up 2 warps
    tiled = {(N, K): tc_config(1, N, K, "w4a16t", 132) for N, K in ((6144, 4096), (4096, 4096), (28672, 4096),
                                                                    (4096, 14336))}
    assert [(c["num_warps"], c["UNROLL"], c["SPLIT"]) for c in tiled.values()] == [(8, 2, 1), (8, 4, 1), (2, 1, 1),
                                                                                   (8, 1, 2)]
    assert tc_config(1, 128256, 4096, "w4a16", 132) == dict(ROW_TILES=1, num_warps=4, UNROLL=2, SPLIT=1,
                                                            BIASED=False)
    assert tc_config(1, 128256, 4096, "w8a16", 132) == dict(ROW_TILES=2, num_warps=4, UNROLL=2, SPLIT=1)
    few = tc_config(8, 64, 65536, "w8a16", 132)  # 4 programs: K split while warps are short and steps last
    steps = 65536 // 128
    assert few["SPLIT"] > 1 and (4 * few["SPLIT"] * few["num_warps"] >= 8 * 132
                                 or steps // (2 * few["SPLIT"] * few["num_warps"]) < 2)
    assert tc_config(8, 64, 512, "w8a16", 132)["SPLIT"] == 1  # 4 steps of K: too few to split


@pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("launch, match", [(dict(pdl=True), "compute capability >= 9.0"),
                                           (dict(pdl="late"), "compute capability >= 9.0"),
                                           (dict(config=dict(PDL=True)), "compute capability >= 9.0"),
                                           (dict(config=dict(PDL=1)), r"config\['PDL'\]=1 must be None, True")])
def test_interpreted_launch_options_need_sm90(launch, match):
    # Programmatic dependent launch is PTX of sm90+: asked for off that path, gemv refuses before launching.
    w, s, _ = _weights("w8a16", 16, 256, torch.float16)
    with pytest.raises(ValueError, match=match):
        gemv(w, torch.randn(1, 256).to(torch.float16), s, "w8a16", impl="triton", **launch)


@pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("kernel, fmt", [("fma", "w8a16"), ("mma", "w4a16"), ("words", "w4a16")])
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("where", ["rows", "cols"])
def test_interpreted_out_blocks(kernel, fmt, split, where):
    # Each kernel (and, with split 2, the split-K sum) stores into a row or column block of a poisoned
    # buffer: every element of the block, nothing outside it.
    N, K, M = 24, 256, 3
    w, s, exact = _weights(fmt, N, K, torch.float16)
    x = torch.randn(M, K).to(torch.float16)
    big = poisoned(8, 40, dtype=torch.float16)
    block = big[4:4 + M, :N] if where == "rows" else big[2:2 + M, 9:9 + N]
    cfg = dict(KERNEL=kernel, BLOCK_N=16, BLOCK_K=128, SPLIT_K=split, num_warps=1, num_stages=1)
    assert gemv(w, x, s, fmt, impl="triton", config=cfg, out=block) is block
    only_block_written(big, block)
    assert _relerr(block, x, exact) < TOL[torch.float16]


@pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
def test_interpreted_split_counters_return_to_zero():
    # The last split of each tile adds the partials and resets the tile's ticket counter (split.py): calls
    # that change the split and the tile count back to back share the counters and stay right.
    from xelink.kernels.split import SCRATCH
    for kernel, fmt, split, n in [("fma", "w8a16", 2, 24), ("mma", "w4a16", 3, 40), ("words", "w4a16", 2, 9),
                                  ("fma", "fp16", 4, 33)]:
        w, s, exact = _weights(fmt, n, 512, torch.float16)
        x = torch.randn(2, 512).to(torch.float16)
        cfg = dict(KERNEL=kernel, BLOCK_N=8, BLOCK_K=128, SPLIT_K=split, num_warps=1, num_stages=1)
        assert _relerr(gemv(w, x, s, fmt, impl="triton", config=cfg), x, exact) < TOL[torch.float16], (kernel, split)
        counters, _ = SCRATCH.get(torch.device("cpu"), 1, 1)
        assert not counters.any(), (kernel, split)


@pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
def test_interpreted_tensor_core_kernel_needs_cuda():
    w, s, _ = _weights("w4a16", 16, 256, torch.float16)
    with pytest.raises(ValueError, match="impl='cuda' only"):
        gemv(w, torch.randn(1, 256).to(torch.float16), s, "w4a16", impl="triton", config=dict(KERNEL="tc"))


@pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("fmt", ["w8a16", "w4a16"])
def test_interpreted_word_kernel_fallbacks(fmt):
    # A row stride off 4 bytes (a slice of a wider packed matrix) and, for W8A16, a K that is not whole
    # tiles cannot take the word kernel: the call still gives the right answer through another kernel.
    N, K = 9, 256
    w, s, exact = _weights(fmt, N, K, torch.float16)
    wide = torch.zeros(N, w.shape[1] + 1, dtype=w.dtype)
    wide[:, :w.shape[1]] = w
    x = torch.randn(2, K).to(torch.float16)
    cfg = dict(KERNEL="words", BLOCK_N=8, BLOCK_K=128, SPLIT_K=1, num_warps=1, num_stages=1)
    assert wide[:, :w.shape[1]].stride(0) % 4
    assert _relerr(gemv(wide[:, :w.shape[1]], x, s, fmt, impl="triton", config=cfg), x, exact) < TOL[torch.float16]
    if fmt == "w8a16":
        w, s, exact = _weights(fmt, N, 200, torch.float16)
        x = torch.randn(2, 200).to(torch.float16)
        assert _relerr(gemv(w, x, s, fmt, impl="triton", config=cfg), x, exact) < TOL[torch.float16]


def test_cu_kernel_config():
    """KERNEL="cu" (gemv_cu): its defaults, and a bad value named before anything is compiled."""
    from xelink.kernels.gemv_cu import check_cu_config, cu_available, cu_config

    assert not cu_available(torch.device("cpu"))
    assert cu_config(1, 6144, 4096, False) == dict(num_warps=8, UNROLL=2, PIPE=False, STAGES=0)
    assert cu_config(1, 28672, 4096, True) == dict(num_warps=4, UNROLL=4, PIPE=False, STAGES=0)  # 16 tiles a warp
    assert cu_config(1, 4096, 14336, False) == dict(num_warps=16, UNROLL=1, PIPE=False, STAGES=0)
    assert cu_config(1, 65536, 384, False)["UNROLL"] == 1  # 3 tiles over 4 warps
    assert check_cu_config({}, 1, 6144, 4096, False) == cu_config(1, 6144, 4096, False)  # KERNEL="cu" alone
    assert check_cu_config(dict(STAGES=3), 1, 64, 4096, False) == dict(num_warps=16, UNROLL=1, PIPE=False, STAGES=3)
    assert check_cu_config(dict(PIPE=True), 1, 9000, 4096, False) == dict(num_warps=4, UNROLL=4, PIPE=True, STAGES=0)
    for cfg, match in [(dict(num_warps=3), "num_warps=3"), (dict(UNROLL=3), "UNROLL=3"), (dict(PIPE=1), "PIPE=1"),
                       (dict(BLOCK_N=16), "not BLOCK_N"), (dict(STAGES=1), "STAGES=1"),
                       (dict(num_warps=1, act=True), "num_warps=1"),
                       (dict(PIPE=True, STAGES=2), "not both"), (dict(num_warps=16, UNROLL=8, STAGES=2), "200 KB")]:
        act = cfg.pop("act", False)  # (one warp takes no (gate, up) halves)
        with pytest.raises(ValueError, match=rf"gemv: config KERNEL='cu' .*{match}"):
            check_cu_config(cfg, 1, 64, 4096, act)


@pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
def test_interpreted_cu_kernel_needs_cuda():
    w, s, _ = _weights("w4a16", 32, 256, torch.bfloat16)
    with pytest.raises(ValueError, match="gemv: config KERNEL='cu' takes fmt='w4a16t' with impl='cuda'"):
        gemv(tile_w4a16(w), torch.randn(1, 256).to(torch.bfloat16), s, "w4a16t", impl="triton",
             config=dict(KERNEL="cu"))


@pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("fmt, kernel, match", [("fp16", "words", "quantized"), ("w4a16", "fma", "w4a16 runs on"),
                                                ("w8a16", "gemm", "must be")])
def test_interpreted_bad_config(fmt, kernel, match):
    w, s, _ = _weights(fmt, 8, 256, torch.float16)
    cfg = dict(KERNEL=kernel, BLOCK_N=8, BLOCK_K=128, SPLIT_K=1, num_warps=1, num_stages=1)
    with pytest.raises(ValueError, match=match):
        gemv(w, torch.randn(1, 256).to(torch.float16), s, fmt, impl="triton", config=cfg)


# -- GPU ------------------------------------------------------------------------------------------------

def _poison_allocator(nbytes: int):
    # Freed NaN blocks are what the next torch.empty of that size gets: unwritten outputs stay NaN.
    torch.full((nbytes // 4 + 4096,), float("nan"), device="cuda")


def _check_gpu_gemv(w, x, s, fmt, impl, cfg, exact_w, where):
    """One gemv call with the output poisoned first: every element written, within TOL of x @ exact_w^T."""
    M, N = x.shape[0], w.shape[0]
    _poison_allocator(4 * M * N * 4)
    y = gemv(w, x, s, fmt, impl=impl, config=cfg)
    torch.cuda.synchronize()
    assert not y.isnan().any(), f"unwritten output: {where}"
    err = _relerr(y, x, exact_w)
    assert err < TOL[x.dtype], f"rel err {err:.2e}: {where}"


GPU_SHAPES = [(1, 128), (33, 384), (300, 1024), (4100, 256), (64, 4224), (2048, 8192)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "w8a16", "w4a16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_gpu_kernels_match_reference(requires_gpus, fmt, dtype, impl):
    requires_gpus(1)
    if fmt == "bf16" and dtype == torch.float16:
        fmt = "fp16"
    seed = random.SystemRandom().randrange(2**31)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    configs = [None, dict(KERNEL="mma", BLOCK_N=32, BLOCK_K=128, SPLIT_K=3, num_warps=4, num_stages=3),
               dict(KERNEL="mma", BLOCK_N=64, BLOCK_K=256 if fmt != "w4a16" else 128, SPLIT_K=1, num_warps=4,
                    num_stages=1)]
    if fmt == "w4a16":
        configs.append(dict(KERNEL="mma", BLOCK_N=64, BLOCK_K=512, SPLIT_K=2, num_warps=4, num_stages=3, FOLD=True))
    else:
        configs += [dict(KERNEL="fma", BLOCK_N=8, BLOCK_K=512, SPLIT_K=2, num_warps=4, num_stages=1),
                    dict(KERNEL="fma", BLOCK_N=4, BLOCK_K=1024, SPLIT_K=1, num_warps=4, num_stages=3)]
    if fmt in ("w8a16", "w4a16"):  # (a W8A16 K that is not whole tiles falls back to the byte kernel)
        configs += [dict(KERNEL="words", BLOCK_N=16, BLOCK_K=256, SPLIT_K=1, num_warps=1, num_stages=1),
                    dict(KERNEL="words", BLOCK_N=32, BLOCK_K=512, SPLIT_K=3, num_warps=4, num_stages=3)]
    for N, K in GPU_SHAPES:
        w, s, exact = _weights(fmt, N, K, dtype, "cuda", gen)
        for M in (1, 2, 8):
            x = torch.randn(M, K, device="cuda", generator=gen).to(dtype)
            for cfg in configs:
                # FOLD (explicit, or impl="triton"'s default for W4A16 at 5-8 rows under 8192 rows) rounds each weight
                # (nibble - 8) * scale once to the activation dtype: its reference has the same weights.
                fold = cfg.get("FOLD", False) if cfg else impl == "triton" and fmt == "w4a16" and M > 4 and N < 8192
                _check_gpu_gemv(w, x, s, fmt, impl, cfg, exact.to(dtype).double() if fold else exact,
                                f"{impl} {fmt} {dtype} N={N} K={K} M={M} cfg={cfg} seed={seed}")


TC_CONFIGS = [dict(KERNEL="tc"), dict(KERNEL="tc", ROW_TILES=1, num_warps=4, UNROLL=2, SPLIT=1, BIASED=True),
              dict(KERNEL="tc", ROW_TILES=2, num_warps=2, UNROLL=2, SPLIT=2),
              dict(KERNEL="tc", ROW_TILES=4, num_warps=8, UNROLL=1, SPLIT=1, BIASED=True),
              dict(KERNEL="tc", ROW_TILES=1, num_warps=16, UNROLL=1, SPLIT=4),
              dict(KERNEL="tc", ROW_TILES=2, num_warps=1, UNROLL=1, SPLIT=2, PDL="late"),
              # more steps in flight a warp: PIPE (the next weights loaded early), UNROLL 4 / 8 (batches of the mma)
              dict(KERNEL="tc", ROW_TILES=1, num_warps=4, UNROLL=4, PIPE=True, SPLIT=1),
              dict(KERNEL="tc", ROW_TILES=1, num_warps=8, UNROLL=2, PIPE=True, SPLIT=2, BIASED=True),
              # the weights in flight in shared memory (cp.async stages), with K tails, grid splits and late PDL
              dict(KERNEL="tc", ROW_TILES=1, num_warps=4, UNROLL=2, STAGES=4, SPLIT=1),
              dict(KERNEL="tc", ROW_TILES=2, num_warps=2, UNROLL=1, STAGES=3, SPLIT=2, PDL="late"),
              dict(KERNEL="tc", ROW_TILES=1, num_warps=8, UNROLL=1, STAGES=2, SPLIT=4, BIASED=True)]
# UNROLL 8 on W4A16 only: on rows of unaligned length (dense and W8A16 K tails) its element-wise loads make a kernel
# that takes ptxas tens of seconds (658a747: 48 s at ROW_TILES=2, 2 warps)
TC_W4_CONFIGS = [dict(KERNEL="tc", ROW_TILES=2, num_warps=2, UNROLL=8, SPLIT=2),
                 dict(KERNEL="tc", ROW_TILES=1, num_warps=4, UNROLL=8, PIPE=True, SPLIT=1),
                 dict(KERNEL="tc", ROW_TILES=1, num_warps=4, UNROLL=4, STAGES=8, SPLIT=1)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "w8a16", "w4a16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_tensor_core_kernel(requires_gpus, fmt, dtype):
    # KERNEL="tc" (Gluon, operands loaded into the mma fragments): every format, dtype, 1-8 rows, row
    # tails, K tails (dense and W8A16), K spread unevenly over warps and splits, all against float64.
    requires_gpus(1)
    if fmt == "bf16" and dtype == torch.float16:
        fmt = "fp16"
    seed = random.SystemRandom().randrange(2**31)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = GPU_SHAPES + ([] if fmt == "w4a16" else [(77, 200), (130, 4100), (9, 1000)])
    for N, K in shapes:
        w, s, exact = _weights(fmt, N, K, dtype, "cuda", gen)
        for M in (1, 5, 8):
            x = torch.randn(M, K, device="cuda", generator=gen).to(dtype)
            for cfg in TC_CONFIGS + (TC_W4_CONFIGS if fmt == "w4a16" else []):
                _check_gpu_gemv(w, x, s, fmt, "cuda", cfg, exact, f"tc {fmt} {dtype} N={N} K={K} M={M} cfg={cfg} "
                                f"seed={seed}")


# the tiled kernels' shapes: one block, uneven groups over warps (3, 33 tiles a row block), Llama-3.1-8B's QKV / down
TILED_SHAPES = [(16, 128), (48, 384), (304, 1024), (4096, 256), (64, 4224), (6144, 4096), (4096, 14336)]


@pytest.fixture(params=[False, True], ids=["act-two-launches", "act-fused"])
def fused_act(request, monkeypatch):
    """gemv.TC_ACT_FUSED off and on (act="silu_mul" in the tensor-core kernel), the remembered plans forgotten around
    it (they hold the switch as it was when planned)."""
    module = importlib.import_module("xelink.kernels.gemv")
    module._PATHS.clear()
    monkeypatch.setattr(module, "TC_ACT_FUSED", request.param)
    yield request.param
    module._PATHS.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_tiled_w4_tensor_core_kernel(requires_gpus, dtype, monkeypatch, request):
    # "w4a16t" read in place by the tensor-core kernel: the row layout's sums in the same order (bit for bit) at
    # its default tiles (8 warps, K split where K is long; the remembered launch with PDL and the L2 prefetch) and
    # every config but STAGES, 1-8 rows, within TOL of float64; act="silu_mul"; a graph replayed with new inputs.
    requires_gpus(1)
    from xelink.kernels.common import sm_count
    from xelink.kernels.gemv_tc import tc_config
    assert tiled_w4a16_native("cuda")
    module = importlib.import_module("xelink.kernels.gemv")
    module._PATHS.clear()
    request.addfinalizer(module._PATHS.clear)  # (plans made under the switches go with them, pass or fail)
    monkeypatch.setattr(module, "CU_W4", False)  # (the tensor-core kernel's defaults; the CUDA C++ one's test is below)
    seed = random.SystemRandom().randrange(2**31)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    configs = [None] + [c for c in TC_CONFIGS + TC_W4_CONFIGS if "STAGES" not in c]
    for N, K in TILED_SHAPES:
        w, s, exact = _weights("w4a16", N, K, dtype, "cuda", gen)
        t = tile_w4a16(w)
        for M in (1, 4, 5, 8):
            x = torch.randn(M, K, device="cuda", generator=gen).to(dtype)
            for cfg in configs:
                where = f"w4a16t {dtype} N={N} K={K} M={M} cfg={cfg} seed={seed}"
                _check_gpu_gemv(t, x, s, "w4a16t", "cuda", cfg, exact, where)
                # the tiled format's tiles (a partial config completed by its defaults, as gemv does) on the rows
                given = cfg or {}
                rows_cfg = {**tc_config(M, N, K, "w4a16t", sm_count(x.device), given.get("ROW_TILES"),
                                        given.get("num_warps"), given.get("UNROLL")), **given, "KERNEL": "tc"}
                want = gemv(w, x, s, "w4a16", "cuda", config=rows_cfg)
                assert torch.equal(gemv(t, x, s, "w4a16t", "cuda", config=cfg), want), where
    w, s, _ = _weights("w4a16", 2 * 2048, 4096, dtype, "cuda", gen)
    t = tile_w4a16(w)
    x = torch.randn(2, 4096, device="cuda", generator=gen).to(dtype)
    rows_cfg = dict(KERNEL="tc", **tc_config(2, 4096, 4096, "w4a16t", sm_count(x.device)))
    assert torch.equal(gemv(t, x, s, "w4a16t", act="silu_mul"), gemv(w, x, s, "w4a16", act="silu_mul",
                                                                      config=rows_cfg))
    # act in the kernel on the tiles (gemv.TC_ACT_FUSED: (gate, up) halves of whole 16-row blocks, the default tiles
    # TC_ACT_TILES): as the rows' GEMV then silu_mul, bit for bit
    module = importlib.import_module("xelink.kernels.gemv")
    module._PATHS.clear()
    monkeypatch.setattr(module, "TC_ACT_FUSED", True)
    # (the GEMV compared with unsplit, as act runs: tc_config would split K of these tiles at 2 rows, and a split's
    # sums, added in another order, round to other outputs now and then)
    want = silu_mul(gemv(w, x, s, "w4a16", config=dict(KERNEL="tc", **module.TC_ACT_TILES, SPLIT=1)), impl="triton")
    assert torch.equal(gemv(t, x, s, "w4a16t", act="silu_mul"), want)
    for cfg in [dict(KERNEL="tc", ROW_TILES=2, num_warps=8, UNROLL=1), dict(KERNEL="tc", ROW_TILES=4, num_warps=4,
                                                                             UNROLL=2, BIASED=True)]:
        want = silu_mul(gemv(w, x, s, "w4a16", config={**cfg, "SPLIT": 1}), impl="triton")
        assert torch.equal(gemv(t, x, s, "w4a16t", config=cfg, act="silu_mul"), want), cfg
    out = gemv(t, x, s, "w4a16t")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = gemv(t, x, s, "w4a16t")
    x.copy_(torch.randn(2, 4096, device="cuda", generator=gen).to(dtype))
    g.replay()
    assert torch.equal(out, gemv(w, x, s, "w4a16", config=rows_cfg))
    module._PATHS.clear()  # (plans made with the switch on)


CU_CONFIGS = [dict(KERNEL="cu"), dict(KERNEL="cu", num_warps=2, UNROLL=8, PIPE=True),
              dict(KERNEL="cu", num_warps=4, UNROLL=2, PIPE=True), dict(KERNEL="cu", num_warps=16, UNROLL=1),
              dict(KERNEL="cu", num_warps=8, UNROLL=4, PIPE=True), dict(KERNEL="cu", num_warps=8, UNROLL=2, STAGES=3),
              dict(KERNEL="cu", num_warps=4, UNROLL=4, STAGES=2), dict(KERNEL="cu", num_warps=16, UNROLL=1, STAGES=6),
              dict(KERNEL="cu", num_warps=2, UNROLL=8, STAGES=4)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_cu_w4_kernel(requires_gpus, dtype, monkeypatch, request):
    # KERNEL="cu" (gemv_cu, CUDA C++ through NVRTC) on "w4a16t": 1-8 rows, groups spread unevenly over the warps (and
    # warps with none), batches with and without the next in flight, within TOL of float64 with the outputs poisoned
    # first; PDL off / early / late and the row layout's tensor-core kernel agree; act="silu_mul" in the kernel equals
    # silu_mul of its own GEMV; out= a strided view; W and x off 16 bytes; the switch gemv.CU_W4 in a graph replayed
    # with new inputs, after a kernel that writes its x under PDL; a kernel that cannot be built (the switch: a warning
    # and the tensor-core kernel; KERNEL="cu": the error).
    requires_gpus(1)
    module = importlib.import_module("xelink.kernels.gemv")
    gemv_cu = importlib.import_module("xelink.kernels.gemv_cu")
    if not module.cu_available(torch.device("cuda")):
        pytest.skip("needs torch.cuda._compile_kernel")
    request.addfinalizer(module._PATHS.clear)  # (plans made under the switch go with it, pass or fail)
    seed = random.SystemRandom().randrange(2**31)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for N, K in TILED_SHAPES:
        w, s, exact = _weights("w4a16", N, K, dtype, "cuda", gen)
        t = tile_w4a16(w)
        for M in (1, 3, 4, 8):
            x = torch.randn(M, K, device="cuda", generator=gen).to(dtype)
            for cfg in CU_CONFIGS:
                _check_gpu_gemv(t, x, s, "w4a16t", "cuda", cfg, exact, f"cu {dtype} N={N} K={K} M={M} cfg={cfg} "
                                f"seed={seed}")
            y = gemv(t, x, s, "w4a16t", "cuda", config=dict(KERNEL="cu"))
            for pdl in (False, "early", "late"):
                assert torch.equal(gemv(t, x, s, "w4a16t", "cuda", config=dict(KERNEL="cu"), pdl=pdl), y), (N, K, pdl)
            rows = gemv(w, x, s, "w4a16", "cuda", config=dict(KERNEL="tc"))
            assert (y.float() - rows.float()).abs().max() <= 2 * (rows.float().abs().max() * 2 ** -7 + 1e-6), (N, K)
    # act in the kernel: a program's warps split between the gate block and its up block
    w, s, exact = _weights("w4a16", 2 * 2048, 4096, dtype, "cuda", gen)
    t = tile_w4a16(w)
    for M in (1, 2, 8):
        x = torch.randn(M, 4096, device="cuda", generator=gen).to(dtype)
        for cfg in CU_CONFIGS:
            # a half of the act kernel's warps splits K as the plain kernel with that many warps does, and adds in the
            # same order: the same gate and up sums, so silu_mul of that GEMV up to its exp's last bits
            got = gemv(t, x, s, "w4a16t", config=cfg, act="silu_mul")
            warps = cfg.get("num_warps", gemv_cu.cu_config(M, 4096, 4096, True)["num_warps"])
            want = silu_mul(gemv(t, x, s, "w4a16t", config={**cfg, "num_warps": warps // 2}), impl="reference")
            assert got.shape == (M, 2048)
            assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=1e-6), (M, cfg)
    # halves that are not whole tiles: refused by name with the config, the tensor-core kernel's under the switch
    w, s48, _ = _weights("w4a16", 48, 256, dtype, "cuda", gen)
    x = torch.randn(1, 256, device="cuda", generator=gen).to(dtype)
    with pytest.raises(ValueError, match="gemv: config KERNEL='cu' with act='silu_mul' .* got N=48"):
        gemv(tile_w4a16(w), x, s48, "w4a16t", config=dict(KERNEL="cu"), act="silu_mul")
    module._PATHS.clear()
    monkeypatch.setattr(module, "CU_W4", True)
    got = gemv(tile_w4a16(w), x, s48, "w4a16t", act="silu_mul").float()
    want = silu_mul(reference_gemv(w, x, s48, "w4a16"), impl="reference").float()
    assert (got - want).abs().max() <= 2 ** -6 * want.abs().max()
    monkeypatch.setattr(module, "CU_W4", False)
    module._PATHS.clear()
    # out= a column block of a wider buffer (row stride 4100), W and x views off 16 bytes
    x = torch.randn(2, 4096, device="cuda", generator=gen).to(dtype)
    want = gemv(t, x, s, "w4a16t", config=dict(KERNEL="cu"))
    wide = torch.full((2, 4100 + 4096), float("nan"), device="cuda", dtype=dtype)
    gemv(t, x, s, "w4a16t", out=wide[:, 3:3 + 4096], config=dict(KERNEL="cu"))
    assert torch.equal(wide[:, 3:3 + 4096], want) and wide[:, :3].isnan().all() and wide[:, 3 + 4096:].isnan().all()
    xbuf = torch.empty(4096 + 1, device="cuda", dtype=dtype)
    xbuf[1:].copy_(x[0])
    assert torch.equal(gemv(t, xbuf[1:], s, "w4a16t", config=dict(KERNEL="cu")), want[0])
    tbuf = torch.empty(t.numel() + 1, device="cuda", dtype=torch.uint8)
    tbuf[1:].copy_(t.reshape(-1))
    assert torch.equal(gemv(tbuf[1:].view(t.shape), x, s, "w4a16t", config=dict(KERNEL="cu")), want)
    # the default path with the switch on: a graph of rmsnorm (writes x, PDL) -> gemv (reads it), new inputs replayed
    from xelink.kernels.norm import rmsnorm
    module._PATHS.clear()
    monkeypatch.setattr(module, "CU_W4", True)
    h = torch.randn(1, 4096, device="cuda", generator=gen).to(dtype)
    nw = torch.rand(4096, device="cuda", generator=gen).to(dtype) + 0.5
    gemv(t, rmsnorm(h, nw, 1e-5), s, "w4a16t")  # (compiled and planned before the capture)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = gemv(t, rmsnorm(h, nw, 1e-5), s, "w4a16t")
    for _ in range(3):
        h.copy_(torch.randn(1, 4096, device="cuda", generator=gen).to(dtype))
        g.replay()
        want = gemv(t, rmsnorm(h, nw, 1e-5, pdl=False), s, "w4a16t", config=dict(KERNEL="cu"), pdl=False)
        assert torch.equal(out, want)
    module._PATHS.clear()
    # a kernel NVRTC or the driver cannot build (e.g. PTX newer than the driver): the switch's path warns and runs
    # the tensor-core kernel; the config that asks for the cu kernel by name raises
    monkeypatch.setattr(module, "CU_W4", False)
    want = gemv(t, x, s, "w4a16t")  # (the tensor-core kernel's default)
    module._PATHS.clear()
    monkeypatch.setattr(module, "CU_W4", True)

    def broken(*args):
        raise RuntimeError("CUDA error: CUDA_ERROR_UNSUPPORTED_PTX_VERSION (test)")

    monkeypatch.setattr(gemv_cu, "_kernel", broken)
    with pytest.warns(RuntimeWarning, match="gemv: the CUDA C\\+\\+ W4A16 kernel .*UNSUPPORTED_PTX_VERSION"):
        assert torch.equal(gemv(t, x, s, "w4a16t"), want)
    with pytest.raises(RuntimeError, match="UNSUPPORTED_PTX_VERSION"):
        gemv(t, x, s, "w4a16t", config=dict(KERNEL="cu"))
    module._PATHS.clear()


def test_tensor_core_stages_only_on_aligned_rows():
    """cp.async copies 4-16 byte pieces Triton must prove aligned: STAGES is taken where K, W's row stride and
    base allow it, and turned off elsewhere (the kernel would not compile: "cp.async does not support transfers
    smaller than 4 bytes", seen on the H200 for K=200)."""
    from xelink.kernels import gemv_tc

    if not gemv_tc.TC_AVAILABLE:
        pytest.skip("needs Triton's Gluon")
    for n, k, offset, want in ((64, 4096, 0, 4), (64, 4096, 8, 4), (64, 4096, 4, 0), (64, 200, 0, 0),
                               (64, 4100, 0, 0)):
        w = torch.empty(n * k + 16, dtype=torch.bfloat16)[offset:offset + n * k].view(n, k)
        args = gemv_tc.tc_launch_args(w, torch.empty(1, k, dtype=torch.bfloat16), None, 0, dict(STAGES=4), n)
        assert args[3]["STAGES"] == want, (n, k, offset)


@pytest.mark.gpu
def test_gpu_tensor_core_kernel_bad_config(requires_gpus):
    requires_gpus(1)
    w = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="ROW_TILES=3"):
        gemv(w, x, config=dict(KERNEL="tc", ROW_TILES=3), impl="cuda")
    with pytest.raises(ValueError, match="UNROLL=3"):
        gemv(w, x, config=dict(KERNEL="tc", UNROLL=3), impl="cuda")
    with pytest.raises(ValueError, match="PIPE=2"):
        gemv(w, x, config=dict(KERNEL="tc", PIPE=2), impl="cuda")
    with pytest.raises(ValueError, match="STAGES=1 must be 0"):
        gemv(w, x, config=dict(KERNEL="tc", STAGES=1), impl="cuda")
    with pytest.raises(ValueError, match="PIPE or STAGES, not both"):
        gemv(w, x, config=dict(KERNEL="tc", PIPE=True, STAGES=3), impl="cuda")
    with pytest.raises(ValueError, match="STAGES=8 needs 262144 bytes"):  # 8 x 8 warps x 16 rows x 256 bytes
        gemv(w, x, config=dict(KERNEL="tc", num_warps=8, STAGES=8), impl="cuda")
    with pytest.raises(ValueError, match="unknown KERNEL='tc' config keys"):
        gemv(w, x, config=dict(KERNEL="tc", BLOCK_N=16), impl="cuda")
    with pytest.raises(ValueError, match="impl='cuda' only"):
        gemv(w, x, config=dict(KERNEL="tc"), impl="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "cuda"])
@pytest.mark.parametrize("fmt", ["bf16", "w8a16", "w4a16"])
def test_gpu_out_blocks(requires_gpus, impl, fmt):
    # out= a row block or a column block of a poisoned buffer, through the default kernel choice, a split-K
    # tile (the sum kernel stores the rows) and, on the CUDA path, the tensor-core kernel with a grid split.
    requires_gpus(1)
    gen = torch.Generator(device="cuda").manual_seed(random.SystemRandom().randrange(2**31))
    N, K = 300, 1024
    w, s, exact = _weights(fmt, N, K, torch.bfloat16, "cuda", gen)
    configs = [None, dict(KERNEL="mma", BLOCK_N=32, BLOCK_K=128, SPLIT_K=3, num_warps=4, num_stages=3)]
    if impl == "cuda" and fmt != "bf16":
        configs.append(dict(KERNEL="tc", ROW_TILES=1, num_warps=2, SPLIT=2))
    for M in (1, 5, 8):
        x = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
        for cfg in configs:
            for where in ("rows", "cols"):
                big = poisoned(M + 8, 520, device="cuda")
                block = big[5:5 + M, :N] if where == "rows" else big[3:3 + M, 7:7 + N]
                assert gemv(w, x, s, fmt, impl, config=cfg, out=block) is block
                torch.cuda.synchronize()
                only_block_written(big, block)
                fold = cfg is None and impl == "triton" and fmt == "w4a16" and M > 4  # rounds each weight once
                ref = exact.to(torch.bfloat16).double() if fold else exact
                assert _relerr(block, x, ref) < TOL[torch.bfloat16], f"{impl} {fmt} M={M} cfg={cfg} {where}"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "w8a16", "w4a16"])
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_gpu_act_silu_mul(requires_gpus, fmt, impl, fused_act):
    # act="silu_mul" (the decode MLP's gate/up projection) equals the plain GEMV then silu_mul bit for bit,
    # with the default tiles (one launch on every kernel; the tensor-core kernel's GEMV then silu_mul, or with
    # gemv.TC_ACT_FUSED one launch that pairs (gate, up) rows in a program, tc_fuses_act), explicit tiles of every
    # kernel, output tails, 1-8 rows, 1-D x, out= a column block, and captured in a CUDA graph replayed with new
    # activations.
    requires_gpus(1)
    gen = torch.Generator(device="cuda").manual_seed(7)
    configs = [None, dict(KERNEL="mma", BLOCK_N=32, BLOCK_K=256 if fmt != "w4a16" else 128, SPLIT_K=2, num_warps=4,
                          num_stages=3)]
    configs += [dict(KERNEL="fma", BLOCK_N=2, BLOCK_K=1024, SPLIT_K=1, num_warps=4, num_stages=3)] if fmt != "w4a16" \
        else [dict(KERNEL="words", BLOCK_N=8, BLOCK_K=512, SPLIT_K=1, num_warps=1, num_stages=1)]
    if impl == "cuda" and fmt != "bf16":
        # (SPLIT=1: act takes no grid split, so its sums are those of the unsplit GEMV; tc_config would split the
        # plain GEMV at 4 row tiles of 2 warps)
        configs += [dict(KERNEL="tc"), dict(KERNEL="tc", ROW_TILES=2, num_warps=4, UNROLL=2),
                    dict(KERNEL="tc", ROW_TILES=4, num_warps=2, UNROLL=1, SPLIT=1)]
    for F, K in [(14336, 4096), (4096, 1024), (33, 256), (1, 128)]:
        w, s, _ = _weights(fmt, 2 * F, K, torch.bfloat16, "cuda", gen)
        for M in (1, 3, 8):
            x = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
            for cfg in configs:
                got = gemv(w, x, s, fmt, impl, config=cfg, act="silu_mul")
                want = _act_unfused_gpu(w, x, s, fmt, impl, cfg)
                assert torch.equal(got, want), f"{impl} {fmt} F={F} K={K} M={M} cfg={cfg}"
            assert torch.equal(gemv(w, x[0], s, fmt, impl, act="silu_mul"),
                               _act_unfused_gpu(w, x[:1], s, fmt, impl)[0])
            big = poisoned(M + 4, F + 9, device="cuda")
            block = big[2:2 + M, 5:5 + F]
            assert gemv(w, x, s, fmt, impl, out=block, act="silu_mul") is block
            torch.cuda.synchronize()
            only_block_written(big, block)
            assert torch.equal(block, _act_unfused_gpu(w, x, s, fmt, impl))
    x = torch.randn(2, K, device="cuda", generator=gen).to(torch.bfloat16)
    y = gemv(w, x, s, fmt, impl, act="silu_mul")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemv(w, x, s, fmt, impl, act="silu_mul")
    for _ in range(3):
        x.copy_(torch.randn(2, K, device="cuda", generator=gen))
        graph.replay()
        assert torch.equal(y, _act_unfused_gpu(w, x, s, fmt, impl))


def _act_unfused_gpu(w, x, s, fmt, impl, cfg=None):
    """act="silu_mul"'s twin on the GPU: the plain GEMV with the tiles act runs (``cfg``, else the default
    ones) unsplit, as act runs them (a K split sums in another order), then silu_mul."""
    if cfg is None:
        from xelink.kernels.common import sm_count

        gemv_mod = importlib.import_module("xelink.kernels.gemv")  # (the package's gemv is the function)
        cfg = gemv_mod._gemv_config(x.shape[0], w.shape[0], x.shape[1], fmt, sm_count(x.device), impl == "cuda")
    if cfg["KERNEL"] != "tc":  # (the tensor-core kernel runs act as its own GEMV, split or not, then silu_mul)
        cfg = dict(cfg, SPLIT_K=1)
    return silu_mul(gemv(w, x, s, fmt, impl, config=cfg), impl="triton")


@pytest.mark.gpu
def test_gpu_graph_capture_and_compile(requires_gpus):
    requires_gpus(1)
    w, s, exact = _weights("w4a16", 512, 1024, torch.bfloat16, "cuda")
    for rows in (4, 8):  # the word kernel and the tensor-core kernel (gemv_tc)
        x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
        y = gemv(w, x, s, "w4a16")  # auto
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = gemv(w, x, s, "w4a16")
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert _relerr(y, x, exact) < TOL[torch.bfloat16]
    compiled = torch.compile(lambda a: gemv(w, a, s, "w4a16") + 1, fullgraph=True, backend="aot_eager")
    assert _relerr(compiled(x) - 1, x, exact) < 2 * TOL[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_split_k_in_one_launch(requires_gpus):
    # The K split is finished by the last split of each tile (split.py), with counters and partials kept per
    # stream: back-to-back calls that change shape, split and kernel on one stream; the same calls on two
    # streams at once; a CUDA graph replayed between eager calls on its stream; repeated calls give the same
    # bits (the partials are added in split order, whichever split finishes last).
    requires_gpus(1)
    cases = [("bf16", 8, 4096, 4096, dict(KERNEL="mma", BLOCK_N=32, BLOCK_K=256, SPLIT_K=4, num_warps=4,
                                           num_stages=3)),
             ("w8a16", 1, 4096, 14336, dict(KERNEL="fma", BLOCK_N=4, BLOCK_K=1024, SPLIT_K=7, num_warps=4,
                                            num_stages=3)),
             ("w4a16", 1, 512, 14336, dict(KERNEL="words", BLOCK_N=8, BLOCK_K=512, SPLIT_K=8, num_warps=1,
                                           num_stages=1)),
             ("w4a16", 8, 1000, 4096, None), ("bf16", 3, 77, 8192, None)]
    made = []
    for fmt, m, n, k, cfg in cases:
        w, s, exact = _weights(fmt, n, k, torch.bfloat16, "cuda")
        made.append((fmt, w, s, exact, torch.randn(m, k, device="cuda", dtype=torch.bfloat16), cfg))

    def run_all():
        return [gemv(w, x, s, fmt, "triton", config=cfg) for fmt, w, s, _, x, cfg in made]

    first = run_all()
    for (fmt, _, _, exact, x, _), y in zip(made, first):
        assert _relerr(y, x, exact) < TOL[torch.bfloat16], fmt
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(run_all(), first))
    assert all(torch.equal(a, b) for ys in on_two_streams(run_all) for a, b in zip(ys, first))
    fmt, w, s, exact, x, cfg = made[1]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = gemv(w, x, s, fmt, "triton", config=cfg)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        eager = run_all()
        torch.cuda.synchronize()
        assert torch.equal(yg, eager[1]) and _relerr(yg, x, exact) < TOL[torch.bfloat16]


PDL_CONFIGS = {"bf16": [None, dict(KERNEL="fma", BLOCK_N=4, BLOCK_K=512, SPLIT_K=2, num_warps=4, num_stages=1),
                        dict(KERNEL="mma", BLOCK_N=32, BLOCK_K=128, SPLIT_K=3, num_warps=4, num_stages=3)],
               "w8a16": [None, dict(KERNEL="words", BLOCK_N=16, BLOCK_K=256, SPLIT_K=2, num_warps=1, num_stages=1),
                         dict(KERNEL="tc", ROW_TILES=1, num_warps=2, SPLIT=2)],
               "w4a16": [None, dict(KERNEL="words", BLOCK_N=8, BLOCK_K=512, SPLIT_K=1, num_warps=1, num_stages=1),
                         dict(KERNEL="mma", BLOCK_N=64, BLOCK_K=512, SPLIT_K=2, num_warps=4, num_stages=3, FOLD=True),
                         dict(KERNEL="tc", ROW_TILES=4, num_warps=4, SPLIT=2, BIASED=True)]}


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "w8a16", "w4a16"])
def test_gpu_pdl_chain(requires_gpus, fmt):
    # Programmatic dependent launch lets a gemv start while the one before it runs: each of these
    # gemvs reads the previous one's output, so one that read x before its griddepcontrol.wait (or a
    # split-K sum that read the partial sums early) would see stale or poisoned values. The chain with
    # PDL (the sm90 default; either place of the go for the next kernel), eager and in a CUDA graph, must
    # match the same kernels without it (a stale or poisoned input is off by O(1) or NaN), which stay
    # near the float64 chain.
    requires_gpus(1)
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0")
    seed = random.SystemRandom().randrange(2**31)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n = 512  # square: an output is the next input; |w| = 0.05 keeps the chain's scale near 1
    layers = [_weights(fmt, n, n, torch.bfloat16, "cuda", gen) for _ in range(6)]
    x = torch.randn(8, n, device="cuda", generator=gen).to(torch.bfloat16)

    def _close(y, plain):
        return not y.isnan().any() and float((y.float() - plain.float()).norm() / plain.float().norm()) < 1e-3

    def chain(cfg, launch):
        y = x
        for w, s, _ in layers:
            y = gemv(w, y, s, fmt, "cuda", config=cfg, pdl=launch)
        return y

    for cfg in PDL_CONFIGS[fmt]:
        where = f"{fmt} cfg={cfg} seed={seed}"
        plain = chain(cfg, False)
        want = x.double()
        for _, _, exact in layers:
            want = want @ exact.T
        assert float((plain.double() - want).norm() / want.norm()) < 0.05, where
        for launch in (True, "early", "late"):
            _poison_allocator(1 << 22)
            assert _close(chain(cfg, launch), plain), f"eager {launch} {where}"
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                ys = [chain(cfg, launch) for _ in range(3)]
            graph.replay()
            torch.cuda.synchronize()
            for y in ys:
                assert _close(y, plain), f"graph {launch} {where}"


def test_split_scratch_keeps_a_bounded_number_of_streams():
    # One pair of buffers per (device, stream), the oldest forgotten past Scratch.STREAMS (a job that makes a
    # stream a step must not pile them up); a key used again is the newest.
    from xelink.kernels.split import Scratch

    sc = Scratch()
    sc.STREAMS = 3
    for k in range(5):
        sc._keep(k, (torch.zeros(1), torch.zeros(1)))
    assert list(sc._held) == [2, 3, 4]
    sc._keep(2, (torch.zeros(1), torch.zeros(1)))
    sc._keep(5, (torch.zeros(1), torch.zeros(1)))
    assert list(sc._held) == [4, 2, 5]
    counters, partials = sc.get(torch.device("cpu"), 10, 100)
    assert counters.numel() >= 10 and partials.numel() >= 100 and not counters.any()
    assert sc.get(torch.device("cpu"), 5, 50)[0] is counters  # reused while large enough

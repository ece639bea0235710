"""The decode layer's kernel chain (xelink.models.decode_layer) on CPU: the reference paths against the twin,
the twin against an independent float64 computation, and its argument errors."""
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from xelink.kernels import unpack_w4a16
from xelink.models import (DecodeLayerConfig, DecodeLayerWeights, decode_layer, decode_layers, reference_decode_layer,
                           reference_decode_layers)

TINY = DecodeLayerConfig(hidden=256, heads=4, kv_heads=2, ffn=384, context=64)


def _inputs(cfg, batch=1, layers=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    stack = [DecodeLayerWeights.random(cfg, batch=batch, generator=gen) for _ in range(layers)]
    x = torch.randn(batch, cfg.hidden, generator=gen).to(torch.bfloat16)
    angle = torch.rand(1, cfg.head_dim // 2, generator=gen) * 6.28
    cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()
    lens = torch.tensor([cfg.context - 7 * b for b in range(batch)])
    return stack, x, cos, sin, lens


def test_xelink_models_imports_on_a_cpu_machine_without_the_suite():
    code = ("import sys, xelink.models as m; assert m.LLAMA3_8B.qkv_width == 6144; "
            "assert not [n for n in sys.modules if n.startswith('xelink.bench')], 'xelink.bench imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("batch", [1, 3])
def test_reference_paths_equal_the_twin(batch):
    stack, x, cos, sin, lens = _inputs(TINY, batch=batch)
    y, h = decode_layers(x, stack, cos, sin, lens, impl="reference", pdl=False, gemv_pdl=False)
    ry, rh = reference_decode_layers(x, stack, cos, sin, lens)
    assert y.shape == h.shape == (batch, TINY.hidden) and y.dtype == h.dtype == torch.bfloat16
    assert torch.isfinite(y.float()).all() and torch.equal(y, ry) and torch.equal(h, rh)
    one, _ = decode_layer(x, torch.zeros_like(x), stack[0], cos, sin, lens, impl="auto")  # CPU: the reference
    assert torch.equal(one, reference_decode_layer(x, torch.zeros_like(x), stack[0], cos, sin, lens)[0])


def _float64_layer(x, h, lw, cos, sin, lens):
    """The chain written out in float64 on the dequantized weights (no rounding between ops)."""
    cfg = lw.config
    B, D = x.shape[0], cfg.head_dim

    def norm(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + cfg.eps) * w.double()

    def mm(w, t):
        return t @ unpack_w4a16(*w).double().T

    def rot(t):
        t1, t2 = t.chunk(2, dim=-1)
        return t * cos.double() + torch.cat((-t2, t1), -1) * sin.double()

    h = x.double() + h.double()
    qkv = mm(lw.qkv, norm(h, lw.norm1)).view(B, -1, 1, D)
    q, k = rot(qkv[:, :cfg.heads]), rot(qkv[:, cfg.heads:cfg.heads + cfg.kv_heads])
    outs = []
    for b in range(B):
        n = int(lens[b])
        kc, vc = lw.k_cache[b:b + 1, :, :n].double(), lw.v_cache[b:b + 1, :, :n].double()
        outs.append(F.scaled_dot_product_attention(q[b:b + 1], kc, vc, enable_gqa=True))
    del k  # the chain computes RoPE of k; the cache is not updated
    o = mm(lw.o, torch.cat(outs).reshape(B, cfg.hidden))
    h = o + h
    gu = mm(lw.gate_up, norm(h, lw.norm2))
    return mm(lw.down, gu[:, :cfg.ffn]), h


def test_the_twin_matches_an_independent_float64_chain():
    stack, x, cos, sin, lens = _inputs(TINY, batch=2, layers=1, seed=3)
    zero = torch.zeros_like(x)
    y, h = reference_decode_layer(x, zero, stack[0], cos, sin, lens)
    wy, wh = _float64_layer(x, zero, stack[0], cos, sin, lens)
    for got, want in ((y, wy), (h, wh)):
        rel = (got.double() - want).norm() / want.norm()
        assert rel < 2e-2, rel  # bf16 rounding after each op


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"DecodeLayerConfig: hidden=200 must be a multiple of heads=3"):
        DecodeLayerConfig(hidden=200, heads=3, kv_heads=1, ffn=256, context=8)
    with pytest.raises(ValueError, match=r"DecodeLayerConfig: ffn=100 must be a multiple of 128"):
        DecodeLayerConfig(hidden=256, heads=4, kv_heads=2, ffn=100, context=8)
    with pytest.raises(ValueError, match=r"DecodeLayerWeights.random: batch=9 must be an int in 1..8"):
        DecodeLayerWeights.random(TINY, batch=9)
    stack, x, cos, sin, lens = _inputs(TINY)
    with pytest.raises(ValueError, match=r"decode_layer: x.shape=\(1, 128\) must be \[B, hidden=256\]"):
        decode_layer(x[:, :128], x[:, :128], stack[0], cos, sin, lens)
    with pytest.raises(ValueError, match=r"decode_layer: impl='cuda' must be one of"):
        decode_layer(x, x, stack[0], cos, sin, lens, impl="cuda")
    with pytest.raises(ValueError, match=r"reference_decode_layer: kv_lens.shape=\(2,\) must be \(1,\)"):
        reference_decode_layer(x, x, stack[0], cos, sin, torch.tensor([3, 4]))
    with pytest.raises(ValueError, match=r"decode_layers: layers must be a non-empty list"):
        decode_layers(x, [], cos, sin, lens)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, None])
def test_gpu_kernels_match_the_twin(requires_gpus, pdl):
    # The chain through the GPU kernels (Triton RMSNorm/RoPE/decode attention, the CUDA GEMV), eager, with
    # programmatic dependent launch off and at its default, against the pure-torch twin on the same GPU.
    requires_gpus(1)
    cfg = DecodeLayerConfig(hidden=512, heads=4, kv_heads=2, ffn=1024, context=300)
    gen = torch.Generator(device="cuda").manual_seed(11)
    stack = [DecodeLayerWeights.random(cfg, device="cuda", generator=gen) for _ in range(2)]
    x = torch.randn(1, cfg.hidden, device="cuda", generator=gen).to(torch.bfloat16)
    angle = torch.rand(1, cfg.head_dim // 2, device="cuda", generator=gen) * 6.28
    cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()
    lens = torch.tensor([cfg.context - 5], device="cuda")
    gemv_pdl = None if pdl is None else False
    y, h = decode_layers(x, stack, cos, sin, lens, pdl=pdl, gemv_pdl=gemv_pdl)
    ry, rh = reference_decode_layers(x, stack, cos, sin, lens)
    for got, want in ((y, ry), (h, rh)):
        rel = (got.float() - want.float()).norm() / want.float().norm()
        assert rel < 2e-2, rel

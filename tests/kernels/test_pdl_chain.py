"""Programmatic dependent launch across the kernel modules (GPU, sm90+): a decode-like chain of RMSNorm,
GEMV, RoPE and decode attention, each reading the one before's output."""
import random

import pytest
import torch

from xelink.kernels.attention import decode_attention
from xelink.kernels.gemv import gemv, pack_w4a16
from xelink.kernels.norm import rmsnorm, rope


def _poison(nbytes: int):
    # The next torch.empty of this size reuses the freed NaN block: an unwritten output stays NaN.
    torch.full((nbytes // 4 + 4096,), float("nan"), device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("rows,H", [(1, 4096), (8, 4096), (8192, 512), (3, 32768)])
def test_gpu_pdl_decode_chain(requires_gpus, rows, H):
    # Each kernel of this chain (fused residual RMSNorm -> W4A16 GEMV -> RoPE of its output -> decode
    # attention over a cache -> the next layer) reads the one before's output, so a kernel that touched
    # memory before its griddepcontrol.wait would read stale or poisoned (NaN) values. With PDL in
    # every placement of the go (default, early, late), eager and in a CUDA graph, the chain must equal
    # the same kernels without PDL bit for bit. Rows and widths cover the early default (a grid that
    # fits the GPU), the late one (8192 rows: a second RMSNorm of a strided view stands in for the
    # GEMV, which takes at most 8 rows, and attention is left out) and the two-pass RMSNorm.
    requires_gpus(1)
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0")
    gen = torch.Generator(device="cuda").manual_seed(random.SystemRandom().randrange(2**31))
    n = 512  # GEMV output width: 4 heads of 128 (3 of q, 1 of k)
    layers = [(torch.randn(H, device="cuda", generator=gen).to(torch.bfloat16),
               pack_w4a16(torch.randn(n, H, device="cuda", generator=gen) * 0.05)) for _ in range(3)]
    x = torch.randn(rows, H, device="cuda", generator=gen).to(torch.bfloat16)
    res0 = torch.randn(rows, H, device="cuda", generator=gen).to(torch.bfloat16)
    pos = torch.arange(rows, device="cuda").float()[:, None] / (10000 ** (torch.arange(64, device="cuda") / 64))
    cos, sin = torch.cat((pos, pos), -1).cos(), torch.cat((pos, pos), -1).sin()
    cache = torch.randn(2, 1, 1, 300, 128, device="cuda", generator=gen).to(torch.bfloat16)
    lens = torch.tensor([300], device="cuda")

    def chain(pdl):
        h, y, outs = res0, x, []
        for w_norm, (q, s) in layers:
            normed, h = rmsnorm(y, w_norm, 1e-6, residual=h, pdl=pdl)
            if rows <= 8:
                g = gemv(q, normed, s, "w4a16", "cuda", pdl=pdl is not False)
            else:
                g = rmsnorm(normed[:, :n], w_norm[:n], 1e-6, pdl=pdl)
            g = g.view(1, rows, 4, 128)
            qo, ko = rope(g[:, :, :3].transpose(1, 2), g[:, :, 3:].transpose(1, 2), cos, sin, pdl=pdl)
            if rows <= 8:
                qo = decode_attention(qo, cache[0], cache[1], lens, num_splits=4, pdl=pdl)
            outs += [h, qo, ko]
            y = torch.cat((qo, ko), 1).transpose(1, 2).reshape(rows, n).repeat(1, H // n)  # the next input
        return outs

    plain = chain(False)
    assert all(not t.isnan().any() for t in plain)
    for pdl in (None, True, "early", "late"):
        _poison(1 << 24)
        for got, want in zip(chain(pdl), plain):
            assert torch.equal(got, want), f"eager pdl={pdl} rows={rows} H={H}"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            runs = [chain(pdl) for _ in range(2)]
        graph.replay()
        torch.cuda.synchronize()
        for outs in runs:
            for got, want in zip(outs, plain):
                assert torch.equal(got, want), f"graph pdl={pdl} rows={rows} H={H}"


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_gpu_pdl_flash_and_merge_chain(requires_gpus, impl):
    # Two flash attentions over the halves of the keys, merged, feeding the next layer's queries: with
    # PDL in every placement of the go, eager and in a CUDA graph, equal to the chain without PDL.
    requires_gpus(1)
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0")
    from xelink.kernels.attention import flash_attention, merge_attention

    gen = torch.Generator(device="cuda").manual_seed(random.SystemRandom().randrange(2**31))
    q = torch.randn(2, 4, 256, 128, device="cuda", generator=gen).to(torch.bfloat16)
    halves = [torch.randn(2, 2, 2, 256, 128, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2)]

    def chain(pdl):
        x, outs = q, []
        for _ in range(3):
            parts = [flash_attention(x, kv[0], kv[1], return_lse=True, impl=impl, pdl=pdl) for kv in halves]
            x, _ = merge_attention([p[0] for p in parts], [p[1] for p in parts], pdl=pdl)
            outs.append(x)
        return outs

    plain = chain(False)
    for pdl in (True, "early", "late"):
        _poison(1 << 24)
        for got, want in zip(chain(pdl), plain):
            assert torch.equal(got, want), f"eager pdl={pdl} impl={impl}"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            runs = chain(pdl)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(runs, plain):
            assert torch.equal(got, want), f"graph pdl={pdl} impl={impl}"

"""The L2 prefetch before the PDL wait (xelink.kernels.pdl.prefetch_l2): where it is on, and that it never
changes a result, even where the kernel before writes the very bytes prefetched (a GEMV's weights, decode
attention's cache, kv_lens)."""
import importlib

import pytest
import torch

from xelink.kernels import decode_attention, gemv, reference_decode_attention, rope_decode_attention
from xelink.kernels.gemv import pack_w4a16, pack_w8a16

pdl = importlib.import_module("xelink.kernels.pdl")
gemv_mod = importlib.import_module("xelink.kernels.gemv")
attn_mod = importlib.import_module("xelink.kernels.attention")


def test_prefetch_is_on_only_under_pdl_on_sm90(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("XELINK_PREFETCH", raising=False)
    monkeypatch.delenv("XELINK_PREFETCH_MB", raising=False)
    assert pdl.prefetch_bytes(1, cpu) == pdl.prefetch_bytes(2, cpu) == 0  # no CUDA capability
    monkeypatch.setattr(pdl, "capability", lambda dev: (9, 0))
    assert pdl.prefetch_bytes(1, cpu) == pdl.prefetch_bytes(2, cpu) == pdl.DEFAULT_PREFETCH_MB << 20
    assert pdl.prefetch_bytes(1, cpu, gemv=True) == pdl.GEMV_PREFETCH_MB << 20 == 2 << 20  # the GEMVs' own
    args = pdl.prefetch_args(1, cpu, 16, 1 << 16, gemv=True)
    assert args["PREFETCH"] == (2 << 20) // (16 << 16) and args["LIMIT"] == 1 << 16
    assert pdl.prefetch_bytes(0, cpu) == 0  # no PDL: no early placement to use
    monkeypatch.setattr(pdl, "capability", lambda dev: (8, 0))
    assert pdl.prefetch_bytes(1, cpu) == 0  # the bulk prefetch is sm90's
    monkeypatch.setattr(pdl, "capability", lambda dev: (9, 0))
    monkeypatch.setenv("XELINK_PREFETCH_MB", "4")  # every kernel's, the GEMVs' too
    assert pdl.prefetch_bytes(1, cpu) == pdl.prefetch_bytes(1, cpu, gemv=True) == 4 << 20
    for bad in ("-1", "lots"):
        monkeypatch.setenv("XELINK_PREFETCH_MB", bad)
        with pytest.raises(ValueError, match="XELINK_PREFETCH_MB"):
            pdl.prefetch_bytes(1, cpu)
    monkeypatch.setenv("XELINK_PREFETCH", "0")
    assert pdl.prefetch_bytes(1, cpu) == 0
    monkeypatch.setattr(pdl, "PREFETCH", True)  # a benchmark's switch wins
    monkeypatch.setattr(pdl, "PREFETCH_BYTES", 3 << 20)
    assert pdl.prefetch_bytes(1, cpu) == 3 << 20


@pytest.fixture
def prefetch_switch(monkeypatch):
    """``use(on)``: the prefetch on or off for the launches planned from then on."""
    def use(on: bool):
        monkeypatch.setattr(pdl, "PREFETCH", on)
        gemv_mod._PATHS.clear()
        attn_mod._PATHS.clear()
    yield use
    gemv_mod._PATHS.clear()
    attn_mod._PATHS.clear()


def _sm90(requires_gpus):
    requires_gpus(1)
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the prefetch runs under programmatic dependent launch, compute capability >= 9.0")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,cfg", [
    ("bf16", None),  # the fma kernel: no prefetch (gemv.py), the chain under PDL all the same
    ("w4a16", dict(KERNEL="words", BLOCK_N=8, BLOCK_K=512, SPLIT_K=2, num_warps=1, num_stages=1)),
    ("w8a16", dict(KERNEL="words", BLOCK_N=16, BLOCK_K=256, SPLIT_K=2, num_warps=1, num_stages=1)),
    ("w4a16", dict(KERNEL="tc", ROW_TILES=2, num_warps=4, SPLIT=2)),
    ("w8a16", dict(KERNEL="tc", ROW_TILES=1, num_warps=4, SPLIT=1)),
])
def test_gpu_gemv_weights_written_by_the_kernel_before(requires_gpus, prefetch_switch, fmt, cfg):
    # The first gemv writes the second one's weights (its output, viewed as [n, k]); the second, launched
    # under PDL, prefetches those rows before its wait, while the first may still write them. Over the
    # buffer NaN first: a prefetched stale line that were used would show. The result equals the same
    # chain without the prefetch and without PDL, bit for bit, eager and replayed in a CUDA graph.
    _sm90(requires_gpus)
    gen = torch.Generator(device="cuda").manual_seed(11)
    n, k, k1 = 256, 1024, 512
    dt = torch.bfloat16
    # quantized: the first gemv writes the packed bytes as bf16 pairs (any bits are weights), scales stay put
    wbytes = {"bf16": n * k * 2, "w8a16": n * k, "w4a16": n * k // 2}[fmt]
    w1 = (torch.randn(wbytes // 2, k1, device="cuda", generator=gen) * 0.05).to(dt)
    x1 = torch.randn(1, k1, device="cuda", generator=gen).to(dt)
    x2 = torch.randn(4, k, device="cuda", generator=gen).to(dt)
    pack = {"w8a16": pack_w8a16, "w4a16": pack_w4a16}.get(fmt)
    scales = pack(torch.randn(n, k, device="cuda", generator=gen), dt)[1] if pack else None
    buf = torch.empty(1, wbytes // 2, device="cuda", dtype=dt)
    w2 = {"bf16": lambda: buf.view(n, k), "w8a16": lambda: buf.view(torch.int8).view(n, k),
          "w4a16": lambda: buf.view(torch.uint8).view(n, k // 2)}[fmt]()

    def chain(pdl_on):
        buf.fill_(float("nan"))
        gemv(w1, x1, None, "bf16", "cuda", out=buf, pdl=pdl_on)
        return gemv(w2, x2, scales, fmt, "cuda", config=cfg, pdl=pdl_on)

    prefetch_switch(False)
    plain = chain(False).clone()
    assert not plain.isnan().any()
    prefetch_switch(False)
    off = chain(True).clone()
    prefetch_switch(True)
    for _ in range(3):
        assert torch.equal(chain(True).view(torch.int16), plain.view(torch.int16)), (fmt, cfg)
    assert torch.equal(off.view(torch.int16), plain.view(torch.int16))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = chain(True)
    for _ in range(3):
        x1.copy_(torch.randn(1, k1, device="cuda", generator=gen).to(dt))
        graph.replay()
        prefetch_switch(False)
        want = chain(False)
        torch.cuda.synchronize()
        assert torch.equal(y.view(torch.int16), want.view(torch.int16)), (fmt, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_len", [1, 300, 4096, 8192])
def test_gpu_decode_cache_and_lengths_written_by_the_kernel_before(requires_gpus, prefetch_switch, kv_len):
    # The gemv before decode attention writes its whole K cache (its output viewed as the cache) and kv_lens
    # changes between calls (written by a torch op two launches before): the split kernel prefetches its
    # rows before its wait with a kv_len it may read stale. Bit for bit the result without the prefetch,
    # near the reference, eager and in a CUDA graph replayed over new lengths.
    _sm90(requires_gpus)
    gen = torch.Generator(device="cuda").manual_seed(12)
    B, HQ, HKV, S, D, k1 = 1, 32, 8, 8192, 128, 32
    dt = torch.bfloat16
    w = (torch.randn(B * HKV * S * D, k1, device="cuda", generator=gen) * 0.1).to(dt)
    x = torch.randn(1, k1, device="cuda", generator=gen).to(dt)
    kbuf = torch.empty(1, B * HKV * S * D, device="cuda", dtype=dt)
    k_cache = kbuf.view(B, HKV, S, D)
    v_cache = torch.randn(B, HKV, S, D, device="cuda", generator=gen).to(dt)
    q = torch.randn(B, HQ, 1, D, device="cuda", generator=gen).to(dt)
    lens = torch.full((B,), kv_len, dtype=torch.int32, device="cuda")

    def step(pdl_on, n):
        kbuf.fill_(float("nan"))
        lens.fill_(n)
        gemv(w, x, None, "bf16", "cuda", out=kbuf, pdl=pdl_on)
        return decode_attention(q, k_cache, v_cache, lens, pdl=pdl_on)

    prefetch_switch(False)
    plain = step(False, kv_len).clone()
    ref = reference_decode_attention(q.float(), k_cache.float(), v_cache.float(), lens)
    assert float((plain.float() - ref).norm() / ref.norm()) < 2e-2
    prefetch_switch(True)
    for _ in range(3):
        assert torch.equal(step(True, kv_len), plain), kv_len
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # kv_lens set outside: each replay reads the length written before it
        kbuf.fill_(float("nan"))
        gemv(w, x, None, "bf16", "cuda", out=kbuf, pdl=True)
        y = decode_attention(q, k_cache, v_cache, lens, pdl=True)
    for n in (kv_len, max(1, kv_len // 3), kv_len, min(S, kv_len + 77)):
        lens.fill_(n)
        graph.replay()
        got = y.clone()
        prefetch_switch(False)
        want = step(False, n)
        torch.cuda.synchronize()
        assert torch.equal(got, want), (kv_len, n)


def _rope_decode_inputs(gen, device, B=2, HQ=32, HKV=8, S=2048, D=128, dt=torch.bfloat16):
    qkv = torch.randn(B, HQ + 2 * HKV, 1, D, device=device, generator=gen).to(dt)
    caches = [torch.randn(B, HKV, S, D, device=device, generator=gen).to(dt) for _ in range(2)]
    pos = torch.arange(S, device=device, dtype=torch.float32)[:, None]
    freq = 1.0 / 10000 ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D)
    ang = torch.cat([pos * freq, pos * freq], dim=1)
    return qkv[:, :HQ], qkv[:, HQ:HQ + HKV], qkv[:, HQ + HKV:], ang.cos(), ang.sin(), caches


def test_rope_decode_prefetch_hint_is_checked():
    gen = torch.Generator().manual_seed(1)
    q, k, v, cos, sin, (kc, vc) = _rope_decode_inputs(gen, "cpu", B=1, S=64, D=64)
    lens = torch.tensor([9])
    want = rope_decode_attention(q, k, v, cos, sin, kc.clone(), vc.clone(), lens)
    got = rope_decode_attention(q, k, v, cos, sin, kc.clone(), vc.clone(), lens, prefetch=torch.zeros(5))
    assert torch.equal(got, want)  # the reference path: the hint is ignored
    for bad, what in ((torch.zeros(4, 4).t(), "not contiguous"), ([1, 2], "list"),
                      (torch.zeros(4, device="meta"), "on meta")):
        with pytest.raises(ValueError, match=rf"rope_decode_attention: prefetch must be a contiguous tensor on q's "
                                             rf"device cpu, got .*{what}"):
            rope_decode_attention(q, k, v, cos, sin, kc, vc, lens, prefetch=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("min_keys", [0, 1000, 1 << 20])
def test_gpu_rope_decode_prefetch_of_the_next_weight_changes_nothing(requires_gpus, monkeypatch, min_keys):
    # The split programs ask L2 for a weight the GEMV after them reads (odd byte counts, more and fewer bytes
    # than programs x 16, the whole weight) after their keys, those of every sequence, of the longer one only,
    # of none: bit for bit the call without the hint (its cache writes too), eager and in a CUDA graph
    # replayed over new lengths and a new weight.
    _sm90(requires_gpus)
    monkeypatch.setattr(attn_mod, "NEXT_MIN_KEYS", min_keys)
    attn_mod._PATHS.clear()
    gen = torch.Generator(device="cuda").manual_seed(13)
    q, k, v, cos, sin, (kc, vc) = _rope_decode_inputs(gen, "cuda")
    w = (torch.randn(4096, 4096, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    lens = torch.tensor([700, 2048], device="cuda")

    def step(hint):
        c = (kc.clone(), vc.clone())
        a = rope_decode_attention(q, k, v, cos, sin, *c, lens, prefetch=hint)
        return a, gemv(w, a.reshape(2, -1), None, "bf16"), c

    plain = step(None)
    for hint in (w.view(-1)[:7], w.view(-1)[:1000], w.view(-1)[:(5 << 20) + 3], w.view(-1)):
        got = step(hint)
        for x, y in zip((got[0], got[1], *got[2]), (plain[0], plain[1], *plain[2])):
            assert torch.equal(x, y), hint.numel()
    kg, vg = kc.clone(), vc.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a = rope_decode_attention(q, k, v, cos, sin, kg, vg, lens, prefetch=w.view(-1))
        y = gemv(w, a.reshape(2, -1), None, "bf16")
    for n in ((700, 2048), (1, 1500), (2048, 3)):
        lens.copy_(torch.tensor(n))
        w.copy_((torch.randn(4096, 4096, device="cuda", generator=gen) * 0.02).to(torch.bfloat16))
        kg.copy_(kc)
        vg.copy_(vc)
        graph.replay()
        want = step(None)
        torch.cuda.synchronize()
        assert torch.equal(a, want[0]) and torch.equal(y, want[1]) and torch.equal(kg, want[2][0]), n
    attn_mod._PATHS.clear()


def test_plans_prefetch_only_on_the_kernels_measured_to_gain(monkeypatch):
    # The H200 A/B (benchmarks/results/h200-issue26): decode attention and the word GEMV prefetch (and the
    # tensor-core GEMV, which needs Gluon), the dense fma and mma GEMVs do not (they lost 10-25%); a launch
    # asks for at most XELINK_PREFETCH_MB over its first programs. Planned on CPU tensors as on an sm90 GPU.
    for mod in (pdl, gemv_mod, attn_mod):
        monkeypatch.setattr(mod, "sm_count", lambda dev: 132)
    monkeypatch.setattr(pdl, "capability", lambda dev: (9, 0))
    monkeypatch.delenv("XELINK_PREFETCH", raising=False)
    monkeypatch.delenv("XELINK_PREFETCH_MB", raising=False)
    total = pdl.DEFAULT_PREFETCH_MB << 20
    x = torch.randn(1, 4096, dtype=torch.bfloat16)
    dense = torch.randn(4096, 4096, dtype=torch.bfloat16)
    words = pack_w4a16(torch.randn(512, 4096), torch.bfloat16)
    cfg_words = dict(KERNEL="words", BLOCK_N=8, BLOCK_K=512, SPLIT_K=2, num_warps=1, num_stages=1)
    for cfg in (None, dict(KERNEL="mma", BLOCK_N=32, BLOCK_K=256, SPLIT_K=1, num_warps=4, num_stages=3)):
        plan = gemv_mod._GemvLaunch(dense, x, None, "bf16", cfg, False, "early", None, False)
        assert "PREFETCH" not in plan.kwargs, cfg
    plan = gemv_mod._GemvLaunch(words[0], x, words[1], "w4a16", cfg_words, False, "early", None, False)
    row = 4096 // 2 // 2  # a split's packed bytes of a row (K split in 2, two weights a byte)
    gemv_total = pdl.GEMV_PREFETCH_MB << 20  # the quantized GEMVs' own default (2 MB measured best)
    assert plan.kwargs["LIMIT"] == row and plan.kwargs["PREFETCH"] == gemv_total // (row * 8)
    assert plan.kwargs["PIECES"] == 4  # 32 threads over 8 rows
    off = gemv_mod._GemvLaunch(words[0], x, words[1], "w4a16", cfg_words, False, "off", None, False)
    assert "PREFETCH" not in off.kwargs  # no PDL: no early placement to use

    q = torch.randn(1, 32, 1, 128, dtype=torch.bfloat16)
    cache = torch.randn(1, 8, 8192, 128, dtype=torch.bfloat16)
    plan = attn_mod._DecodeLaunch(q, cache, cache, None, False, 0.1, 0, None, "auto", False)
    assert plan.kwargs["PREFETCH"] == total // attn_mod._DECODE_PREFETCH
    assert plan.kwargs["LIMIT"] == attn_mod._DECODE_PREFETCH
    # rope_decode_attention's default ("release"): launched in stream order, the next kernel let go after the main
    # loop, nothing prefetched (no early placement)
    released = attn_mod._DecodeLaunch(q, cache, cache, None, False, 0.1, 0, None, "release", False)
    assert released.kwargs["PDL"] == pdl.PDL_MODES["late"] and "launch_pdl" not in released.kwargs
    assert "PREFETCH" not in released.kwargs
    strided = cache.transpose(2, 3).contiguous().transpose(2, 3)  # the head dim not contiguous: no bulk range
    assert "PREFETCH" not in attn_mod._DecodeLaunch(q, strided, strided, None, False, 0.1, 0, None, "auto",
                                                    False).kwargs
    monkeypatch.setattr(pdl, "PREFETCH", False)
    assert "PREFETCH" not in attn_mod._DecodeLaunch(q, cache, cache, None, False, 0.1, 0, None, "auto", False).kwargs

"""A/B of decode_attention's split choice as the decode model calls it: B=1, 32 query / 8 KV heads, D=128,
bf16, one cache a layer (32 layers, so the caches stream from HBM), the 32 calls captured in one CUDA graph;
us a layer at kv_len 1K of an 8K cache, 8K of 8K, 32K of 32K and 2K of 32K, for each variant of (programs a
multiprocessor the splits aim at, least keys a split of the cache, least keys a split of the sequence):
``_DECODE_PROGRAMS_PER_SM``, ``_DECODE_MIN_CHUNK``, ``_DECODE_SEQ_MIN_CHUNK``. Outputs checked against the
reference once per (variant, shape). ``configs``: the kept split policy with each kernel configuration
(BLOCK_N, num_warps, num_stages) of ``CONFIGS`` instead (``_DECODE_CONFIGS[128]``; issue 23: the split kernel
reads 2 TB/s at 8K). ``wave``: several programs a multiprocessor and kernel configurations as the attention
bench's decode rows (full caches, B = 1 at 8K / 32K / 128K and B = 8 at 32K, caches rotated past L2) and at 2K of
a 32K cache, with SDPA's default (cuDNN) on the full caches for scale (54ccd1c ran it as ``interleave``, with each
variant also with the tiles dealt out to the splits in turn: no faster, removed). ``splits``: at the same full-cache
shapes, the automatic split count against explicit ones around it, each with 3 and 4 pipeline stages.
``tiles``: the automatic split count (whole waves) with each kernel configuration of ``TILES``. ``warps``: one and
two warps a program at several programs a multiprocessor (``FEW_WARPS``), the model's 1K-of-1040 cache included;
``step``: the same variants in the Llama-3.1-8B decode step.

python3 benchmarks/scripts/decode_chunk_ab.py [configs | wave | splits | tiles | warps | step]
"""
import statistics
import sys

import torch

import xelink.kernels.attention as attn
from xelink.bench.harness import time_cuda_events
from xelink.bench.kernel_timing import cuda_graph
from xelink.kernels import decode_attention, reference_decode_attention

LAYERS, HQ, HKV, D = 32, 32, 8, 128
DEFAULT_CONFIG = attn._DECODE_CONFIGS[D]
VARIANTS = [(2, 256, 64), (4, 256, 64), (4, 128, 64), (8, 128, 64), (8, 64, 64)]
CONFIGS = [(64, 4, 3), (64, 4, 2), (64, 4, 4), (64, 8, 3), (128, 4, 3), (128, 8, 3), (128, 8, 2), (32, 4, 4)]


WAVE_VARIANTS = [(1, (64, 4, 3)), (2, (64, 4, 3)), (3, (64, 4, 3)), (4, (64, 4, 2)), (2, (64, 8, 3)),
                 (2, (128, 8, 3)), (2, (64, 4, 4)), (4, (32, 4, 4))]


def _shapes(shapes):
    """For each (B, cache, kv_len): (B, cache, kv, q, caches, lens, the reference output, bytes read a call, timed)
    where ``timed(fns)`` is us a layer of the calls ``fns`` (one a cache) in one CUDA graph."""
    import math
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(0)
    print(torch.cuda.get_device_name(0), flush=True)
    for b, smax, kv in shapes:
        pair = 2 * b * HKV * smax * D * 2
        n = max(2, min(LAYERS, math.ceil((1 << 30) / pair)))
        q = torch.randn(b, HQ, 1, D, device=dev, generator=gen).to(torch.bfloat16)
        caches = [(torch.randn(b, HKV, smax, D, device=dev, generator=gen).to(torch.bfloat16),
                   torch.randn(b, HKV, smax, D, device=dev, generator=gen).to(torch.bfloat16)) for _ in range(n)]
        lens = torch.full((b,), kv, dtype=torch.int32, device=dev)
        ref = reference_decode_attention(q, *caches[0], lens).float()

        def timed(fns, n=n):
            graph, _, _ = cuda_graph(fns, 1)
            us = statistics.median(time_cuda_events(graph.replay, warmup=3, iters=20)) * 1e6 / n
            del graph
            return us

        yield b, smax, kv, q, caches, lens, ref, 2 * b * HKV * kv * D * 2, timed
        del caches


def _sdpa_row(b, smax, kv, q, caches, nbytes, timed):
    import torch.nn.functional as F
    us = timed([lambda c=c: F.scaled_dot_product_attention(q, *c, enable_gqa=True) for c in caches])
    print(f"B={b} cache {smax:6d} kv {kv:6d} sdpa: {us:7.2f} us ({nbytes / us / 1e6:5.2f} TB/s)", flush=True)


def wave():
    kept = attn._DECODE_PROGRAMS_PER_SM[D], DEFAULT_CONFIG
    for b, smax, kv, q, caches, lens, ref, nbytes, timed in _shapes(
            [(1, 8192, 8192), (1, 32768, 32768), (1, 131072, 131072), (8, 32768, 32768), (1, 32768, 2048)]):
        if kv == smax:
            _sdpa_row(b, smax, kv, q, caches, nbytes, timed)
        for pps, config in WAVE_VARIANTS:
            attn._DECODE_PROGRAMS_PER_SM[D], attn._DECODE_CONFIGS[D] = pps, config
            attn._PATHS.clear()
            got = decode_attention(q, *caches[0], lens).float()
            err = float((got - ref).norm() / ref.norm())
            us = timed([lambda c=c: decode_attention(q, *c, lens) for c in caches])
            print(f"B={b} cache {smax:6d} kv {kv:6d} programs/SM {pps} config {config}: "
                  f"{us:7.2f} us ({nbytes / us / 1e6:5.2f} TB/s), rel err {err:.1e}", flush=True)
    attn._DECODE_PROGRAMS_PER_SM[D], attn._DECODE_CONFIGS[D] = kept
    attn._PATHS.clear()


SPLITS = {1: [16, 24, 32, 33, 40, 48, 66], 8: [2, 3, 4, 5, 6, 8]}


def splits():
    deep, attn._DECODE_DEEP_KEYS = attn._DECODE_DEEP_KEYS, 1 << 40
    for b, smax, kv, q, caches, lens, ref, nbytes, timed in _shapes(
            [(1, 8192, 8192), (1, 32768, 32768), (1, 131072, 131072), (8, 32768, 32768)]):
        _sdpa_row(b, smax, kv, q, caches, nbytes, timed)
        auto = attn._decode_splits(q, caches[0][0], DEFAULT_CONFIG[0])
        for n in [None] + SPLITS[b]:
            for stages in (3, 4):
                attn._DECODE_CONFIGS[D] = DEFAULT_CONFIG[:2] + (stages,)  # the deep-split rule off
                attn._PATHS.clear()
                got = decode_attention(q, *caches[0], lens, num_splits=n).float()
                err = float((got - ref).norm() / ref.norm())
                us = timed([lambda c=c: decode_attention(q, *c, lens, num_splits=n) for c in caches])
                print(f"B={b} cache {smax:6d} splits {n or auto:3d}{' (auto)' if n is None else '       '} stages "
                      f"{stages}: {us:7.2f} us ({nbytes / us / 1e6:5.2f} TB/s), rel err {err:.1e}", flush=True)
    attn._DECODE_DEEP_KEYS, attn._DECODE_CONFIGS[D] = deep, DEFAULT_CONFIG
    attn._PATHS.clear()


TILES = [(64, 4, 4), (64, 4, 5), (64, 8, 4), (128, 4, 3), (128, 8, 3), (32, 4, 8), (64, 4, 3)]


def tiles():
    deep, attn._DECODE_DEEP_KEYS = attn._DECODE_DEEP_KEYS, 1 << 40
    for b, smax, kv, q, caches, lens, ref, nbytes, timed in _shapes(
            [(1, 8192, 8192), (1, 32768, 32768), (1, 131072, 131072), (8, 32768, 32768), (8, 131072, 131072)]):
        _sdpa_row(b, smax, kv, q, caches, nbytes, timed)
        for config in TILES:
            attn._DECODE_CONFIGS[D] = config
            attn._PATHS.clear()
            try:
                got = decode_attention(q, *caches[0], lens).float()
            except Exception as e:  # noqa: BLE001 - a configuration that does not compile (shared memory)
                print(f"B={b} cache {smax:6d} config {config}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            err = float((got - ref).norm() / ref.norm())
            us = timed([lambda c=c: decode_attention(q, *c, lens) for c in caches])
            print(f"B={b} cache {smax:6d} splits {attn._decode_splits(q, caches[0][0], config[0]):3d} config {config}: "
                  f"{us:7.2f} us ({nbytes / us / 1e6:5.2f} TB/s), rel err {err:.1e}", flush=True)
    attn._DECODE_DEEP_KEYS, attn._DECODE_CONFIGS[D] = deep, DEFAULT_CONFIG
    attn._PATHS.clear()


# (programs a multiprocessor, (BLOCK_N, num_warps, num_stages)): one and two warps a program, several programs a
# multiprocessor (each split's tiles on one warp's own chain: no cross-warp step a tile); the kept one first.
# (sm_90a offline, with the fused RoPE: 224 registers at the kept 4 warps; 252 at (32, 2, *), 255 with 100-300 bytes
# of spills at one warp and at (64, 2, *); (64, 1, 2) spilled 3.4 KB and is left out.)
FEW_WARPS = [(1, (64, 4, 3)), (2, (64, 2, 3)), (2, (64, 2, 4)), (4, (32, 2, 4)), (4, (32, 1, 3)), (4, (32, 2, 3)),
             (6, (32, 1, 2)), (2, (32, 2, 4))]


def warps():
    kept = attn._DECODE_PROGRAMS_PER_SM[D], DEFAULT_CONFIG
    for b, smax, kv, q, caches, lens, ref, nbytes, timed in _shapes(
            [(1, 1040, 1024), (1, 8192, 8192), (1, 32768, 32768), (1, 131072, 131072), (8, 8192, 8192),
             (8, 32768, 32768)]):
        if kv == smax:
            _sdpa_row(b, smax, kv, q, caches, nbytes, timed)
        for pps, config in FEW_WARPS:
            attn._DECODE_PROGRAMS_PER_SM[D], attn._DECODE_CONFIGS[D] = pps, config
            attn._PATHS.clear()
            try:
                got = decode_attention(q, *caches[0], lens).float()
            except Exception as e:  # noqa: BLE001 - a configuration that does not compile (shared memory)
                print(f"B={b} cache {smax:6d} programs/SM {pps} config {config}: {type(e).__name__}: "
                      f"{str(e)[:120]}", flush=True)
                continue
            err = float((got - ref).norm() / ref.norm())
            us = timed([lambda c=c: decode_attention(q, *c, lens) for c in caches])
            print(f"B={b} cache {smax:6d} kv {kv:6d} splits {attn._decode_splits(q, caches[0][0], config[0]):3d} "
                  f"programs/SM {pps} config {config}: {us:7.2f} us ({nbytes / us / 1e6:5.2f} TB/s), rel err {err:.1e}",
                  flush=True)
    attn._DECODE_PROGRAMS_PER_SM[D], attn._DECODE_CONFIGS[D] = kept
    attn._PATHS.clear()


def step():
    """``FEW_WARPS`` in the Llama-3.1-8B decode step (step_ab.py's helpers): bf16 at 1K / 8K / 32K, W4A16 at 1K."""
    from step_ab import capture, differences, each_context, same_logits, time_interleaved
    variants = {f"{pps}/{config}": [(attn, "_DECODE_PROGRAMS_PER_SM", {**attn._DECODE_PROGRAMS_PER_SM, D: pps}),
                                    (attn, "_DECODE_CONFIGS", {**attn._DECODE_CONFIGS, D: config})]
                for pps, config in FEW_WARPS}
    for fmt, model, L, gen in each_context(["bf16", "w4a16"], {"bf16": [1024, 8192, 32768], "w4a16": [1024]}):
        graphs, logits = capture(model, L, variants, gen)
        ms = time_interleaved(graphs)
        base = next(iter(ms.values()))
        print(f"{fmt} ctx {L} ms a step: " + ", ".join(f"{n} {t:.3f} ({t / base - 1:+.2%})" for n, t in ms.items()),
              flush=True)
        print(f"{fmt} ctx {L} logits: " + ("equal" if same_logits(logits) else differences(logits)), flush=True)
        del graphs


def main():
    if sys.argv[1:] == ["warps"]:
        return warps()
    if sys.argv[1:] == ["step"]:
        return step()
    if sys.argv[1:] == ["wave"]:
        return wave()
    if sys.argv[1:] == ["splits"]:
        return splits()
    if sys.argv[1:] == ["tiles"]:
        return tiles()
    kept = attn._DECODE_PROGRAMS_PER_SM[D], attn._DECODE_MIN_CHUNK, attn._DECODE_SEQ_MIN_CHUNK
    variants = [kept + (c,) for c in CONFIGS] if sys.argv[1:] == ["configs"] else [v + (None,) for v in VARIANTS]
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(0)
    print(torch.cuda.get_device_name(0), flush=True)
    q = torch.randn(1, HQ, 1, D, device=dev, generator=gen).to(torch.bfloat16)
    for smax, kv in [(8192, 1024), (8192, 8192), (32768, 32768), (32768, 2048)]:
        caches = [(torch.randn(1, HKV, smax, D, device=dev, generator=gen).to(torch.bfloat16),
                   torch.randn(1, HKV, smax, D, device=dev, generator=gen).to(torch.bfloat16)) for _ in range(LAYERS)]
        lens = torch.full((1,), kv, dtype=torch.int32, device=dev)
        ref = reference_decode_attention(q, *caches[0], lens).float()
        for pps, cache_min, seq_min, config in variants:
            attn._DECODE_PROGRAMS_PER_SM[D] = pps
            attn._DECODE_MIN_CHUNK, attn._DECODE_SEQ_MIN_CHUNK = cache_min, seq_min
            attn._DECODE_CONFIGS[D] = config or DEFAULT_CONFIG
            attn._PATHS.clear()  # plans made with the old choice
            got = decode_attention(q, *caches[0], lens).float()
            err = float((got - ref).norm() / ref.norm())
            graph, _, _ = cuda_graph([lambda c=c: decode_attention(q, *c, lens) for c in caches], 1)
            us = statistics.median(time_cuda_events(graph.replay, warmup=3, iters=20)) * 1e6 / LAYERS
            print(f"cache {smax:6d} kv_len {kv:6d} programs/SM {pps} min keys cache {cache_min:3d} "
                  f"sequence {seq_min:3d}{'' if config is None else f' config {config}'}: "
                  f"{us:7.2f} us a layer "
                  f"({2 * HKV * kv * D * 2 / us / 1e3:7.1f} GB/s), rel err {err:.1e}", flush=True)
            del graph
        del caches


if __name__ == "__main__":
    main()

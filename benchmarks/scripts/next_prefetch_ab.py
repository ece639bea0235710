"""A/B of the decode step's attention asking L2 for the O projection's weight (issue 26): ``rope_decode_attention``
is latency-bound (8 us a layer at 1K, 15 at 8K on an H200, for 4-34 MB of cache) and leaves HBM idle, and the O
GEMV (33.5 MB bf16) follows it; ``prefetch=`` makes the split programs bulk-prefetch a part of that weight
(``llama.PREFETCH_O_MB`` MiB of it) after their keys, those of sequences of at least ``NEXT_MIN_KEYS`` keys. (At
9afe1c9 the script also tried the prefetch at the kernel's entry: slower at every context; removed.)

Llama-3.1-8B shapes on one GPU, the whole step's graph (``DecodeGraph``) at 1K / 8K / 32K of context (bf16) and
1K (W4A16: the packed O weight is 8 MiB), each variant captured on its own and replayed interleaved; the variants'
logits compared bit for bit (a hint changes no value). Before them, ``pieces``: attention + O GEMV of the 32
layers in one graph, with and without the whole O weight asked for.

python3 benchmarks/scripts/next_prefetch_ab.py [bf16|w4a16 ...]
"""
import importlib
import os
import statistics
import sys

import torch

from xelink.bench.harness import time_cuda_events
from xelink.bench.kernel_timing import cuda_graph
from xelink.kernels import gemv, rope_decode_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_ab import capture, each_context, print_pieces, same_logits, time_interleaved  # noqa: E402

attn = importlib.import_module("xelink.kernels.attention")
llama = importlib.import_module("xelink.models.llama")
CONTEXTS = {"bf16": [1024, 8192, 32768], "w4a16": [1024]}
# name -> (MiB of the O weight, the least keys of a sequence whose programs ask)
VARIANTS = {"off": (0, 0), "kept": (llama.PREFETCH_O_MB, attn.NEXT_MIN_KEYS), "all-always": (64, 0),
            "16M": (16, attn.NEXT_MIN_KEYS), "all-from-2K": (64, 2048)}


def pieces(model, L, gen):
    """us a step of the 32 layers' attention + O GEMV in one graph, without and with the whole O weight asked
    for, and the O GEMV alone."""
    dev, dt, hq, hk, D = model.device, model.dtype, model.heads, model.kv_heads, model.head_dim
    qkv = torch.randn(1, hq + 2 * hk, 1, D, device=dev, generator=gen).to(dt)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
    lens = torch.full((1,), L, dtype=torch.int64, device=dev)
    a = torch.randn(1, hq * D, device=dev, generator=gen).to(dt)
    out = {}
    for name, pre in (("attn+o", False), ("attn+o prefetch", True), ("o alone", None)):  # (at the kept threshold)
        calls = []
        for ly, c in zip(model.layers, model.caches):
            o = ly["o"]
            w = o.weight.view(-1) if pre else None

            def call(o=o, c=c, w=w, pre=pre):
                if pre is not None:
                    rope_decode_attention(q, k, v, model.cos, model.sin, c.k[:1], c.v[:1], lens, prefetch=w)
                gemv(o.weight, a, o.scales, model.ops.gemv_format(o, a))
            calls.append(call)
        graph, _, _ = cuda_graph(calls, 1)
        out[name] = statistics.median(time_cuda_events(graph.replay, warmup=2, iters=20)) * 1e6
        del graph
    return ", ".join(f"{n} {us:.1f}" for n, us in out.items())


def main():
    fmts = sys.argv[1:] or ["bf16", "w4a16"]
    variants = {name: [(llama, "PREFETCH_O_MB", mb), (attn, "NEXT_MIN_KEYS", at)]
                for name, (mb, at) in VARIANTS.items()}
    for fmt, model, L, gen in each_context(fmts, CONTEXTS):
        print_pieces(fmt, L, pieces, model, gen)
        graphs, logits = capture(model, L, variants, gen)
        line = ", ".join(f"{n} {ms:.3f}" for n, ms in time_interleaved(graphs).items())
        print(f"{fmt} ctx {L} step ms (median of 50 replays): {line}; logits equal: {same_logits(logits)}", flush=True)


if __name__ == "__main__":
    main()

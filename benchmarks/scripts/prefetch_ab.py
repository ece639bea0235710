"""A/B of the L2 prefetch before the PDL wait (``xelink.kernels.pdl.prefetch_l2``): the GEMVs' weight rows and
decode attention's cache rows asked of L2 while the previous kernel ends. On one GPU: (1) each op of the
Llama-3.1-8B decode step alone over the 32 layers in one CUDA graph (``bench decode``'s ``step_breakdown``)
at 1K and 8K of context, (2) the whole step's graph (``Llama.decode_graph(1)``) at 1K and 8K, bf16 and
W4A16, each variant captured on its own and replayed interleaved; the logits of the variants must be equal
bit for bit (the prefetch is a hint). Variants: prefetch off, and on at each ``PREFETCH_BYTES`` of ``KBS``.

python3 benchmarks/scripts/prefetch_ab.py [bf16|w4a16 ...]
"""
import gc
import importlib
import statistics
import sys

import torch

from xelink.bench.families.decode import _fill_caches, step_breakdown
from xelink.bench.harness import time_cuda_events
from xelink.models import Llama

attn = importlib.import_module("xelink.kernels.attention")  # (xelink.kernels.gemv is also the function's name)
gemv_mod = importlib.import_module("xelink.kernels.gemv")
pdl = importlib.import_module("xelink.kernels.pdl")
KBS = [0, 32, 64, 256]  # 0: off
CONTEXTS = [1024, 8192]


def variant(kb: int) -> None:
    pdl.PREFETCH = kb > 0
    if kb:
        pdl.PREFETCH_BYTES = kb * 1024
    gemv_mod._PATHS.clear()
    attn._PATHS.clear()


def main():
    fmts = sys.argv[1:] or ["bf16", "w4a16"]
    dev = torch.device("cuda", 0)
    print(torch.cuda.get_device_name(0), flush=True)
    for fmt in fmts:
        model = Llama.random("llama-3.1-8b", weights=fmt, impl="xelink", device=dev, max_batch=1,
                             max_seq_len=max(CONTEXTS) + 16)
        gen = torch.Generator(device=dev).manual_seed(3)
        for L in CONTEXTS:
            _fill_caches(model, 1, L, gen)
            if fmt == "bf16":
                for kb in KBS:
                    variant(kb)
                    parts = step_breakdown(model, 1, L, gen, replays=20)
                    print(f"{fmt} ctx {L} prefetch {kb:3d} KB breakdown: "
                          + ", ".join(f"{k} {u}" for k, (u, _) in parts.items()), flush=True)
            tokens = torch.randint(0, model.config.vocab_size, (1,), device=dev, generator=gen)
            positions = torch.full((1,), L - 1, dtype=torch.int64, device=dev)
            graphs, logits = {}, {}
            for kb in KBS:
                variant(kb)
                g = model.decode_graph(1)
                logits[kb] = g.step(tokens, positions).clone()
                graphs[kb] = g
            same = all(torch.equal(logits[kb], logits[0]) for kb in KBS)
            times = {kb: [] for kb in KBS}
            for _ in range(5):  # interleaved rounds
                for kb in KBS:
                    times[kb] += time_cuda_events(graphs[kb].graph.replay, warmup=2, iters=10)
            line = ", ".join(f"{kb} KB {statistics.median(t) * 1e3:.3f} ms" for kb, t in times.items())
            print(f"{fmt} ctx {L} step (median of 50 replays): {line}; logits equal across variants: {same}",
                  flush=True)
            del graphs, logits
            gc.collect()
        del model
        gc.collect()
        torch.cuda.empty_cache()
    variant(64)


if __name__ == "__main__":
    main()

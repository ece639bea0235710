"""A/B of the L2 prefetch before the PDL wait (``xelink.kernels.pdl.prefetch_l2``): the GEMVs' weight rows and
decode attention's cache rows asked of L2 while the previous kernel ends. On one GPU: (1) each op of the
Llama-3.1-8B decode step alone over the 32 layers in one CUDA graph (``bench decode``'s ``step_breakdown``)
at 1K and 8K of context, (2) the whole step's graph (``Llama.decode_graph(1)``) at 1K and 8K, bf16 and
W4A16, each variant captured on its own and replayed interleaved; the logits of the variants must be equal
bit for bit (the prefetch is a hint). Variants: prefetch off, and on with each launch's total of ``MBS``.

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
from xelink.models.llama import DecodeGraph

attn = importlib.import_module("xelink.kernels.attention")  # (xelink.kernels.gemv is also the function's name)
gemv_mod = importlib.import_module("xelink.kernels.gemv")
pdl = importlib.import_module("xelink.kernels.pdl")
MBS = [0, 2, 8]  # a launch's prefetch at most (pdl.PREFETCH_BYTES); 0: off
CONTEXTS = [1024, 8192]


def variant(mb: int) -> None:
    pdl.PREFETCH = mb > 0
    if mb:
        pdl.PREFETCH_BYTES = mb << 20
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
            if fmt == "bf16" and L == CONTEXTS[-1]:
                for mb in MBS:
                    variant(mb)
                    parts = step_breakdown(model, 1, L, gen, replays=20)
                    print(f"{fmt} ctx {L} prefetch {mb:3d} MB breakdown: "
                          + ", ".join(f"{k} {u}" for k, (u, _) in parts.items()), flush=True)
            tokens = torch.randint(0, model.config.vocab_size, (1,), device=dev, generator=gen)
            positions = torch.full((1,), L - 1, dtype=torch.int64, device=dev)
            graphs, logits = {}, {}
            for mb in MBS:
                variant(mb)
                g = DecodeGraph(model, 1)  # (model.decode_graph keeps the first one made)
                logits[mb] = g.step(tokens, positions).clone()
                graphs[mb] = g
            same = all(torch.equal(logits[mb], logits[0]) for mb in MBS)
            times = {mb: [] for mb in MBS}
            for _ in range(5):  # interleaved rounds
                for mb in MBS:
                    times[mb] += time_cuda_events(graphs[mb].graph.replay, warmup=2, iters=10)
            line = ", ".join(f"{mb} MB {statistics.median(t) * 1e3:.3f} ms" for mb, t in times.items())
            print(f"{fmt} ctx {L} step (median of 50 replays): {line}; logits equal across variants: {same}",
                  flush=True)
            del graphs, logits
            gc.collect()
        del model
        gc.collect()
        torch.cuda.empty_cache()
    variant(8)


if __name__ == "__main__":
    main()

"""A/B of the L2 prefetch before the PDL wait (``xelink.kernels.pdl.prefetch_l2``): the GEMVs' weight rows and
decode attention's cache rows asked of L2 while the previous kernel ends. On one GPU: (1) each op of the
Llama-3.1-8B decode step alone over the 32 layers in one CUDA graph (``bench decode``'s ``step_breakdown``)
at 1K and 8K of context, (2) the whole step's graph (``Llama.decode_graph(1)``) at 1K and 8K, bf16 and
W4A16, each variant captured on its own and replayed interleaved; the logits of the variants must be equal
bit for bit (the prefetch is a hint). Variants: prefetch off, and on with each launch's total of ``MBS``.

python3 benchmarks/scripts/prefetch_ab.py [bf16|w4a16 ...]
"""
import importlib
import os
import sys

from xelink.bench.families.decode import step_breakdown

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_ab import applied, capture, each_context, same_logits, time_interleaved  # noqa: E402

pdl = importlib.import_module("xelink.kernels.pdl")
MBS = [0, 2, 8]  # a launch's prefetch at most (pdl.PREFETCH_BYTES); 0: off
CONTEXTS = [1024, 8192]


def settings(mb: int) -> list:
    return [(pdl, "PREFETCH", mb > 0), (pdl, "PREFETCH_BYTES", (mb << 20) or pdl.PREFETCH_BYTES)]


def main():
    fmts = sys.argv[1:] or ["bf16", "w4a16"]
    for fmt, model, L, gen in each_context(fmts, {fmt: CONTEXTS for fmt in fmts}):
        if fmt == "bf16" and L == CONTEXTS[-1]:
            for mb in MBS:
                with applied(settings(mb)):
                    parts = step_breakdown(model, 1, L, gen, replays=20)
                print(f"{fmt} ctx {L} prefetch {mb:3d} MB breakdown: "
                      + ", ".join(f"{k} {u}" for k, (u, _) in parts.items()), flush=True)
        graphs, logits = capture(model, L, {mb: settings(mb) for mb in MBS}, gen)
        line = ", ".join(f"{mb} MB {ms:.3f} ms" for mb, ms in time_interleaved(graphs).items())
        print(f"{fmt} ctx {L} step (median of 50 replays): {line}; logits equal across variants: "
              f"{same_logits(logits)}", flush=True)


if __name__ == "__main__":
    main()

"""Upper bounds of a fusion in the Llama-3.1-8B decode step (issue 26): the step with a class of its ops made
free (no kernel at all; the results are wrong, the times say what a fusion could at most save).

    python3 benchmarks/scripts/step_bound.py [--fmts bf16 w4a16] [--contexts 1024 8192]

Variants (each its own DecodeGraph, B = 1, replayed interleaved with the kept step; step_ab.py's helpers):
``no_norms``: every RMSNorm returns its input (and x as the new residual: no add either) -- the most that folding
the residual add and the norm into the next GEMV could save; ``no_attention``: the decode attention call (RoPE, the
cache write, attention) returns its query, what a faster attention could at most save at that context. (a GPU
script: CUDA, NVIDIA's Triton.)
"""
import argparse

from step_ab import CONTEXTS, capture, each_context, time_interleaved

from xelink.models.llama import Ops


def _no_norm(self, x, w, eps, residual=None):
    return x if residual is None else (x, x)


def _no_attention(self, q, *args, **kwargs):
    return q


VARIANTS = {"kept": [], "no_norms": [(Ops, "rmsnorm", _no_norm)],
            "no_attention": [(Ops, "rope_decode_attention", _no_attention)]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fmts", nargs="+", default=["bf16", "w4a16"])
    p.add_argument("--contexts", nargs="+", type=int, default=CONTEXTS[:2])
    args = p.parse_args(argv)
    contexts = {fmt: args.contexts if fmt == "bf16" else args.contexts[:1] for fmt in args.fmts}
    for fmt, model, L, gen in each_context(args.fmts, contexts):
        graphs, _ = capture(model, L, VARIANTS, gen)
        ms = time_interleaved(graphs)
        base = ms["kept"]
        cells = ", ".join(f"{n} {t:.3f} ({t - base:+.3f})" for n, t in ms.items())
        print(f"{fmt} ctx {L} ms a step (median of 50 replays): {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A/B of the W4A16 weights' layout in the Llama-3.1-8B decode step (issue 26): the projections in tiles
(``"w4a16t"``, ``xelink.kernels.tile_w4a16``: what ``Llama`` loads on a CUDA GPU where the tensor-core GEMV reads
them in place) against the same weights in ``pack_w4a16``'s row layout (``"w4a16"``), each with its own default
tiles. (1) Each op of the step alone over the 32 layers in one CUDA graph (``bench decode``'s ``step_breakdown``),
(2) the whole step's graph (``DecodeGraph``, B = 1) of each layout, replayed interleaved; the two steps' logits
(different K splits: float sums in another order) compared by next token and relative difference.

python3 benchmarks/scripts/tiles_ab.py [--contexts 1024 ...]
"""
import argparse
import dataclasses
import os
import sys

from xelink.bench.families.decode import step_breakdown
from xelink.kernels import untile_w4a16
from xelink.models.llama import DecodeGraph

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_ab import differences, each_context, forget_plans, time_interleaved  # noqa: E402

import torch  # noqa: E402


def row_layers(layers):
    """The layers with every tiled projection in the row layout (new weights: the tiled ones stay as they are)."""
    return [{k: dataclasses.replace(v, weight=untile_w4a16(v.weight), fmt="w4a16")
             if getattr(v, "fmt", None) == "w4a16t" else v for k, v in layer.items()} for layer in layers]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", nargs="+", type=int, default=[1024])
    args = p.parse_args()
    for fmt, model, L, gen in each_context(["w4a16"], {"w4a16": args.contexts}):
        tiled = model.layers
        assert {v.fmt for layer in tiled for v in layer.values() if hasattr(v, "fmt")} == {"w4a16t"}
        variants = {"tiles": tiled, "rows": row_layers(tiled)}
        tokens = torch.randint(0, model.config.vocab_size, (1,), device=model.device, generator=gen)
        positions = torch.full((1,), L - 1, dtype=torch.int64, device=model.device)
        graphs, logits = {}, {}
        for name, layers in variants.items():
            model.layers = layers
            forget_plans()
            parts = step_breakdown(model, 1, L, gen, replays=20)
            print(f"{fmt} ctx {L} {name} breakdown us a step: "
                  + ", ".join(f"{k} {u}" for k, (u, _) in parts.items()), flush=True)
            graphs[name] = DecodeGraph(model, 1)
            logits[name] = graphs[name].step(tokens, positions).clone()
        model.layers = tiled
        ms = time_interleaved(graphs)
        print(f"{fmt} ctx {L} step ms (median of 50 replays): "
              + ", ".join(f"{n} {t:.3f}" for n, t in ms.items())
              + f"; tiles / rows {ms['tiles'] / ms['rows']:.3f}; {differences(logits)}", flush=True)
        del graphs, variants


if __name__ == "__main__":
    main()

"""A/B of module switches in the whole Llama-3.1-8B decode step (issue 26): each variant sets one switch of a
xelink module (an attribute read when a launch is planned, e.g. ``attention.NEXT_MIN_KEYS``), drops the
remembered launch plans, captures its own step graph (``DecodeGraph``, B = 1) and takes a step; the variants'
logits must equal the first variant's bit for bit (a switch of this kind changes no value: hints, placement),
and their graphs are replayed in interleaved rounds. Random weights, one model a format whose cache holds the
longest context + 16 (W4A16: the first context only, as ``xelink bench decode``'s row), filled to each context.

    python3 benchmarks/scripts/step_ab.py attention.NEXT_MIN_KEYS=4096,0 [--fmts bf16 w4a16] \
        [--contexts 1024 8192 32768]

(a GPU script: CUDA, NVIDIA's Triton.) The first value is the baseline; the switch is left at it afterwards.
Ran at 8a10676 with ``attention.EARLY_KEY_TILES=0,1,2,8`` (a switch that commit had, since removed:
benchmarks/results/h100-rows/early_keys_ab.log).
"""
import argparse
import gc
import importlib
import statistics

import torch

from xelink.bench.families.decode import _fill_caches
from xelink.bench.harness import time_cuda_events
from xelink.models import Llama
from xelink.models.llama import DecodeGraph



def forget_plans() -> None:
    """Drop every kernel module's remembered launch plans (they hold the switches as they were when planned)."""
    for name in ("attention", "gemv", "norm", "gemm", "gated_gemm"):
        importlib.import_module(f"xelink.kernels.{name}")._PATHS.clear()


def parse_switch(text: str):
    """``module.NAME=v1,v2,...`` -> (module object, NAME, [values]) (module under xelink.kernels or xelink.models,
    values Python literals)."""
    import ast

    where, _, values = text.partition("=")
    mod, _, name = where.rpartition(".")
    for package in ("xelink.kernels", "xelink.models"):
        try:
            module = importlib.import_module(f"{package}.{mod}")
            break
        except ImportError:
            continue
    else:
        raise SystemExit(f"step_ab: no module {mod!r} under xelink.kernels or xelink.models")
    if not hasattr(module, name):
        raise SystemExit(f"step_ab: {module.__name__} has no {name}")
    return module, name, [ast.literal_eval(v) for v in values.split(",")]


def compare(model, L: int, module, name: str, values, gen) -> str:
    """One context's line: ms a step (median of 50 replays) per value, and whether the logits are equal."""
    dev = model.device
    tokens = torch.randint(0, model.config.vocab_size, (1,), device=dev, generator=gen)
    positions = torch.full((1,), L - 1, dtype=torch.int64, device=dev)
    graphs, logits = {}, {}
    for v in values:
        setattr(module, name, v)
        forget_plans()
        g = DecodeGraph(model, 1)
        logits[v] = g.step(tokens, positions).clone()
        graphs[v] = g
    setattr(module, name, values[0])
    forget_plans()
    same = all(torch.equal(logits[v], logits[values[0]]) for v in values)
    times = {v: [] for v in values}
    for _ in range(5):  # interleaved rounds
        for v in values:
            times[v] += time_cuda_events(graphs[v].graph.replay, warmup=2, iters=10)
    base = statistics.median(times[values[0]])
    cells = ", ".join(f"{v!r} {statistics.median(t) * 1e3:.3f} ({statistics.median(t) / base - 1:+.2%})"
                      for v, t in times.items())
    return f"{name} ms a step (median of 50 replays): {cells}; logits equal: {same}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("switch", help="module.NAME=v1,v2,... (the first value is the baseline)")
    p.add_argument("--fmts", nargs="+", default=["bf16", "w4a16"])
    p.add_argument("--contexts", nargs="+", type=int, default=[1024, 8192, 32768])
    args = p.parse_args(argv)
    module, name, values = parse_switch(args.switch)
    dev = torch.device("cuda", 0)
    print(torch.cuda.get_device_name(0), flush=True)
    for fmt in args.fmts:
        contexts = args.contexts if fmt == "bf16" else args.contexts[:1]  # (W4A16: xelink bench decode's 1K row)
        model = Llama.random("llama-3.1-8b", weights=fmt, impl="xelink", device=dev, max_batch=1,
                             max_seq_len=max(contexts) + 16)
        gen = torch.Generator(device=dev).manual_seed(3)
        for L in contexts:
            _fill_caches(model, 1, L, gen)
            print(f"{fmt} ctx {L} {compare(model, L, module, name, values, gen)}", flush=True)
            gc.collect()
        del model
        gc.collect()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

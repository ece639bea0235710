"""A/B of settings in the whole Llama-3.1-8B decode step (issue 26), and the helpers the step A/B scripts share
(``next_prefetch_ab.py``, ``prefetch_ab.py``, ``rope_decode_ab.py``).

A variant is a list of settings ``(object, attribute, value)``: module switches read when a launch is planned
(e.g. ``attention.NEXT_MIN_KEYS``) or a replaced method. ``capture`` applies each variant's settings, drops the
remembered launch plans, captures the variant's own step graph (``DecodeGraph``, B = 1), takes a step, and puts
every setting back; ``time_interleaved`` replays the graphs in interleaved rounds. Random weights, one model a
format whose cache holds the longest context + 16 (W4A16: the first context only, as ``xelink bench decode``'s
row), filled to each context (``each_context``).

As a command, one switch's values, the first the baseline; the variants' logits are compared with the baseline's:
equal bit for bit for a switch that changes no value (hints, placement), else the next token and the relative
difference (``gemv_norm.CU_FOLD``: the norm's rounding):

    python3 benchmarks/scripts/step_ab.py attention.NEXT_MIN_KEYS=4096,0 [--fmts bf16 w4a16 w4a16+head] \
        [--contexts 1024 8192 32768]

(a GPU script: CUDA, NVIDIA's Triton.) Ran at 8a10676 with ``attention.EARLY_KEY_TILES=0,1,2,8`` (a switch that
commit had, since removed: benchmarks/results/h100-rows/early_keys_ab.log).
"""
import argparse
import ast
import contextlib
import gc
import importlib
import statistics

import torch

from xelink.bench.families.decode import _fill_caches
from xelink.bench.harness import time_cuda_events
from xelink.kernels.common import Paths
from xelink.models import Llama
from xelink.models.llama import DecodeGraph

CONTEXTS = [1024, 8192, 32768]


def forget_plans() -> None:
    """Drop every kernel module's remembered launch plans (they hold the switches as they were when planned)."""
    for name in ("attention", "gemv", "gemv_norm", "norm", "gemm", "gated_gemm"):
        for value in vars(importlib.import_module(f"xelink.kernels.{name}")).values():
            if isinstance(value, Paths):
                value.clear()


@contextlib.contextmanager
def applied(settings):
    """The settings ``(object, attribute, value)`` in force (and no plan made without them) inside the block."""
    kept = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in settings]
    try:
        for obj, attr, value in settings:
            setattr(obj, attr, value)
        forget_plans()
        yield
    finally:
        for obj, attr, value in reversed(kept):
            setattr(obj, attr, value)
        forget_plans()


def each_context(fmts, contexts):
    """(fmt, model, context, generator) for each format and each of its contexts (``contexts``: fmt -> list),
    the model's caches filled to the context; the model dropped after its last context."""
    dev = torch.device("cuda", 0)
    print(torch.cuda.get_device_name(0), flush=True)
    for fmt in fmts:  # ("w4a16+head": the head quantized too, ``quantize_head``)
        model = Llama.random("llama-3.1-8b", weights=fmt.removesuffix("+head"), impl="xelink", device=dev,
                             max_batch=1, max_seq_len=max(contexts[fmt]) + 16, quantize_head=fmt.endswith("+head"))
        gen = torch.Generator(device=dev).manual_seed(3)
        for L in contexts[fmt]:
            _fill_caches(model, 1, L, gen)
            yield fmt, model, L, gen
            gc.collect()
        del model
        gc.collect()
        torch.cuda.empty_cache()


def print_pieces(fmt: str, L: int, pieces, model, gen) -> None:
    """A script's own ``pieces(model, L, gen)`` line for one context (what each piece of the step costs); a failure
    is printed instead, so the step A/B after it still runs."""
    try:
        print(f"{fmt} ctx {L} pieces us a step: {pieces(model, L, gen)}", flush=True)
    except Exception as exc:  # noqa: BLE001 - a side measurement
        print(f"{fmt} ctx {L} pieces failed: {exc!r}", flush=True)


def capture(model, L: int, variants: dict, gen) -> tuple[dict, dict]:
    """({name: DecodeGraph}, {name: logits of one step at context L}) of each variant (name -> settings)."""
    tokens = torch.randint(0, model.config.vocab_size, (1,), device=model.device, generator=gen)
    positions = torch.full((1,), L - 1, dtype=torch.int64, device=model.device)
    graphs, logits = {}, {}
    for name, settings in variants.items():
        with applied(settings):
            graphs[name] = DecodeGraph(model, 1)
            logits[name] = graphs[name].step(tokens, positions).clone()
    return graphs, logits


def time_interleaved(graphs: dict, rounds: int = 5, iters: int = 10) -> dict:
    """{name: median ms a replay} over ``rounds`` interleaved rounds of ``iters`` replays each."""
    times = {n: [] for n in graphs}
    for _ in range(rounds):
        for n, g in graphs.items():
            times[n] += time_cuda_events(g.graph.replay, warmup=2, iters=iters)
    return {n: statistics.median(t) * 1e3 for n, t in times.items()}


def same_logits(logits: dict, names=None) -> bool:
    """Whether the logits of ``names`` (default: all) equal the first variant's bit for bit."""
    first = next(iter(logits.values()))
    return all(torch.equal(logits[n], first) for n in (names or logits))


def differences(logits: dict) -> str:
    """How each variant's logits differ from the first's (a switch that changes values: rounding)."""
    names = list(logits)
    first = logits[names[0]].float()
    return ", ".join(f"{n}: next token {'equal' if torch.equal(logits[n].argmax(-1), first.argmax(-1)) else 'DIFFERS'}"
                     f", relative RMS {float((logits[n].float() - first).norm() / first.norm()):.1e}"
                     for n in names[1:])


def parse_switch(text: str):
    """``module.NAME=v1,v2,...`` -> (module object, NAME, [values]) (module under xelink.kernels or xelink.models,
    values Python literals)."""
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="A/B of one module switch in the Llama-3.1-8B decode step")
    p.add_argument("switch", help="module.NAME=v1,v2,... (the first value is the baseline)")
    p.add_argument("--fmts", nargs="+", default=["bf16", "w4a16"])
    p.add_argument("--contexts", nargs="+", type=int, default=CONTEXTS)
    args = p.parse_args(argv)
    module, name, values = parse_switch(args.switch)
    variants = {repr(v): [(module, name, v)] for v in values}
    contexts = {fmt: args.contexts if fmt == "bf16" else args.contexts[:1] for fmt in args.fmts}
    for fmt, model, L, gen in each_context(args.fmts, contexts):
        graphs, logits = capture(model, L, variants, gen)
        ms = time_interleaved(graphs)
        base = ms[repr(values[0])]
        cells = ", ".join(f"{n} {t:.3f} ({t / base - 1:+.2%})" for n, t in ms.items())
        print(f"{fmt} ctx {L} {name} ms a step (median of 50 replays): {cells}; logits equal: {same_logits(logits)}"
              f"{'' if same_logits(logits) else '; ' + differences(logits)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

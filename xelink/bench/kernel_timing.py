"""What the single-device kernel families (gemm, gemv, norm, attention, decode) share: rank 0 runs the
family while the other ranks wait, the CPU reference run or the GPU benchmark by the device, the #wrong
tolerance, co-measured CPU timing with checks, and CUDA-graph capture of a list of calls.

A family's ``run(ctx)`` is ``run_single_device(ctx, cpu=..., gpu=..., gpu_only=...)``: on a CUDA rank
the family's GPU benchmark, on any other device its CPU reference run (the kernels' ``impl="reference"``
paths, the pure-torch twins the GPU kernels are tested against, next to torch's own op at small
shapes). Options that only the GPU benchmark knows are refused on CPU, by every rank, so none waits.
"""
from __future__ import annotations

import torch

from .harness import co_measure, make_row, summarize

__all__ = ["KernelReport", "add_timing_arguments", "cpu_rows", "cuda_graph", "measure_checked", "run_single_device",
           "timing", "wrong_elements"]


def wrong_elements(out: torch.Tensor, ref: torch.Tensor) -> int:
    """Elements of ``out`` farther from ``ref`` (float32) than 2% of the value plus 2% of ref's RMS.

    NaN counts as wrong.
    """
    ref = ref.float()
    tol = 0.02 * ref.abs() + 0.02 * ref.pow(2).mean().sqrt()
    diff = (out.float() - ref).abs()
    return int((~(diff <= tol)).sum())


def cuda_graph(calls, repeats: int):
    """A CUDA graph that runs every call ``repeats`` times; returns (graph, last outputs, launches).

    The calls run once on a side stream first (compilation and warm-up outside the capture).
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = None
        for _ in range(repeats):
            outs = [call() for call in calls]
    return graph, outs, repeats * len(calls)


class KernelReport:
    """Rows and notes a GPU kernel benchmark collects (``add(row)``, ``notes.append(line)``)."""

    def __init__(self):
        self.rows, self.notes = [], []

    def add(self, row) -> None:
        self.rows.append(row)


def add_timing_arguments(p, *, cpu: str, gpu: str) -> None:
    """``--iters`` and ``--rounds`` (default None: the family's own counts, described by ``cpu`` and ``gpu``)."""
    p.add_argument("--iters", type=int, help=f"timed calls per variant per round (CPU: {cpu}; CUDA: {gpu})")
    p.add_argument("--rounds", type=int, help="rounds, variants interleaved (default: as --iters says)")


def timing(ctx, default: dict, quick: dict | None = None) -> dict:
    """``{"iters": ..., "rounds": ...}``: ``default`` (``quick`` with --quick), overridden by the options."""
    knobs = dict(quick if ctx.quick and quick is not None else default)
    knobs.update({k: getattr(ctx.args, k) for k in knobs if getattr(ctx.args, k, None) is not None})
    return knobs


def measure_checked(variants: dict, checks: dict, *, iters: int, rounds: int) -> tuple[dict, dict]:
    """(samples, wrong) of ``variants`` co-measured on the host clock; after every block of timed calls,
    ``checks[name](output)`` counts the wrong elements of the last output of ``variants[name]``."""
    outputs, wrong = {}, {name: 0 for name in variants}

    def check(name):
        wrong[name] += checks[name](outputs[name])

    def keep(name, fn):
        return lambda: outputs.__setitem__(name, fn())

    samples = co_measure({n: keep(n, f) for n, f in variants.items()}, warmup=1, iters=iters, rounds=rounds,
                         after_block=check)
    return samples, wrong


def cpu_rows(op, samples, wrong, base, *, size_bytes, count, dtype, flops, extra, per: float = 1.0) -> list:
    """Rows of CPU samples (``per``: calls a sample covers), each against ``base``; GFLOP/s with ``flops``."""
    samples = {name: [t / per for t in s] for name, s in samples.items()}
    out = []
    for name, s in samples.items():
        is_base = name == base
        seconds = summarize(s)["median"]
        rate = {} if flops is None else {"gflops": flops / seconds / 1e9 if seconds > 0 else None}
        out.append(make_row(op, name, s, size_bytes=size_bytes, count=count, dtype=dtype, nranks=1,
                            wrong=wrong[name], baseline=None if is_base else base,
                            baseline_samples=None if is_base else samples[base],
                            extra={**extra, "timing": "host clock, CPU", **rate}))
    return out


def _given(args, gpu_only: dict) -> list[str]:
    """The GPU-only options given, as they would be typed (``--impl cuda``, ``--sweep``)."""
    given = []
    for dest, flag in gpu_only.items():
        value = getattr(args, dest, None)
        if value is None or value is False:
            continue
        given.append(flag if value is True else f"{flag} {value}")
    return given


def run_single_device(ctx, *, cpu, gpu, gpu_only: dict | None = None) -> list:
    """Run ``gpu(ctx)`` on a CUDA rank 0, else ``cpu(ctx)``, while the other ranks wait; rows on rank 0.

    Args:
        ctx: the family's ``suite.Context``.
        cpu, gpu: functions of ctx returning rows (rank 0 only).
        gpu_only: ``{dest: "--flag"}`` of the options only the GPU benchmark knows (default None: off);
            given on a CPU run they are refused before anything runs.

    Returns:
        the rows on rank 0, [] on the other ranks.

    Collective: every rank of the world must call this.
    """
    cuda = getattr(ctx.world.device, "type", "cpu") == "cuda"
    if not cuda:
        given = _given(ctx.args, gpu_only or {})
        if given:  # every rank refuses, so none waits for rank 0
            raise SystemExit(f"xelink bench {ctx.family}: unrecognized arguments for the CPU reference run (options "
                             f"of the GPU benchmark, CUDA only): {' '.join(given)}")
    if ctx.lead:
        if cuda:
            ctx.header = (f"# {ctx.family}: xelink's GPU kernels vs torch on {torch.cuda.get_device_name()}, rank 0 "
                          f"alone; ratio = baseline time / xelink time (>1: xelink faster); outputs of the timed runs "
                          f"checked against float32 (#wrong)")
        else:
            ctx.header = (f"# {ctx.family}: xelink's reference path (pure torch, what the GPU kernels are tested "
                          f"against) vs torch on CPU, rank 0 alone; ratio = torch time / xelink time (>1: xelink "
                          f"faster); outputs of the timed runs checked against float64/float32 (#wrong)")
    rows = ctx.solo(lambda: (gpu if cuda else cpu)(ctx))
    return rows or []

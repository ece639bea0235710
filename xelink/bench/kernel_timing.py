"""What the single-device kernel families (gemm, gemv, norm, attention, decode) share: rank 0 runs the
family while the other ranks wait, the CPU reference run or the GPU benchmark by the device, the #wrong
tolerance, co-measured CPU timing with checks, CUDA-graph capture of a list of calls, and the host time
of an eager call (``host_timing``, ``host_rows``: what a launch costs the CPU while the GPU is busy).

A family's ``run(ctx)`` is ``run_single_device(ctx, cpu=..., gpu=...)``: on a CUDA rank the family's GPU
benchmark, on any other device its CPU reference run (the kernels' ``impl="reference"`` paths, the pure-torch
twins the GPU kernels are tested against, next to torch's own op at small shapes). Options that only the GPU
benchmark knows (the family's ``harness.CUDA_ONLY`` group) are refused on CPU by the suite, by every rank.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..kernels.common import gc_paused
from .harness import at_least, co_measure, make_row, summarize

__all__ = ["HOST_MARGIN_US", "KernelReport", "add_timing_arguments", "cpu_rows", "cuda_graph", "host_rows",
           "host_summary", "host_timing", "measure_checked", "run_single_device", "timing", "with_host_rows",
           "wrong_elements"]

HOST_MARGIN_US = 10.0  # issue 20: an eager call may cost the host at most torch's equivalent + 10 us


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
    with gc_paused(), torch.cuda.graph(graph):
        outs = None
        for _ in range(repeats):
            outs = [call() for call in calls]
    return graph, outs, repeats * len(calls)


def _sleep_cycles_per_us() -> float:
    """Clock cycles ``torch.cuda._sleep`` spins per microsecond on the current device (measured)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm-up
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / (start.elapsed_time(end) * 1e3)


_PER_US: dict = {}


def busy(us: float) -> None:
    """Keep the current CUDA device busy for about ``us`` microseconds (``torch.cuda._sleep``, its rate
    measured once per device): host-time measurements enqueue behind it, so no call waits for the GPU."""
    dev = torch.cuda.current_device()
    if dev not in _PER_US:
        _PER_US[dev] = _sleep_cycles_per_us()
    torch.cuda._sleep(int(_PER_US[dev] * us))


def host_timing(variants: dict, checks: dict, *, calls: int = 100, rounds: int = 10,
                warmup: int = 3, agree=None) -> tuple[dict, dict]:
    """Host time of one eager call of each variant, with the GPU busy: (samples, wrong).

    Each round times every variant in turn (co-measured, interleaved): ``torch.cuda._sleep`` first puts
    the stream behind a kernel that outlasts the block, then ``calls`` back-to-back calls run under
    ``time.perf_counter`` with no synchronization, so what is timed is what the host spends to enqueue
    the work (checks, allocation, launch), not the kernels. A block whose sleep ended before its last
    call (the GPU caught up) is timed again with a longer sleep. ``calls`` times the kernels a call
    launches must stay far below the depth of the launch queue (about 1000 launches), which would
    otherwise make the host wait for the sleeping GPU (and every retry sleep longer).

    Args:
        variants: name -> a call returning its output (launching on the current CUDA stream).
        checks: name -> fn(output) -> wrong elements, applied after synchronizing to the last output of
            each timed block.
        calls: calls per timed block.
        rounds: timed blocks per variant.
        warmup: untimed calls of each variant first (compilation, caches).
        agree: for calls that communicate (several ranks, every one calling this with the same
            variants): maps this rank's "the GPU stayed busy" to every rank's (``lambda ok:
            all(world.allgather_object(ok))``), so that the ranks time a block again together.

    Returns:
        ``({name: [seconds per call, one per round]}, {name: wrong elements over all blocks}))``.
    """
    per_us = _sleep_cycles_per_us()
    budget_us = {}
    for name, fn in variants.items():
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        budget_us[name] = (time.perf_counter() - t0) * 1e6  # an upper bound: the GPU may have made it wait
        torch.cuda.synchronize()
    samples = {name: [] for name in variants}
    wrong = {name: 0 for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            for _attempt in range(4):
                done = torch.cuda.Event()
                torch.cuda._sleep(int(per_us * (2 * budget_us[name] + 1000)))
                done.record()
                t0 = time.perf_counter()
                for _ in range(calls):
                    out = fn()
                elapsed = time.perf_counter() - t0
                busy = not done.query()
                torch.cuda.synchronize()
                if agree is not None:
                    busy = agree(busy)
                if busy:
                    break
                budget_us[name] *= 4
            samples[name].append(elapsed / calls)
            wrong[name] += checks[name](out)
            del out
    return samples, wrong


def host_rows(op: str, samples: dict, wrong: dict, base: str, *, size_bytes: int, count: int, dtype,
              extra: dict, bases: dict | None = None) -> list:
    """Rows of host-time samples (seconds per call, one per round) against ``base`` (torch's equivalent, same
    run): ``time_us`` is the host time of one eager call; ``extra`` gets ``host_us`` (the median), the
    baseline's ``torch_host_us``, ``host_diff_us`` and ``host_ok`` (within ``HOST_MARGIN_US`` of torch).
    The difference is the median over rounds of the variant's time minus torch's in the same round
    (``host_timing`` interleaves them): the machine's drift between rounds cancels out of it. ``bases`` maps a
    variant to another baseline of the same run (torch's equivalent of a pair of launches, say)."""
    bases = bases or {}
    baselines = {base, *bases.values()}
    out = []
    for name, s in samples.items():
        is_base = name in baselines
        own = bases.get(name, base)
        us = summarize(s)["median"] * 1e6
        row_extra = {**extra, "timing": "host enqueue per eager call, GPU busy", "host_us": us}
        if not is_base:
            diff = statistics.median(x - b for x, b in zip(s, samples[own])) * 1e6
            row_extra.update(torch_host_us=summarize(samples[own])["median"] * 1e6, host_diff_us=diff,
                             host_ok=diff <= HOST_MARGIN_US)
        row = make_row(op, name, s, size_bytes=size_bytes, count=count, dtype=dtype, nranks=1, wrong=wrong[name],
                       baseline=None if is_base else own, baseline_samples=None if is_base else samples[own],
                       extra=row_extra)
        row.algbw_GBps = None  # bytes over host time would be no bandwidth
        out.append(row)
    return out


def host_summary(rows) -> str:
    """One line per host-time row of xelink: its host time, torch's, the difference and the target."""
    lines = []
    for r in rows:
        if r.extra.get("host_diff_us") is None:
            continue
        lines.append(f"{r.op:<24} {r.extra.get('shape', ''):>28} {r.path:<24} host {r.extra['host_us']:6.1f} us, "
                     f"{r.baseline} {r.extra['torch_host_us']:6.1f} us, diff {r.extra['host_diff_us']:+6.1f} us "
                     f"({'ok' if r.extra['host_ok'] else 'over'} the +{HOST_MARGIN_US:.0f} us target)")
    return "\n".join(lines)


class KernelReport:
    """Rows and notes a GPU kernel benchmark collects (``add(row)``, ``notes.append(line)``)."""

    def __init__(self):
        self.rows, self.notes = [], []

    def add(self, row) -> None:
        self.rows.append(row)


def with_host_rows(ctx, report: KernelReport, summary: str, run_host, progress=None) -> list:
    """A GPU family's rows followed by its host-time rows: ``run_host(report, rounds=..., progress=...)``
    (9 rounds under --quick, else 15) fills a report of its own; ``summary`` (the family's), the host
    summary and the family's notes go to ``ctx.notes``."""
    host = KernelReport()
    run_host(host, rounds=9 if ctx.quick else 15, progress=progress)
    ctx.notes += [summary, host_summary(host.rows)] + report.notes
    return report.rows + host.rows


def add_timing_arguments(p, *, cpu: str, gpu: str) -> None:
    """``--iters`` and ``--rounds`` (default None: the family's own counts, described by ``cpu`` and ``gpu``)."""
    p.add_argument("--iters", type=at_least(1), help=f"timed calls per variant per round (CPU: {cpu}; CUDA: {gpu})")
    p.add_argument("--rounds", type=at_least(1), help="rounds, variants interleaved (default: as --iters says)")


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


def run_single_device(ctx, *, cpu, gpu) -> list:
    """Run ``gpu(ctx)`` on a CUDA rank 0, else ``cpu(ctx)``, while the other ranks wait; rows on rank 0.

    Args:
        ctx: the family's ``suite.Context``.
        cpu, gpu: functions of ctx returning rows (rank 0 only). (Options only ``gpu`` uses belong in the family's
            ``harness.CUDA_ONLY`` argument group: the suite refuses them on other devices before anything runs.)

    Returns:
        the rows on rank 0, [] on the other ranks.

    Collective: every rank of the world must call this.
    """
    cuda = getattr(ctx.world.device, "type", "cpu") == "cuda"
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

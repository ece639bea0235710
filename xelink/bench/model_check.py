"""Check the cost model against measurements: predicted and measured time of each collective algorithm.

Run under a launcher: ``mpiexec -n 4 xelink bench model-check --jsonl model_check.jsonl``. In one run it
probes the job (``xelink bench probe``; or loads a probe's ``--topology``/``--calibration`` files), then
times every op x algorithm at every size through the public API with ``algo=`` named (co-measured,
interleaved, max over ranks per sample, median; outputs of the timed runs checked), and prints, next to
each measurement, what the cost model predicts from the probe's figures alone: nothing is fitted to the
rows. A row agrees when ``|predicted / measured - 1| <= tolerance`` (default 0.30).

Rows are classed by what the model says sets their time: *bandwidth-bound* when at least half of the
predicted time grows with the bytes (link and device bandwidths, local copies and reductions),
*latency-bound* otherwise (software overhead per call/step/message, link latencies). The exit status is
0 whatever the agreement (it is a report); 1 only when a timed run produced a wrong result.
"""
from __future__ import annotations

import argparse
import dataclasses
import os

import torch

from .. import cost
from ..topology import Placement, Topology
from .families.collectives import OPS as ALL_OPS
from .families.collectives import algorithms, copy_in_s, measure_case, model_algo
from .harness import JsonlWriter, at_least, make_row, manifest
from .probe import add_arguments, calibrated, cpu_snapshot, job_placement, other_cpu, report, run_probe

__all__ = ["CheckRow", "OPS", "SIZES", "run_check", "format_check", "summary", "main"]

OPS = ("all_reduce", "all_gather", "reduce_scatter")
KiB, MiB = 1 << 10, 1 << 20
SIZES = (KiB, 16 * KiB, MiB, 4 * MiB, 16 * MiB)
TOLERANCE = 0.30


@dataclasses.dataclass
class CheckRow:
    """One (op, algo, size): the measured row and what the model predicted for it.

    ``ratio`` is predicted / measured (1: exact; < 1: the model predicts too little); ``within`` says
    whether ``|ratio - 1| <= tolerance`` (None at one rank, where the model predicts no time);
    ``other_cpu`` the share of the host's CPU other processes took while the row was measured.
    """

    row: object  # harness.Row, with predicted_us set
    predicted_us: float
    links_only_us: float
    ratio: float | None
    within: bool | None
    size_class: str
    bottleneck: str
    other_cpu: float | None = None


def _predict(topology: Topology, placement: Placement, calibration, op: str, algo: str, nbytes: int):
    return cost.predict(topology, placement, op, algo, nbytes, calibration)


def run_check(comm, topology: Topology, placement: Placement, calibration: cost.Calibration, *,
              base_topology: Topology | None = None, ops=OPS, sizes=SIZES, dtype=torch.float32,
              warmup: int = 2, iters: int = 10, rounds: int = 3, tolerance: float = TOLERANCE) -> list[CheckRow]:
    """Time every algorithm of ``ops`` at every size and price it with the model; rows on every rank.

    Args:
        comm: the job's communicator.
        topology, placement, calibration: what the model prices with (a probe's ``calibrated``).
        base_topology: the topology before calibration, for the links-only column (default: ``topology``).
        ops: ops of the collectives family (``families.collectives.OPS``); sizes: bytes, nccl-tests convention.

    all_reduce is timed as ``xelink bench collectives`` times it, copying the user's input into the
    buffer first (the collective is in place); its prediction adds that copy at the probe's copy
    bandwidth of the slowest device. On CUDA ranks the tensors are on the GPUs, each call is timed with
    CUDA events (eager), and the algorithms are the GPU ones the model has a schedule for, priced under
    the model's schedule for it (the registry's ``schedule``, through ``families.collectives.model_algo``).

    Collective: every rank of ``comm`` must call this with the same arguments.
    """
    n = comm.size
    base = base_topology or topology
    base_placement = Placement(base, placement.devices)
    item = torch.tensor([], dtype=dtype).element_size()
    out = []
    for op in ops:
        # On CUDA ranks the GPU algorithms (every registered one names its schedule).
        algos = [a for a in algorithms(comm, op) if model_algo(comm, op, a) is not None]
        for nbytes in sizes:
            before = cpu_snapshot()
            src, buf, samples, wrong = measure_case(comm, op, nbytes, dtype, warmup=warmup, iters=iters,
                                                    rounds=rounds, algos=algos)
            others = other_cpu(comm, before, cpu_snapshot())
            size = (buf if op == "all_gather" else src).numel() * item
            copy_in = copy_in_s(calibration, placement, size) if op == "all_reduce" else 0.0
            for a in algos:
                pred = _predict(topology, placement, calibration, op, model_algo(comm, op, a), size)
                links = _predict(base, base_placement, None, op, model_algo(comm, op, a), size)
                predicted_us = (pred.time_s + copy_in) * 1e6
                row = make_row(op, f"xelink:{a}", samples[f"xelink:{a}"], size_bytes=size, count=src.numel(),
                               dtype=dtype, nranks=n, wrong=wrong[f"xelink:{a}"], predicted_us=predicted_us)
                ratio = predicted_us / row.time_us if n > 1 and row.time_us > 0 else None
                within = None if ratio is None else abs(ratio - 1) <= tolerance
                fixed = pred.overhead_s + pred.latency_s
                size_class = "bandwidth" if pred.time_s + copy_in > 0 and \
                    (pred.time_s + copy_in - fixed) >= 0.5 * (pred.time_s + copy_in) else "latency"
                row.extra.update({"predicted_links_only_us": links.time_s * 1e6, "ratio_pred_over_meas": ratio,
                                  "within": within, "tolerance": tolerance, "size_class": size_class,
                                  "bottleneck": pred.bottleneck, "overhead_us": pred.overhead_s * 1e6,
                                  "latency_us": pred.latency_s * 1e6, "local_us": pred.local_s * 1e6 + copy_in * 1e6,
                                  "copy_in_us": copy_in * 1e6, "topology": topology.name,
                                  "model_algo": model_algo(comm, op, a),
                                  "calibration": calibration.name, "other_cpu": others})
                out.append(CheckRow(row, predicted_us, links.time_s * 1e6, ratio, within, size_class,
                                    pred.bottleneck, others))
    return out


def _us(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def format_check(rows: list[CheckRow], tolerance: float = TOLERANCE) -> str:
    """The table: op, algo, size, predicted, measured (median of max over ranks), ratio, agreement."""
    header = ["op", "algo", "size(B)", "class", "pred(us)", "meas(us)", "pred/meas", f"within±{tolerance:.0%}",
              "links-only(us)", "bottleneck", "other-cpu", "#wrong"]
    lines = [header]
    for c in rows:
        r = c.row
        lines.append([r.op, r.path.split(":", 1)[1], str(r.size_bytes), c.size_class, _us(c.predicted_us),
                      _us(r.time_us), "-" if c.ratio is None else f"{c.ratio:.2f}",
                      "n/a" if c.within is None else ("yes" if c.within else "NO"), _us(c.links_only_us),
                      c.bottleneck, "-" if c.other_cpu is None else f"{c.other_cpu:.0%}", str(r.wrong)])
    widths = [max(len(x[i]) for x in lines) for i in range(len(header))]
    left = {0, 1, 3, 7, 9}
    return "\n".join("  ".join(x.ljust(w) if i in left else x.rjust(w) for i, (x, w) in enumerate(zip(cells, widths)))
                     .rstrip() for cells in lines)


def summary(rows: list[CheckRow], tolerance: float = TOLERANCE) -> str:
    """One line: how many rows agree within the tolerance, overall and per size class."""
    judged = [c for c in rows if c.within is not None]
    if not judged:
        return "summary: no row to judge (one rank: the model predicts no communication)"
    parts = []
    for cls in ("bandwidth", "latency"):
        got = [c for c in judged if c.size_class == cls]
        if got:
            parts.append(f"{cls}-bound {sum(c.within for c in got)}/{len(got)}")
    ratios = sorted(c.ratio for c in judged)
    mid = ratios[len(ratios) // 2]
    others = sorted(c.other_cpu for c in judged if c.other_cpu is not None)
    load = f"; other processes took {others[len(others) // 2]:.0%} of the CPU (median over rows)" if others else ""
    return (f"summary: {sum(c.within for c in judged)}/{len(judged)} rows within ±{tolerance:.0%} "
            f"({', '.join(parts)}); median predicted/measured {mid:.2f}, range {ratios[0]:.2f}-{ratios[-1]:.2f}{load}")


def _load_or_probe(world, args):
    """(calibrated topology, placement, calibration, base topology, probe result or None). Collective."""
    base, placement = job_placement(world, None, None)
    if args.calibration:
        cal = cost.load_calibration(args.calibration)
        from ..topology import load

        topo = load(args.topology) if args.topology else base
        return topo, Placement(topo, placement.devices), cal, base, None
    if args.topology:
        raise ValueError("model-check: --topology needs --calibration (or leave both out to probe now)")
    result = run_probe(world, args)
    topo, cal = calibrated(result, base, placement)
    return topo, Placement(topo, placement.devices), cal, base, result


def main(argv=None) -> int:
    import xelink

    p = argparse.ArgumentParser(prog="xelink bench model-check", description=__doc__.splitlines()[0])
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=ALL_OPS)
    p.add_argument("--sizes", nargs="+", type=cost.parse_size, default=list(SIZES),
                   help="sizes in bytes (suffixes K, M, G allowed), nccl-tests convention")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "int32", "int64"])
    p.add_argument("--check-iters", type=int, default=10, help="timed calls per variant per round")
    p.add_argument("--check-rounds", type=int, default=3, help="rounds of the interleaved timing")
    p.add_argument("--warmup", type=at_least(0), default=2)
    p.add_argument("--tolerance", type=float, default=TOLERANCE, help="agreement bound on |pred/meas - 1|")
    p.add_argument("--calibration", metavar="PATH", help="use this probe calibration instead of probing now")
    p.add_argument("--topology", metavar="PATH", help="with --calibration: the probe's calibrated topology")
    p.add_argument("--jsonl", metavar="PATH", help="write result rows (with the run manifest) here")
    p.add_argument("--probe-json", metavar="PATH", help="write the probe's measurements (JSON) here")
    add_arguments(p)
    args = p.parse_args(argv)
    world = xelink.init()
    topo, placement, cal, base, result = _load_or_probe(world, args)
    rows = run_check(world, topo, placement, cal, base_topology=base, ops=args.ops, sizes=args.sizes,
                     dtype=getattr(torch, args.dtype), warmup=args.warmup, iters=args.check_iters,
                     rounds=args.check_rounds, tolerance=args.tolerance)
    if world.rank == 0:
        load = os.getloadavg()
        if result is not None:
            report(result, topo, cal, args, args.probe_json)
        print(f"# {world.size} rank(s), {world.launch.launcher}, {os.cpu_count()} core(s), load average "
              f"{load[0]:.2f}; model: topology {topo.name} + calibration {cal.name} (call {cal.call_us:.1f} us, "
              f"step {cal.step_us:.1f} us, message {cal.message_us:.1f} us); pred/meas = predicted / measured "
              f"(median of the max over ranks); all_reduce rows include the copy-in of the input")
        print(format_check(rows, args.tolerance))
        print(summary(rows, args.tolerance))
        if args.jsonl:
            extra = {"family": "model-check", "topology": topo.name, "loadavg": list(load),
                     "cpu_count": os.cpu_count(), "calibration": _figures(topo, placement, cal)}
            with JsonlWriter(args.jsonl, manifest(world, extra=extra)) as w:
                for c in rows:
                    w.write(c.row)
            print(f"rows written to {args.jsonl}")
    bad = sum(c.row.wrong for c in rows)
    xelink.finalize()
    return 1 if bad else 0


def _figures(topology: Topology, placement: Placement, cal: cost.Calibration) -> dict:
    """The figures the model priced with, small enough for every row's manifest."""
    used = set(placement.devices)
    links = {}
    for a in range(placement.nranks):
        for b in range(a + 1, placement.nranks):
            if placement.devices[a] != placement.devices[b]:
                link = topology.route(placement.devices[a], placement.devices[b])[0]
                links[link.name] = {"latency_us": link.latency_us, "bandwidth_gbps": link.bandwidth_gbps}
    return {"name": cal.name, "call_us": cal.call_us, "step_us": cal.step_us, "message_us": cal.message_us,
            "copy_gbps": cal.local.copy_gbps, "reduce_gbps": cal.local.reduce_gbps, "links": links,
            "injection_gbps": {d.id: d.injection_gbps for d in topology.devices if d.id in used}}


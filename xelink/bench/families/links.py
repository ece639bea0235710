"""Link benchmark (``xelink bench links``): latency and bandwidth between every pair of ranks, as a matrix.

Built on the probe (``xelink/bench/probe.py``): one ``probe(every_pair=True)`` measures every pair of ranks on
different devices (the others wait), at every size, all interleaved, next to the probe's other
measurements (injection under load, software per call/step/message, local copy and sum). On CPU ranks a
pair ping-pongs through xelink's transport step; on CUDA ranks one rank pulls device memory from the
other through xelink's peer memory (CUDA IPC, the copy engine: one way per copy), and NCCL send/recv
ping-pongs between the same pairs are co-measured as the baseline (rows ``nccl:send/recv``, and the
ratio beside xelink's). Per pair: one-way latency at the smallest size (less the bytes at the fitted
bandwidth) and the bandwidth of ``alpha + bytes/beta``.

Rank 0 prints the two matrices and one row per pair and size (``p2p``, one-way time), draws the
heatmap, and writes the measured topology (``--topology-out``, TOML: each link's figures from its first
pair) and the probe's calibration (``--calibration-out``), which ``xelink bench collectives
--calibration`` prices its predictions with (on CUDA ranks: ``xelink bench model-check --calibration``,
since the figures describe the GPUs). On MPI no baseline is co-measured: the transport step is MPI's own
Isend/Irecv.
"""
from __future__ import annotations

import json

from ... import cost
from .. import probe as P
from ..harness import at_least, make_row, on_cuda, one_gpu_per_rank

__all__ = ["add_arguments", "run", "matrices", "format_matrix"]


def add_arguments(p) -> None:
    """The options of ``xelink bench links``."""
    p.add_argument("--sizes", nargs="+", type=cost.parse_size,
                   help="ping-pong sizes in bytes (default: the probe's, 8 B to 16 MiB; quick 8 B and 256 KiB; "
                        "CUDA 8 B to 128 MiB, quick 8 B to 32 MiB)")
    p.add_argument("--iters", type=at_least(1), help="timed calls per round (default 5; quick 3)")
    p.add_argument("--rounds", type=at_least(1), help="rounds, every pair and size interleaved (default 5; quick 2)")
    p.add_argument("--topology-out", metavar="PATH", help="write the measured topology (TOML) here")
    p.add_argument("--calibration-out", metavar="PATH", help="write the probe's calibration (TOML) here")
    p.add_argument("--probe-json", metavar="PATH", help="write every probe measurement (JSON) here")


def matrices(n: int, pairs: list) -> tuple[list, list]:
    """(latency us, bandwidth GB/s) as n x n lists from ``probe.pair_results``; None where unmeasured."""
    lat = [[None] * n for _ in range(n)]
    bw = [[None] * n for _ in range(n)]
    for p in pairs:
        a, b = p["pair"]
        lat[a][b] = lat[b][a] = p["latency_us"]
        bw[a][b] = bw[b][a] = p["fit"].gbps
    return lat, bw


def format_matrix(grid: list, title: str, spec: str) -> str:
    """A square matrix as text, ranks along both sides, ``-`` where unmeasured."""
    n = len(grid)
    cells = [["-" if v is None else format(v, spec) for v in row] for row in grid]
    width = max([len(c) for row in cells for c in row] + [len(str(n - 1)) + 1])
    lines = [title, " " * 5 + "".join(f"{b:>{width + 2}}" for b in range(n))]
    lines += [f"{a:>5}" + "".join(f"{c:>{width + 2}}" for c in row) for a, row in enumerate(cells)]
    return "\n".join(lines)


def run(ctx) -> list:
    """Measure every pair (collective); rows on every rank, outputs written by rank 0."""
    world, args = ctx.world, ctx.args
    topology, placement = P.job_placement(world)
    pairs = P.all_pairs(placement)
    opts = P.defaults(world, ctx.quick)
    for key in ("iters", "rounds"):
        if getattr(args, key) is not None:
            opts[key] = getattr(args, key)
    if args.sizes:
        opts["pingpong_sizes"] = tuple(args.sizes)
    sizes = tuple(opts.get("pingpong_sizes", P.PINGPONG_SIZES))
    progress = ctx.progress(1)
    result = P.probe(world, every_pair=True, **opts)
    if on_cuda(world) and world.size > 1 and not one_gpu_per_rank(world) and ctx.lead:
        ctx.notes.append(f"the NCCL send/recv baseline left out: {world.size} ranks share a GPU, and NCCL needs one "
                         f"GPU per rank")
    measured, path = result.pairs, result.method
    topo, cal = P.calibrated(result, topology, placement)
    progress.step(f"{len(measured)} pair(s) x {len(sizes)} size(s) measured")
    link_of = {}
    for a, b in pairs:
        link_of[a, b] = topology.route(placement.devices[a], placement.devices[b])[0].name
    timing = "one way = round trip / 2" if path == "xelink:pingpong" else "one way per copy"
    rows = []
    baseline = {tuple(p["pair"]): p for p in result.baseline_pairs}
    for p in measured:
        a, b = p["pair"]
        base = baseline.get((a, b))
        for size, samples in p["one_way_s"]:
            base_samples = None if base is None else dict(base["one_way_s"])[size]
            rows.append(make_row("p2p", path, samples, size_bytes=size, count=size, dtype="uint8", nranks=2,
                                 baseline=None if base is None else "nccl:send/recv", baseline_samples=base_samples,
                                 extra={"pair": [a, b], "link": link_of[a, b], "latency_us": p["latency_us"],
                                        "bandwidth_gbps": p["fit"].gbps, "timing": timing}))
        if base is not None:
            for size, samples in base["one_way_s"]:
                rows.append(make_row("p2p", "nccl:send/recv", samples, size_bytes=size, count=size, dtype="uint8",
                                     nranks=2, extra={"pair": [a, b], "link": link_of[a, b],
                                                      "latency_us": base["latency_us"],
                                                      "bandwidth_gbps": base["fit"].gbps,
                                                      "timing": "one way = round trip / 2"}))
    if ctx.lead:
        _report(ctx, world, topo, cal, result, measured, path)
    return rows


def _report(ctx, world, topo, cal, result, measured, path) -> None:
    from ..suite import plots_dir

    args = ctx.args
    lat, bw = matrices(world.size, measured)
    where = f"{world.size} rank(s) on {', '.join(dict.fromkeys(world.hosts))}, device {world.device}"
    ctx.header = "\n\n".join([
        f"# links: {path} between every pair of ranks, {where}; "
        + ("one way = round trip / 2" if path == "xelink:pingpong" else "one way per copy; baseline NCCL send/recv "
           "ping-pong, one way = round trip / 2, ratio = NCCL time / xelink time"),
        format_matrix(lat, "one-way latency (us), smallest size less its bytes at the fitted bandwidth", ".1f"),
        format_matrix(bw, "bandwidth (GB/s, one way), beta of alpha + bytes/beta over the sizes", ".2f"),
        "rows: one-way time of each pair at each size (median of the slower rank):"])
    if result is not None:
        ctx.notes.append(P.format_result(result))
    if not measured:
        ctx.notes.append("links: no pair of ranks on different devices (one rank, or every rank on one device)")
    if args.topology_out:
        from ...topology import save

        save(topo, args.topology_out)
        ctx.notes.append(f"measured topology written to {args.topology_out}")
    if args.calibration_out and cal is not None:
        cost.save_calibration(cal, args.calibration_out)
        ctx.notes.append(f"calibration written to {args.calibration_out}")
    if args.probe_json and result is not None:
        with open(args.probe_json, "w", encoding="utf-8") as f:
            json.dump(result.to_dict(), f, indent=1)
        ctx.notes.append(f"probe measurements written to {args.probe_json}")
    folder = plots_dir(ctx)
    if folder is not None and measured:
        from .. import plots

        if plots.available():
            png = plots.plot_link_matrix(lat, bw, folder / "links-matrix.png", f"links: {path}, {where}")
            ctx.notes.append(f"heatmap written to {png}")
        else:
            ctx.notes.append("links: heatmap skipped: matplotlib is not installed (pip install \"xelink[bench]\")")


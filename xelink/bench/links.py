"""Link benchmark (``xelink bench links``): latency and bandwidth between every pair of ranks, as a matrix.

Built on the probe (``probe.py``): on CPU ranks one ``probe(every_pair=True)`` ping-pongs every pair of
ranks on different devices through xelink's transport step (the others wait), at every size, all
interleaved, next to the probe's other measurements (injection under load, software per call/step/
message, local copy and sum); on CUDA ranks the same ping-pong moves device memory with NCCL send/recv
(``torch.distributed``), and the probe's host-side figures are left out. Per pair: one-way latency at
the smallest size (less the bytes at the fitted bandwidth) and the bandwidth of ``alpha + bytes/beta``.

Rank 0 prints the two matrices and one row per pair and size (``p2p``, one-way time), draws the
heatmap, and writes the measured topology (``--topology-out``, TOML: each link's figures from its first
pair) and the probe's calibration (``--calibration-out``), which ``xelink bench collectives
--calibration`` prices its predictions with. No baseline is co-measured: on MPI the transport step is
MPI's own Isend/Irecv, and on CUDA the path timed is NCCL's.
"""
from __future__ import annotations

import datetime
import json

from .. import cost
from . import probe as P
from .harness import make_row

__all__ = ["add_arguments", "run", "main", "matrices", "format_matrix", "GPU_SIZES", "GPU_QUICK_SIZES"]

MiB = 1 << 20
GPU_SIZES = (8, MiB, 16 * MiB, 128 * MiB)
GPU_QUICK_SIZES = (8, 16 * MiB)


def add_arguments(p, family: str) -> None:
    p.add_argument("--sizes", nargs="+", type=cost.parse_size,
                   help="ping-pong sizes in bytes (default: the probe's, 8 B to 16 MiB; quick 8 B and 256 KiB; "
                        "CUDA 8 B to 128 MiB)")
    p.add_argument("--iters", type=int, help="timed calls per round (default 5; quick 3)")
    p.add_argument("--rounds", type=int, help="rounds, every pair and size interleaved (default 5; quick 2)")
    p.add_argument("--topology-out", metavar="PATH", help="write the measured topology (TOML) here")
    p.add_argument("--calibration-out", metavar="PATH", help="write the probe's calibration (TOML; CPU ranks) here")
    p.add_argument("--probe-json", metavar="PATH", help="write every probe measurement (JSON) here")


def _nccl_move(world):
    """A probe step (``move(sends, recvs)``) that moves CUDA tensors with NCCL send/recv."""
    import torch
    import torch.distributed as dist

    pg = world.process_group()
    # The first NCCL call of a group must include every rank (torch's rule for point-to-point).
    dist.all_reduce(torch.zeros(1, device=world.device), group=pg)

    def move(sends, recvs):
        for peer, buf in sends:
            dist.send(buf, peer, group=pg)
        for peer, buf in recvs:
            dist.recv(buf, peer, group=pg)

    return move


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


def run(ctx, family: str) -> list:
    """Measure every pair (collective); rows on every rank, outputs written by rank 0."""
    world, args = ctx.world, ctx.args
    topology, placement = P.job_placement(world)
    pairs = P.all_pairs(placement)
    opts = dict(P.QUICK) if ctx.quick else {}
    for key in ("iters", "rounds"):
        if getattr(args, key) is not None:
            opts[key] = getattr(args, key)
    cuda = getattr(world.device, "type", "cpu") == "cuda"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    progress = ctx.progress(1)
    result = cal = None
    if cuda:
        sizes = tuple(args.sizes or (GPU_QUICK_SIZES if ctx.quick else GPU_SIZES))
        measured = P.measure_pairs(world, pairs, sizes, iters=opts.get("iters", 5), rounds=opts.get("rounds", 5),
                                   move=_nccl_move(world)) if pairs else []
        path = "nccl:send/recv"
        first = {tuple(p["pair"]): p for p in measured}
        links = {name: first[ab] for name, ab in P._link_pairs(topology, placement).items()}
        stamp = (f"measured here: by `xelink bench links` on {date}, {', '.join(dict.fromkeys(world.hosts))}, "
                 f"{world.size} rank(s), NCCL send/recv")
        topo = P.calibrated_topology(topology, placement, links, None, stamp)
    else:
        if args.sizes:
            opts["pingpong_sizes"] = tuple(args.sizes)
        sizes = tuple(opts.get("pingpong_sizes", P.PINGPONG_SIZES))
        result = P.probe(world, every_pair=True, **opts)
        measured, path = result.pairs, "xelink:pingpong"
        topo, cal = P.calibrated(result, topology, placement)
    progress.step(f"{len(measured)} pair(s) x {len(sizes)} size(s) measured")
    link_of = {}
    for a, b in pairs:
        link_of[a, b] = topology.route(placement.devices[a], placement.devices[b])[0].name
    rows = []
    for p in measured:
        a, b = p["pair"]
        for size, samples in p["one_way_s"]:
            rows.append(make_row("p2p", path, samples, size_bytes=size, count=size, dtype="uint8", nranks=2,
                                 extra={"pair": [a, b], "link": link_of[a, b], "latency_us": p["latency_us"],
                                        "bandwidth_gbps": p["fit"].gbps, "timing": "one way = round trip / 2"}))
    if ctx.lead:
        _report(ctx, world, topo, cal, result, measured, path)
    return rows


def _report(ctx, world, topo, cal, result, measured, path) -> None:
    from .suite import plots_dir

    args = ctx.args
    lat, bw = matrices(world.size, measured)
    where = f"{world.size} rank(s) on {', '.join(dict.fromkeys(world.hosts))}, device {world.device}"
    ctx.header = "\n\n".join([
        f"# links: {path} ping-pong between every pair of ranks, {where}; one way = round trip / 2",
        format_matrix(lat, "one-way latency (us), smallest size less its bytes at the fitted bandwidth", ".1f"),
        format_matrix(bw, "bandwidth (GB/s, one way), beta of alpha + bytes/beta over the sizes", ".2f"),
        "rows: one-way time of each pair at each size (median of the slower rank):"])
    if result is not None:
        ctx.notes.append(P.format_result(result))
    if not measured:
        ctx.notes.append("links: no pair of ranks on different devices (one rank, or every rank on one device)")
    if args.topology_out:
        from ..topology import save

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
        from . import plots

        if plots.available():
            png = plots.plot_link_matrix(lat, bw, folder / "links-matrix.png", f"links: {path} ping-pong, {where}")
            ctx.notes.append(f"heatmap written to {png}")
        else:
            ctx.notes.append("links: heatmap skipped: matplotlib is not installed (pip install \"xelink[bench]\")")


def main(argv=None) -> int:
    from .suite import main as run_family

    return run_family("links", argv)

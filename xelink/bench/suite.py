"""The suite's runner: ``xelink bench <family>`` for one family, ``xelink bench all`` for every family
this machine can run, in one launch, into one results folder (the command line is ``cli.py``).

Families (each a module of ``xelink.bench.families`` with ``add_arguments(parser)`` and
``run(ctx) -> rows``):

- ``links``: latency and bandwidth between every pair of ranks (a matrix, from the probe: a ping-pong
  through the transport on CPU ranks, copy-engine pulls through xelink's peer memory next to NCCL
  send/recv on CUDA ranks), the calibrated topology and the probe's calibration.
- ``collectives``: every op x algorithm over a size sweep next to MPI's own collective (CPU ranks) or
  NCCL (CUDA ranks: device tensors, xelink's GPU algorithms), with the cost model's prediction beside
  each row, priced with the links family's calibration.
- ``gemm``, ``gemv``, ``norm``, ``attention``, ``decode``: on CPU the kernels' reference paths against
  torch at small shapes (``decode``: the decode layer's kernel chain and a Llama decode step); on CUDA the
  GPU kernel benchmarks, rank 0 alone (``kernel_timing.run_single_device``).
- ``dist-gemm``: the distributed GEMM ops, every algorithm against the GEMM alone, the launch's
  collective then ``torch.matmul``, and (one GPU per rank) torch's fused ops.
- ``gpu-collectives``: xelink's GPU collectives against NCCL and torch symmetric memory (CUDA only).

Output, rank 0 only: the table on stdout, a progress line per step on stderr, and with ``--out DIR``
(``all``: always) ``<family>.jsonl`` (rows with the run manifest) and ``<family>.txt`` (the table);
``--csv`` adds ``<family>.csv``; ``--plots`` PNGs (``all``: always, into the results folder).
Run under a launcher for several ranks: ``mpiexec -n 4 xelink bench all --quick --out results``.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import io
import os
import sys
import time
from pathlib import Path

from .harness import (CUDA_ONLY, JsonlWriter, Progress, Row, Unavailable, format_table, manifest, on_cuda,
                      one_gpu_per_rank, write_csv)

__all__ = ["FAMILIES", "ALL_ORDER", "Family", "Context", "add_output_arguments", "all_families", "check_output_paths",
           "family_parser", "main", "main_all", "plots_dir", "write_outputs"]


@dataclasses.dataclass(frozen=True)
class Family:
    """A benchmark family of the table.

    Fields:
        name: what ``xelink bench`` takes.
        module: its module, relative to ``xelink.bench`` (``families.<name>``, with ``add_arguments``/``run``).
        summary: one line for the help and the ``all`` report.
        cuda_only: every rank needs a CUDA GPU of its own (NCCL is its baseline; skipped with the reason
            elsewhere, and where ranks share a GPU).
        sycl_only: needs dpctl and a SYCL device (``xelink.symm.sycl.available``; skipped with the reason
            elsewhere); runs on rank 0 alone (the SYCL backend is one process).
        plot: ``"sweep"`` (lines versus size), ``"kernels"`` (bars per shape) or ``"links"`` (its own).
    """

    name: str
    module: str
    summary: str
    cuda_only: bool = False
    plot: str = "sweep"
    sycl_only: bool = False


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("links", "families.links", "latency and bandwidth between every pair of ranks (matrix, heatmap, "
                                      "measured topology TOML, probe calibration)", plot="links"),
    Family("collectives", "families.collectives", "every collective op x algorithm over a size sweep vs MPI's own "
                                                  "(NCCL on CUDA), with the cost model's prediction"),
    Family("gemm", "families.gemm", "GEMM: reference path vs torch.matmul on CPU; Triton kernels on CUDA",
           plot="kernels"),
    Family("gemv", "families.gemv", "GEMV bf16/W8A16/W4A16: reference path vs torch.matmul on CPU; Triton on CUDA",
           plot="kernels"),
    Family("norm", "families.norm", "RMSNorm (+ residual) and RoPE: reference path vs torch on CPU; Triton vs torch "
                                    "and copy_ on CUDA", plot="kernels"),
    Family("attention", "families.attention", "flash/decode attention: reference path vs SDPA on CPU; Triton on "
                                              "CUDA", plot="kernels"),
    Family("decode", "families.decode", "a decode layer's kernel chain (W4A16; PDL on/off in a CUDA graph on CUDA) "
                                        "and a whole Llama decode step (xelink's graph vs torch's, transformers) "
                                        "against plain torch", plot="kernels"),
    Family("dist-gemm", "families.dist_gemm", "distributed GEMM (all_gather_matmul, matmul_reduce_scatter), every "
                                              "algorithm vs the GEMM alone, collective then matmul, torch's fused ops",
           plot="kernels"),
    Family("cp-attention", "families.cp_attention", "context-parallel attention (ring, all_gather) vs one device's "
                                                    "flash attention, a blocking ring, all-gather then SDPA",
           plot="kernels"),
    Family("gpu-collectives", "families.gpu_collectives", "GPU collectives vs NCCL and torch symmetric memory",
           cuda_only=True),
    Family("sycl-collectives", "families.sycl_collectives", "xelink.sycl (one process, several SYCL queues through "
                                                            "dpctl) vs host numpy, with the cost model",
           sycl_only=True),
)}
# ``all`` runs links first: its calibration prices the collectives.
ALL_ORDER = ("links", "collectives", "dist-gemm", "cp-attention", "gemm", "gemv", "norm", "attention", "decode",
             "gpu-collectives", "sycl-collectives")
# How long the other ranks wait while rank 0 alone runs a single-device family (GPU kernel benchmarks
# compile and sweep for many minutes); a rank that fails aborts the job, so nobody waits for nothing.
SOLO_WAIT_S = 3 * 3600.0


def add_output_arguments(p: argparse.ArgumentParser) -> None:
    """The options every family takes: --quick, --out, --jsonl, --csv, --plots."""
    g = p.add_argument_group("output (rank 0)")
    g.add_argument("--quick", action="store_true", help="fewer sizes, shapes and samples (the quick suite)")
    g.add_argument("--out", metavar="DIR", help="results folder: <family>.jsonl and <family>.txt (and CSV, plots)")
    g.add_argument("--jsonl", metavar="PATH", help="write the rows (with the run manifest) here (default with "
                                                   "--out: DIR/<family>.jsonl)")
    g.add_argument("--csv", nargs="?", const=True, default=None, metavar="PATH",
                   help="also write the rows as CSV (PATH, else DIR/<family>.csv, else ./<family>.csv)")
    g.add_argument("--plots", nargs="?", const=True, default=None, metavar="DIR",
                   help="write PNG plots into DIR (default: the --out folder, else the current folder)")
    g.add_argument("--commit", metavar="SHA", help="record this commit in the manifest instead of git's HEAD (a copy "
                                                   "of the tree on a GPU machine may carry a stale .git; git's "
                                                   "HEAD is kept as extra.git_head_here)")


def family_parser(name: str) -> argparse.ArgumentParser:
    """The argument parser of ``xelink bench <name>``."""
    fam = FAMILIES[name]
    p = argparse.ArgumentParser(prog=f"xelink bench {name}", description=fam.summary)
    _module(fam).add_arguments(p)
    add_output_arguments(p)
    return p


def cuda_only_given(name: str, args) -> list[str]:
    """The options of family ``name``'s CUDA-only group (``harness.CUDA_ONLY``) that ``args`` sets to other than
    their defaults, as typed (``--impl cuda``, ``--sweep``)."""
    parser = family_parser(name)
    groups = [g for g in parser._action_groups if g.title == CUDA_ONLY]  # (argparse keeps a group's options here)
    given = []
    for a in (a for g in groups for a in g._group_actions):
        value = getattr(args, a.dest, a.default)
        if value != a.default:
            shown = value if isinstance(value, list) else [value]
            given.append(a.option_strings[0] if value is True else " ".join([a.option_strings[0], *map(str, shown)]))
    return given


# Options naming where results go: folders, and files (their folder is checked). Checked at parse time, so that a
# path that cannot be written fails before the measurement, not after it with the results lost.
_OUT_DIRS = ("out", "plots")
_OUT_FILES = ("jsonl", "csv", "tune", "topology_out", "calibration_out")


def check_output_paths(parser: argparse.ArgumentParser, args) -> None:
    """``parser.error`` (exit 2, the option and path named) for an output option whose folder cannot be made or
    written, or a file option naming a folder."""
    for name in _OUT_DIRS + _OUT_FILES:
        value = getattr(args, name, None)
        if not isinstance(value, (str, Path)):
            continue
        path = Path(value)
        option = "--" + name.replace("_", "-")
        if name in _OUT_FILES and path.is_dir():
            parser.error(f"{option} {str(value)!r} is a folder, not a file")
        folder = path if name in _OUT_DIRS else path.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            parser.error(f"{option} {str(value)!r}: cannot make {str(folder)!r} ({exc.strerror or exc})")
        if not os.access(folder, os.W_OK):
            parser.error(f"{option} {str(value)!r}: {str(folder)!r} is not writable")


def _module(fam: Family):
    return importlib.import_module(f".{fam.module}", __package__)


class Context:
    """What a family's ``run`` gets: the world, its parsed options, progress and the output places.

    Attributes:
        world: the xelink world communicator.
        family: the family's name.
        args: its parsed options (``family_parser``).
        out: the results folder, or None.
        notes: lines printed under the table and kept in ``<family>.txt``.
        header: a line (or block) printed above the table.
        extra: fields the family adds to the manifest's ``extra`` (its options, the path it ran).
        failed: set by a family that could not measure (the run's status is then "wrong").
    """

    def __init__(self, world, family: str, args, out=None):
        self.world, self.family, self.args = world, family, args
        self.lead = world.rank == 0
        self.out = Path(out) if out else (Path(args.out) if args.out else None)
        self.notes: list[str] = []
        self.extra: dict = {}
        self.failed = False
        self.header = ""

    @property
    def quick(self) -> bool:
        return bool(self.args.quick)

    def progress(self, total: int | None) -> Progress:
        return Progress(self.family, total, show=self.lead)

    def path(self, suffix: str) -> Path | None:
        """``<out>/<family><suffix>``, or None without a results folder."""
        return None if self.out is None else self.out / f"{self.family}{suffix}"

    def solo(self, fn):
        """Run ``fn()`` on rank 0 alone (single-device work) while the other ranks wait; its result on rank 0.

        Collective: every rank of the world must call this.
        """
        result = fn() if self.lead else None
        if self.world.size > 1:
            self.world.barrier(timeout=SOLO_WAIT_S)
        return result

    def manifest(self, extra=None) -> dict:
        """The run manifest of this family's rows (``harness.manifest``), with ``--commit`` applied."""
        man = manifest(self.world, extra={"family": self.family, "quick": self.quick, **self.extra, **(extra or {})})
        commit = getattr(self.args, "commit", None)
        if commit:
            man["extra"]["git_head_here"] = man["commit"]
            man["commit"] = commit
        return man


def _csv_path(ctx: Context) -> Path | None:
    value = ctx.args.csv
    if value is None:
        return None
    if value is True:
        return ctx.path(".csv") or Path(f"{ctx.family}.csv")
    return Path(value)


def plots_dir(ctx: Context) -> Path | None:
    value = ctx.args.plots
    if value is None:
        return None
    if value is True:
        return ctx.out or Path(".")
    return Path(value)


def write_outputs(ctx: Context, rows: list[Row], extra_manifest=None) -> None:
    """Print the table and write what the options ask for. Rank 0 only."""
    fam = FAMILIES[ctx.family]
    text = io.StringIO()
    if ctx.header:
        print(ctx.header, file=text)
    if rows:
        print(format_table(rows), file=text)
    for note in ctx.notes:
        print(note, file=text)
    table = text.getvalue().rstrip("\n")
    if table:
        print(table, flush=True)
    written = []
    if ctx.out is not None:
        ctx.out.mkdir(parents=True, exist_ok=True)
        ctx.path(".txt").write_text(table + "\n", encoding="utf-8")
        written.append(ctx.path(".txt"))
    jsonl = Path(ctx.args.jsonl) if ctx.args.jsonl else ctx.path(".jsonl")
    if jsonl is not None and rows:
        with JsonlWriter(jsonl, ctx.manifest(extra_manifest)) as w:
            for r in rows:
                w.write(r)
        written.append(jsonl)
    csv = _csv_path(ctx)
    if csv is not None and rows:
        write_csv(rows, csv)
        written.append(csv)
    plots = plots_dir(ctx)
    if plots is not None and rows and fam.plot != "links":
        from . import plots as P

        if not P.available():
            print(f"{ctx.family}: plots skipped: matplotlib is not installed (pip install \"xelink[bench]\")",
                  file=sys.stderr)
        else:
            plot = P.plot_kernels if fam.plot == "kernels" else P.plot_sweep
            written += plot(rows, plots, ctx.family)
    if written:
        print(f"{ctx.family}: wrote {', '.join(map(str, written))}", file=sys.stderr)


def _run_family(ctx: Context) -> tuple[str, list[Row]]:
    """("ok" | "wrong" | "skipped: why", rows) of one family. Collective."""
    fam = FAMILIES[ctx.family]

    def skipped(why: str) -> tuple[str, list[Row]]:
        if ctx.lead:
            print(f"{ctx.family}: skipped: {why}", file=sys.stderr)
        return f"skipped: {why}", []

    if fam.cuda_only and not one_gpu_per_rank(ctx.world):
        return skipped(f"needs one CUDA GPU per rank (this rank's device is {ctx.world.device}" +
                       (f"; {ctx.world.size} ranks share GPUs, and NCCL, the baseline, refuses them)"
                        if on_cuda(ctx.world) else ")"))
    if fam.sycl_only:
        from ..symm import sycl

        if not sycl.available():
            return skipped("needs dpctl and a SYCL device (pip install dpctl intel-opencl-rt: the test extra has them)")
    given = [] if on_cuda(ctx.world) else cuda_only_given(ctx.family, ctx.args)
    if given:  # every rank refuses (the same options), so none waits for another
        raise SystemExit(f"xelink bench {ctx.family}: unrecognized arguments on {ctx.world.device} ranks (options of "
                         f"its CUDA runs only): {' '.join(given)}")
    try:
        rows = _module(fam).run(ctx) or []
    except Unavailable as exc:  # what the family needs, found missing once it looked (the same on every rank)
        return skipped(str(exc))
    if ctx.lead:
        write_outputs(ctx, rows)
    bad = sum(max(r.wrong, 0) for r in rows)
    return ("wrong" if bad or ctx.failed else "ok"), rows


def main(name: str, argv=None) -> int:
    """``xelink bench <name> [options]``: run one family. Returns the exit status (1 if a result was wrong,
    2 if the family cannot run on this machine)."""
    import xelink

    parser = family_parser(name)
    args = parser.parse_args(argv)
    check_output_paths(parser, args)
    world = xelink.init()
    status, _ = _run_family(Context(world, name, args))
    xelink.finalize()
    return 0 if status == "ok" else 2 if status.startswith("skipped") else 1


def _all_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xelink bench all",
                                description="every benchmark family this machine can run, in one launch, into "
                                            "one results folder")
    p.add_argument("--quick", action="store_true", help="the quick suite (under 2 minutes on 4 CPU ranks)")
    p.add_argument("--out", metavar="DIR", default="xelink-results", help="results folder (default xelink-results)")
    p.add_argument("--csv", action="store_true", help="also write <family>.csv")
    p.add_argument("--plots", metavar="DIR", help="write the PNG plots here (default: the results folder)")
    p.add_argument("--no-plots", action="store_true", help="write no plots")
    p.add_argument("--tune", metavar="PATH", help="write the tuning table of the collectives (and, on CUDA, the GPU "
                                                  "collectives) here")
    p.add_argument("--calibration", metavar="PATH", help="price the collectives with this probe calibration "
                                                         "(default: the one the links family measures)")
    p.add_argument("--topology", metavar="PATH", help="with --calibration: the probe's calibrated topology")
    p.add_argument("--only", metavar="FAMILIES", help=f"comma-separated subset of {','.join(ALL_ORDER)}")
    p.add_argument("--commit", metavar="SHA", help="record this commit in every manifest instead of git's HEAD")
    return p


def _family_argv(name: str, args, out: Path, links_here: bool = True) -> list[str]:
    """``links_here``: the links family runs in this launch (its topology and calibration in ``out`` are then
    this job's; files an earlier run left there may be another rank count's and are not taken)."""
    argv = ["--out", str(out)] + (["--quick"] if args.quick else []) + (["--csv"] if args.csv else [])
    argv += ["--commit", args.commit] if getattr(args, "commit", None) else []
    if not args.no_plots:
        argv += ["--plots", str(args.plots or out)]
    if name == "links":
        argv += ["--topology-out", str(out / "topology.toml")]
        if not args.calibration:
            argv += ["--calibration-out", str(out / "calibration.toml")]
    if name == "collectives":
        cal = args.calibration or (out / "calibration.toml" if links_here else None)
        if cal is not None and Path(cal).is_file():
            argv += ["--calibration", str(cal)]
            # The links family's topology goes with its calibration (both measured on the ranks' devices,
            # where the collectives family moves its tensors).
            topo = args.topology or (None if args.calibration else out / "topology.toml")
            if topo is not None and Path(topo).is_file():
                argv += ["--topology", str(topo)]
    if name in ("collectives", "gpu-collectives") and args.tune:
        argv += ["--tune", args.tune]
    return argv


def all_families(only: str | None) -> tuple:
    """The families ``xelink bench all --only`` names (None: every one), in the suite's order (links first: the
    collectives take its calibration), each once; a usage error for a name that is no family."""
    if not only:
        return ALL_ORDER
    listed = {n.strip() for n in only.split(",") if n.strip()}
    unknown = sorted(listed - set(ALL_ORDER))
    if not listed:
        _all_parser().error(f"--only {only!r} names no family (choose from {', '.join(ALL_ORDER)})")
    if unknown:
        _all_parser().error(f"--only: unknown families {unknown} (choose from {', '.join(ALL_ORDER)})")
    return tuple(n for n in ALL_ORDER if n in listed)


def main_all(argv=None) -> int:
    """``xelink bench all``: every family this machine can run, in order, into one results folder.

    Families that need a CUDA GPU are skipped on other machines with the reason. Returns 1 if any result
    was wrong, else 0.
    """
    import xelink

    args = _all_parser().parse_args(argv)
    check_output_paths(_all_parser(), args)
    names = all_families(args.only)
    if args.topology and not args.calibration:
        _all_parser().error("--topology needs --calibration (without both, the links family measures them)")
    out = Path(args.out)
    world = xelink.init()
    lead = world.rank == 0
    where = f"{world.size} rank(s) ({world.launch.launcher}, device {world.device})"
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        if "links" in names:  # the links family writes them for the collectives family: none left from a run before
            for stale in ("topology.toml", "calibration.toml"):
                (out / stale).unlink(missing_ok=True)
    world.barrier()
    if lead:
        print(f"# xelink bench all{' --quick' if args.quick else ''}: {world.size} rank(s), {world.launch.launcher}, "
              f"device {world.device}; results in {out}/", flush=True)
    start = time.perf_counter()
    status = {}
    for name in names:
        if lead:
            print(f"\n## {name}: {FAMILIES[name].summary}", flush=True)
        fargs = family_parser(name).parse_args(_family_argv(name, args, out, "links" in names))
        t0 = time.perf_counter()
        status[name], _ = _run_family(Context(world, name, fargs))
        status[name] += f" ({time.perf_counter() - t0:.1f} s)"
        world.barrier()  # rank 0 wrote the family's files (links: the calibration the next family reads) first
    total = time.perf_counter() - start
    if lead:
        lines = [f"xelink bench all{' --quick' if args.quick else ''} on {where}: {total:.1f} s"] + [f"  {n:<16} {s}" for n, s in status.items()]
        summary = "\n".join(lines)
        print("\n" + summary)
        (out / "summary.txt").write_text(summary + "\n", encoding="utf-8")
    xelink.finalize()
    return 1 if any(s.startswith("wrong") for s in status.values()) else 0


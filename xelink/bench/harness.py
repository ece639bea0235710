"""The benchmark harness core: run manifest, co-measured timing, result rows and their output.

Every benchmark (collectives, kernels, the suite) is built from these pieces:

- ``manifest()`` records what a result depends on: commit, versions, devices, hosts, topology,
  environment knobs, command line and time.
- ``co_measure()`` times xelink's path and the baseline in the same run, interleaved, so both see the
  same machine; ``summarize()`` turns samples into median/min/percentiles.
- ``make_row()`` builds a ``Row`` (what ran, how long, how much bandwidth, how many wrong elements);
  ``JsonlWriter``, ``format_table()`` and ``write_csv()`` write rows out.

Times are seconds inside the harness (samples) and microseconds in rows; bandwidths are GB/s (1e9
bytes per second), as in nccl-tests.
"""
from __future__ import annotations

import csv
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from ..config import at_least, integer  # noqa: F401 (at_least: the families' argparse type, here with the suite's)
from ..tuning import dtype_name

__all__ = [
    "BUSBW_FACTORS",
    "CUDA_ONLY",
    "Unavailable",
    "JsonlWriter",
    "Progress",
    "Row",
    "algbw",
    "at_least",
    "busbw",
    "co_measure",
    "dtype_name",
    "format_table",
    "make_row",
    "manifest",
    "on_cuda",
    "one_gpu_per_rank",
    "poison_unlike",
    "pred_over_meas",
    "rank_max",
    "rank_sums",
    "read_jsonl",
    "summarize",
    "time_cuda_events",
    "time_fn",
    "write_csv",
]

# -- manifest ---------------------------------------------------------------------------------

# Environment variables that change how collectives behave; recorded so a result can be reproduced.
ENV_PREFIXES = ("XELINK_", "NCCL_", "TORCH_SYMM", "MPIR_CVAR", "OMPI_MCA", "GLOO_")
ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None  # no git on this machine, or it hangs: the commit is then "unknown"
    return done.stdout.strip() if done.returncode == 0 else None


def _git_state() -> dict:
    """The commit of the checkout xelink was imported from, or "unknown" if it is not a checkout."""
    package = Path(__file__).resolve().parent.parent
    top = _git(["rev-parse", "--show-toplevel"], package)
    # An installed copy inside some other repository (a venv in a checkout) must not report that
    # repository's commit: only trust git when xelink/ sits at the top of the checkout.
    if top is None or Path(top).resolve() != package.parent:
        return {"commit": "unknown", "dirty": None}
    commit = _git(["rev-parse", "HEAD"], package)
    status = _git(["status", "--porcelain"], package)
    state = {"commit": commit or "unknown", "dirty": None if status is None else status != ""}
    # A working tree copied onto another machine (the GPU runs) keeps the commit it was made from in
    # .commit (git-ignored); there git's HEAD is an older base with the newer files on top of it.
    stamp = package.parent / ".commit"
    if stamp.is_file():
        state["commit_file"] = stamp.read_text().strip()
    return state


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _versions() -> dict:
    import torch

    from xelink import __version__

    out = {
        "xelink": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "mpi4py": _dist_version("mpi4py"),
        "mpi": None,
        # metadata only (importing triton is slow and may fail on CPU); Intel's and torch's builds of the `triton`
        # package are distributions of other names
        "triton": next(filter(None, map(_dist_version, ("triton", "triton-xpu", "pytorch-triton",
                                                         "pytorch-triton-xpu"))), None),
        "cuda": torch.version.cuda,
        "nccl": None,
    }
    # Importing mpi4py.MPI initialises MPI, which a single-process run must not do just to be described.
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        out["mpi"] = " ".join(mpi.Get_library_version().split("\n")[0].split())
    if torch.cuda.is_available():
        version = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return out


def _device_names() -> list[str]:
    import torch

    names = []
    if torch.cuda.is_available():
        names += [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        names += [torch.xpu.get_device_name(i) for i in range(torch.xpu.device_count())]
    return names


def _environment() -> dict:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


def manifest(comm=None, command: str | None = None, extra: Mapping[str, Any] | None = None) -> dict:
    """What a result depends on, as a JSON-ready dict. Local: no communication, no MPI initialisation.

    Args:
        comm: the communicator the benchmark ran on (its ``hosts``, ``size``, ``device``, ``launch``
            and, when it has one, ``topology`` are recorded), or None for a single process.
        command: the command line to record; default: ``sys.argv`` joined (shell-quoted).
        extra: more JSON-ready fields, stored under ``"extra"`` (e.g. the benchmark family).

    Returns:
        dict with ``commit``, ``dirty`` (uncommitted changes or untracked files; None if unknown),
        ``versions`` (xelink, python, torch, numpy, mpi4py, mpi, triton, cuda, nccl; None where
        absent), ``platform``, ``devices`` (names of the visible GPUs), ``device`` (this rank's
        device), ``hosts`` (host of each rank), ``world_size`` (None without a communicator),
        ``launcher``, ``topology``, ``env`` (XELINK_*, NCCL_*, TORCH_SYMM*, MPIR_CVAR*, OMPI_MCA*,
        GLOO_*, CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS), ``command``, ``timestamp`` (UTC, ISO 8601)
        and ``extra``.
    """
    if command is not None and not isinstance(command, str):
        raise TypeError(f"manifest: command={command!r} must be a str or None")
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"manifest: extra={extra!r} must be a dict or None")
    if comm is not None:
        topology = getattr(comm, "topology", None)
        topology = getattr(topology, "name", topology)  # a Topology object or a plain name
        launch = getattr(comm, "launch", None)
        where = {
            "device": str(comm.device),
            "hosts": list(comm.hosts),
            "world_size": comm.size,
            "launcher": getattr(launch, "launcher", None),
            "topology": None if topology is None else str(topology),
        }
    else:
        where = {"device": None, "hosts": [socket.gethostname()], "world_size": None, "launcher": None,
                 "topology": None}
    return {
        **_git_state(),
        "versions": _versions(),
        "platform": platform.platform(),
        "devices": _device_names(),
        **where,
        "env": _environment(),
        "command": command if command is not None else shlex.join(sys.argv),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "extra": dict(extra or {}),
    }


_this_process_manifest = manifest  # JsonlWriter's `manifest` argument shadows the function's name


# -- timing -----------------------------------------------------------------------------------

def time_fn(fn: Callable[[], Any], *, warmup: int, iters: int, sync: Callable[[], Any] | None = None,
            timer: Callable[[], float] = time.perf_counter) -> list[float]:
    """Time ``iters`` calls of ``fn`` one by one with a host clock, after ``warmup`` untimed calls.

    Args:
        fn: the work, called with no arguments.
        warmup: untimed calls first (compilation, allocation, connection setup).
        iters: timed calls; >= 1.
        sync: called after each call, inside the timing (e.g. ``torch.cuda.synchronize``) so
            asynchronous work is counted; None for synchronous work.
        timer: the clock, in seconds.

    Returns:
        ``iters`` durations in seconds, in call order.
    """
    integer("time_fn", "warmup", warmup, 0)
    integer("time_fn", "iters", iters, 1)
    for _ in range(warmup):
        fn()
        if sync is not None:
            sync()
    samples = []
    for _ in range(iters):
        start = timer()
        fn()
        if sync is not None:
            sync()
        samples.append(timer() - start)
    return samples


def time_cuda_events(fn: Callable[[], Any], *, warmup: int, iters: int) -> list[float]:
    """Time ``iters`` calls of ``fn`` with CUDA events on the current stream, after ``warmup`` calls.

    Events measure the device time between launches without a host round trip per call; the host
    waits once, at the end.

    Args:
        fn: the work, launching on the current CUDA stream.
        warmup: untimed calls first.
        iters: timed calls; >= 1.

    Returns:
        ``iters`` durations in seconds, in call order.

    Raises:
        RuntimeError: no CUDA device is available.
    """
    integer("time_cuda_events", "warmup", warmup, 0)
    integer("time_cuda_events", "iters", iters, 1)
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("time_cuda_events: needs a CUDA device (torch.cuda.is_available() is False); "
                           "use time_fn on other devices")
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in events]  # elapsed_time is in ms


def poison_unlike(out, want) -> None:
    """Fill ``out`` (a torch tensor or numpy array) so that no element equals ``want``'s: NaN for floats, the
    bitwise complement of ``want`` for integers and bools."""
    if isinstance(out, np.ndarray):
        if np.issubdtype(out.dtype, np.floating):
            out.fill(np.nan)
        else:
            np.invert(np.asarray(want, dtype=out.dtype), out=out)
    elif out.is_floating_point():
        out.fill_(float("nan"))
    else:
        out.copy_(want)
        out.bitwise_not_()


def co_measure(variants: Mapping[str, Callable[[], Any]], *, warmup: int, iters: int, rounds: int,
               barrier: Callable[[], Any] | None = None, reduce_max: Callable[[float], float] | None = None,
               timing: Callable[..., list[float]] | None = None,
               after_block: Callable[[str], Any] | None = None,
               before_block: Callable[[str], Any] | None = None) -> dict[str, list[float]]:
    """Time several variants of the same work in one run, interleaved round by round.

    Each round times a block of ``iters`` calls of every variant in turn (A, B, A, B, ...), so a
    drift in the machine (clocks, other jobs, thermal state) hits all variants alike rather than
    whichever happened to run last. Multi-rank: every rank must call this with the same variants in
    the same order.

    Args:
        variants: name -> the work (no arguments), e.g. ``{"xelink:ring": ..., "mpi:Allreduce": ...}``.
        warmup: untimed calls of each variant before the first round.
        iters: timed calls per variant per round; >= 1.
        rounds: number of rounds; >= 1.
        barrier: called before each timed block so all ranks start it together (``comm.barrier``).
        reduce_max: maps this rank's sample to the maximum over ranks (``rank_max(comm)``); applied
            after each block, outside the timing. A collective is as slow as its slowest rank.
        timing: times one block, called as ``timing(fn, iters=iters)``; default: ``time_fn`` with no
            warm-up (host clock). For GPUs: ``functools.partial(time_cuda_events, warmup=0)``.
        after_block: called as ``after_block(name)`` after each timed block, outside the timing; the
            place to check the outputs of the timed runs (#wrong) or to restore inputs.
        before_block: called as ``before_block(name)`` before each timed block (and its barrier), outside the
            timing: the place to poison an output that several variants share, so that a variant writing
            nothing is not credited with the previous one's result.

    Returns:
        name -> ``rounds * iters`` samples in seconds, in the order they were taken.
    """
    if not isinstance(variants, Mapping) or not variants:
        raise ValueError(f"co_measure: variants={variants!r} must be a non-empty dict of name -> callable")
    for name, fn in variants.items():
        if not callable(fn):
            raise TypeError(f"co_measure: variants[{name!r}]={fn!r} is not callable")
    integer("co_measure", "warmup", warmup, 0)
    integer("co_measure", "iters", iters, 1)
    integer("co_measure", "rounds", rounds, 1)
    if timing is None:
        def timing(fn, iters):
            return time_fn(fn, warmup=0, iters=iters)

    for fn in variants.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            if before_block is not None:
                before_block(name)
            if barrier is not None:
                barrier()
            block = timing(fn, iters=iters)
            if reduce_max is not None:
                block = [reduce_max(t) for t in block]
            samples[name].extend(block)
            if after_block is not None:
                after_block(name)
    return samples


def rank_max(comm) -> Callable[[float], float]:
    """``reduce_max`` for ``co_measure``: the maximum of a float over the ranks of ``comm``.

    Collective: every rank of ``comm`` must call the returned function the same number of times.
    """
    return lambda value: max(comm.allgather_object(float(value)))


def rank_sums(comm, counts: Mapping[str, int]) -> dict:
    """``counts`` (name -> int, e.g. wrong elements) summed over the ranks of ``comm``, by name.

    Collective: every rank of ``comm`` must call this with the same names in the same order.
    """
    return dict(zip(counts, map(sum, zip(*comm.allgather_object(list(counts.values()))))))


class Unavailable(Exception):
    """Raised by a family's ``run`` (before any measurement, on every rank alike) when this machine lacks what it
    needs; the suite reports the family skipped with the message as the reason."""


# The title of a family's argument group of options that only its CUDA runs use (the suite refuses those set on
# another device, before the family runs).
CUDA_ONLY = "CUDA only"


def on_cuda(comm) -> bool:
    """The ranks of ``comm`` run on CUDA devices."""
    return getattr(comm.device, "type", "cpu") == "cuda"


def one_gpu_per_rank(comm) -> bool:
    """Every rank of ``comm`` has a GPU of its own (NCCL and torch's symmetric memory need it)."""
    return on_cuda(comm) and len(set(map(str, comm.device_idents))) == comm.size


def summarize(samples: Iterable[float]) -> dict:
    """Statistics of timing samples, in the samples' unit.

    Args:
        samples: one or more durations.

    Returns:
        dict with ``median``, ``min``, ``p10``, ``p90`` (linear interpolation between samples, as
        ``numpy.percentile``), ``mean`` and ``n``.
    """
    values = np.asarray(list(samples), dtype=np.float64)
    if values.size == 0:
        raise ValueError("summarize: samples is empty")
    p10, median, p90 = np.percentile(values, [10, 50, 90])
    return {"median": float(median), "min": float(values.min()), "p10": float(p10), "p90": float(p90),
            "mean": float(values.mean()), "n": int(values.size)}


# -- bandwidth --------------------------------------------------------------------------------

# nccl-tests' bus-bandwidth factors: the fraction of the data each rank must move over its link,
# which makes busbw comparable with the link's peak whatever the op and rank count.
BUSBW_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}
# The torch.distributed names of the same ops.
_OP_ALIASES = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
               "all_to_all_single": "all_to_all"}


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s: ``nbytes / seconds / 1e9``.

    Args:
        nbytes: the size of the op, counted as nccl-tests does (the larger of the input and output
            buffer of one rank: all-gather's output, reduce-scatter's input).
        seconds: the time of one op; > 0.
    """
    if nbytes < 0:
        raise ValueError(f"algbw: nbytes={nbytes!r} must be >= 0")
    if not seconds > 0:
        raise ValueError(f"algbw: seconds={seconds!r} must be > 0")
    return nbytes / seconds / 1e9


def busbw(op: str, nbytes: int, seconds: float, n: int) -> float:
    """Bus bandwidth in GB/s: ``algbw`` times nccl-tests' factor for ``op`` at ``n`` ranks.

    Factors: all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast and
    reduce 1. The torch.distributed names (``all_gather_into_tensor``, ...) are accepted too.
    """
    factor = BUSBW_FACTORS.get(_OP_ALIASES.get(op, op))
    if factor is None:
        known = ", ".join([*BUSBW_FACTORS, *_OP_ALIASES])
        raise ValueError(f"busbw: unknown op {op!r} (known: {known})")
    integer("busbw", "n", n, 1)
    return algbw(nbytes, seconds) * factor(n)


# -- result rows ------------------------------------------------------------------------------

@dataclasses.dataclass
class Row:
    """One measured result: an op at one size through one path.

    Fields:
        op: the op (``"all_reduce"``, ``"gemm"``, ...).
        path: what actually ran, e.g. ``"xelink:ring"`` or ``"mpi:Allreduce"``; never ``"auto"``.
        baseline: the path this row is compared with, or None (e.g. on the baseline's own row).
        size_bytes, count, dtype, nranks: the size in bytes (nccl-tests' convention), elements,
            dtype name and number of ranks.
        time_us, min_us: median and minimum time of one op in microseconds (max over ranks).
        algbw_GBps, busbw_GBps: bandwidths from the median time (busbw None for non-collectives).
        wrong: wrong elements found in the outputs of the timed runs (must be 0).
        baseline_us: the baseline's median time, measured in the same run; None without one.
        ratio: ``baseline_us / time_us`` (> 1: this path is faster); None without a baseline.
        predicted_us: the cost model's prediction, when there is one.
        extra: anything else, JSON-ready (eager/graph, kernel config, ...).
    """

    op: str
    path: str
    size_bytes: int
    count: int
    dtype: str
    nranks: int
    time_us: float
    min_us: float
    algbw_GBps: float | None = None
    busbw_GBps: float | None = None
    wrong: int = 0
    baseline: str | None = None
    baseline_us: float | None = None
    ratio: float | None = None
    predicted_us: float | None = None
    extra: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"Row: path={self.path!r} must name the path that ran")
        if self.path == "auto" or self.path.endswith(":auto"):
            raise ValueError(f"Row: path={self.path!r} must name the algorithm that ran, not 'auto'")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Row":
        """A row from ``to_dict()`` output or a JSONL line (the ``manifest`` key is ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def make_row(op: str, path: str, samples: Iterable[float], *, size_bytes: int, count: int, dtype,
             nranks: int, wrong: int = 0, baseline: str | None = None,
             baseline_samples: Iterable[float] | None = None, predicted_us: float | None = None,
             extra: Mapping[str, Any] | None = None) -> Row:
    """A ``Row`` from timing samples (seconds), with bandwidths and the ratio to the baseline.

    Args:
        op, path, size_bytes, count, dtype, nranks, wrong, predicted_us, extra: as in ``Row``.
        samples: this path's samples in seconds (from ``co_measure``).
        baseline: the baseline's path name; ``baseline_samples`` its samples from the same run.

    Returns:
        the row; ``busbw_GBps`` is None when ``op`` has no nccl-tests factor (kernels).
    """
    stats = summarize(samples)
    seconds = stats["median"]
    base_us = ratio = None
    if baseline_samples is not None:
        if baseline is None:
            raise ValueError("make_row: baseline_samples given but baseline=None; name the baseline path")
        base_us = summarize(baseline_samples)["median"] * 1e6
        ratio = base_us / (seconds * 1e6) if seconds > 0 else None
    # A timer too coarse for the work can report 0 s; leave the bandwidths empty rather than infinite.
    bw = algbw(size_bytes, seconds) if seconds > 0 else None
    has_factor = _OP_ALIASES.get(op, op) in BUSBW_FACTORS
    bus = busbw(op, size_bytes, seconds, nranks) if bw is not None and has_factor else None
    return Row(op=op, path=path, size_bytes=size_bytes, count=count, dtype=dtype_name(dtype), nranks=nranks,
               time_us=seconds * 1e6, min_us=stats["min"] * 1e6, algbw_GBps=bw, busbw_GBps=bus, wrong=wrong,
               baseline=baseline, baseline_us=base_us, ratio=ratio, predicted_us=predicted_us,
               extra=dict(extra or {}))


# -- output -----------------------------------------------------------------------------------

class JsonlWriter:
    """Writes rows as JSON Lines, each line one row with the run manifest under ``"manifest"``.

    The manifest is repeated on every line (a few hundred bytes) rather than written once as a header,
    so every line stands alone: files can be concatenated, filtered with grep or jq, or truncated by a
    crash without losing what a result depends on. Each line is flushed as it is written.

    Multi-rank: write from one rank only (rank 0), with times already reduced over ranks.

    Args:
        path: the file to write; parent folders are created.
        manifest: the run manifest; default: ``manifest()`` of this process.
        append: add to an existing file instead of replacing it.
    """

    def __init__(self, path, manifest: Mapping[str, Any] | None = None, *, append: bool = False):
        self.path = Path(path)
        self.manifest = dict(manifest) if manifest is not None else _this_process_manifest()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")

    def write(self, row: Row) -> None:
        """Append one row (a ``Row``) and flush it to the file."""
        if not isinstance(row, Row):
            raise TypeError(f"JsonlWriter.write: row={row!r} must be a Row")
        # allow_nan=False: a NaN would make the line unreadable to strict JSON readers (jq, browsers).
        self._file.write(json.dumps({**row.to_dict(), "manifest": self.manifest}, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "JsonlWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_jsonl(path) -> list[dict]:
    """The objects of a JSON Lines file (blank lines skipped); ``Row.from_dict`` makes rows of them."""
    out = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"read_jsonl: {path}: line {number} is not valid JSON ({e.msg})") from None
    return out


def _fmt(value, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def format_table(rows: Iterable[Row]) -> str:
    """Rows as an nccl-tests-style text table, one line per row.

    Columns: op, size (B), count, type, path, time (us), algbw and busbw (GB/s), #wrong, the
    baseline's time (us) and ratio (baseline / ours); ``pred(us)`` and ``pred/meas`` (the cost model's
    prediction and its ratio to the measured time) are added when any row carries a prediction.
    Missing values print as ``-``.
    """
    rows = list(rows)
    with_pred = any(r.predicted_us is not None for r in rows)
    header = ["op", "size(B)", "count", "type", "path", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong",
              "base(us)", "ratio"] + (["pred(us)", "pred/meas"] if with_pred else [])
    lines = []
    for r in rows:
        cells = [r.op, str(r.size_bytes), str(r.count), r.dtype, r.path, _fmt(r.time_us, ".2f"),
                 _fmt(r.algbw_GBps, ".3f"), _fmt(r.busbw_GBps, ".3f"), str(r.wrong), _fmt(r.baseline_us, ".2f"),
                 _fmt(r.ratio, ".2f")]
        if with_pred:
            cells += [_fmt(r.predicted_us, ".2f"), _fmt(pred_over_meas(r), ".2f")]
        lines.append(cells)
    widths = [max(len(c[i]) for c in [header, *lines]) for i in range(len(header))]
    text_columns = {0, 3, 4}  # left-aligned names; numbers align right as in nccl-tests

    def render(cells):
        return "  ".join(c.ljust(w) if i in text_columns else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([render(header), *map(render, lines)])


def pred_over_meas(row: Row) -> float | None:
    """The cost model's predicted time over the measured median (1: exact; < 1: the model predicts too
    little), or None without a prediction or a measured time."""
    if row.predicted_us is None or not row.time_us or row.time_us <= 0:
        return None
    return row.predicted_us / row.time_us


class Progress:
    """One line per step of a long sweep on stderr: ``[family  3/12  4.1 s] what``.

    Multi-rank: create it on every rank with ``show=(rank == 0)`` so only one rank prints.

    Args:
        label: what the steps belong to (the family).
        total: the number of steps expected (None: unknown; the count is shown alone).
        show: print the lines (False: count silently).
        stream: where to print; default ``sys.stderr``, which a table on stdout does not mix with.
    """

    def __init__(self, label: str, total: int | None = None, *, show: bool = True, stream=None):
        self.label, self.total, self.show = label, total, show
        self.stream = stream
        self.done = 0
        self.start = time.perf_counter()

    def step(self, what: str) -> None:
        """Count one finished step and print it."""
        self.done += 1
        if not self.show:
            return
        count = f"{self.done}/{self.total}" if self.total else str(self.done)
        stream = self.stream or sys.stderr
        print(f"[{self.label} {count} {time.perf_counter() - self.start:6.1f} s] {what}", file=stream, flush=True)


def write_csv(rows: Iterable[Row], path) -> None:
    """Rows as CSV with one column per ``Row`` field (``extra`` as a JSON string).

    Args:
        rows: the rows.
        path: the file to write (replaced); parent folders are created.
    """
    names = [f.name for f in dataclasses.fields(Row)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for row in rows:
            data = row.to_dict()
            data["extra"] = json.dumps(data["extra"], sort_keys=True)
            writer.writerow(data)

"""Multi-rank test harness: one launch per (launcher, world size) runs every module's checks on every rank.

A module ``tests/**/ranks_*.py`` defines ``check_*(world)`` functions and, optionally,
``WORLD_SIZES`` (default ``(1, 2, 4)``), ``LAUNCHERS`` (default ``("mpi",)``; ``"torchrun"`` too),
``LAUNCH_TIMEOUT`` (seconds, default 300), ``ENV`` (variables for its launches) and ``GPUS``. The
conftest turns each (module, check, launcher, size) into one pytest item. Modules that share a
launcher, a world size and an environment share one launch: its ranks run the checks of every such
module collected in the session, module after module, so the suite pays one start-up per size, not
one per module and size.

Each rank writes its results after every check (``<out>/rank<r>.json``, keyed ``<module>::<check>``, with
the check's own seconds: what a launch spends where),
so a rank that dies or hangs still leaves what it finished, and ``progress`` says where it stopped. A
launch that outlives its timeout (the sum of its modules') is killed, process group and all.

Every check starts with torch's and numpy's generators seeded from its name and the rank (``seed``; the
conftest seeds every other test from its id), so a run's random data is the same in every run.

A check decorated with ``@ranks.only(launchers=..., sizes=...)`` runs only under those launchers
and world sizes. ``XELINK_TEST_CHECKS`` (comma-separated parts of check names) keeps only the checks
whose names contain one of them, in collection and in the launch alike; a launch runs only the checks
whose items pytest kept (``-k`` or ``--deselect`` deselecting the others: ``SELECTED``). A check that calls
``pytest.skip(reason)`` (e.g. a GPU check whose baseline cannot run on this machine) is reported skipped
with that reason.

This file is also the per-rank runner: ``python tests/ranks.py <outdir> <launcher> <module.py>...``.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from pathlib import Path

DEFAULT_WORLD_SIZES = (1, 2, 4)
DEFAULT_LAUNCHERS = ("mpi",)
DEFAULT_LAUNCH_TIMEOUT = 300
# The deadline of every xelink wait inside the checks: short, so a check that leaves a rank behind
# fails with xelink's own timeout long before the launch is killed.
CHECK_TIMEOUT = "60"
# Set by the conftest for a launch some of whose items pytest deselected (``-k``, ``--deselect``): the
# ``key(module, check)`` names the ranks run, comma-separated.
SELECTED = "XELINK_TEST_SELECTED"


def load_module(path: Path):
    """Import a checks module from its path; its folder goes on ``sys.path`` for its own helpers."""
    folder = str(Path(path).resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(f"ranks_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # importable by its name (torch.compile resolves a traced function's globals so)
    spec.loader.exec_module(module)
    return module


def only(*, launchers=None, sizes=None):
    """Decorator: run this check only under these launchers ("mpi", "torchrun") and world sizes.

    The check is then neither collected nor run elsewhere (it does not show up as a skip), e.g. one
    that exercises MPI shared memory, which torchrun's transport does not have.
    """
    def mark(fn):
        fn.launchers, fn.sizes = launchers, sizes
        return fn
    return mark


def check_names(module, launcher: str | None = None, n: int | None = None) -> list[str]:
    """The ``check_*`` functions of a module, in definition order (those that run under ``launcher``
    at ``n`` ranks, when given)."""
    wanted = [w for w in os.environ.get("XELINK_TEST_CHECKS", "").split(",") if w]
    selected = {w for w in os.environ.get(SELECTED, "").split(",") if w}
    path = Path(module.__file__).resolve()
    funcs = [(f.__code__.co_firstlineno, name) for name, f in vars(module).items()
             if name.startswith("check_") and callable(f)
             and (launcher is None or getattr(f, "launchers", None) is None or launcher in f.launchers)
             and (n is None or getattr(f, "sizes", None) is None or n in f.sizes)
             and (not wanted or any(w in name for w in wanted))
             and (not selected or key(path, name) in selected)]
    return [name for _, name in sorted(funcs)]


@functools.cache
def open_mpi() -> bool:
    """Whether ``mpiexec()`` is Open MPI's (the GPU image's; CI's is MPICH's); asked once a process."""
    version = subprocess.run([mpiexec(), "--version"], capture_output=True, text=True).stdout
    return "Open MPI" in version or "OpenRTE" in version


def mpiexec() -> str | None:
    """The mpiexec that belongs to this Python environment (the mpich wheel's), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def launch_command(launcher: str, n: int, modules, outdir: Path) -> list[str]:
    modules = [modules] if isinstance(modules, (str, Path)) else list(modules)
    runner = [str(Path(__file__).resolve()), str(outdir), launcher, *map(str, modules)]
    if launcher == "mpi":
        exe = mpiexec()
        if exe is None:
            raise RuntimeError("no mpiexec found: install the test extra (pip install mpich) so multi-rank tests run")
        return [exe, "-n", str(n), sys.executable, *runner]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *runner]
    raise ValueError(f"unknown launcher {launcher!r}")


def key(module: Path, check: str) -> str:
    """The name of ``check`` of ``module`` in a launch's results."""
    return f"{Path(module).resolve()}::{check}"


@dataclasses.dataclass
class LaunchResult:
    """What one launch left behind: per-rank results by check name, exit status, output."""

    n: int
    returncode: int | None
    timed_out: bool
    seconds: float
    output: str
    results: dict  # rank -> {"<module>::<check>" -> {"ok": bool, "error": str, "seconds": float, "skipped"?: str}}
    progress: dict  # rank -> the check it was in when last heard of ("<done>" at the end)
    modules: tuple = ()  # the modules the launch ran, in order

    def tail(self, chars: int = 4000) -> str:
        return self.output[-chars:]


def launch(modules, n: int, launcher: str = "mpi", timeout: float = DEFAULT_LAUNCH_TIMEOUT,
           env: dict | None = None) -> LaunchResult:
    """Run every check of ``modules`` (a path or a list) on ``n`` ranks; never waits longer than ``timeout``."""
    modules = tuple(Path(m).resolve() for m in ([modules] if isinstance(modules, (str, Path)) else modules))
    outdir = Path(tempfile.mkdtemp(prefix="xelink-ranks-"))
    cmd = launch_command(launcher, n, modules, outdir)
    full_env = dict(os.environ)
    full_env.setdefault("XELINK_TIMEOUT", CHECK_TIMEOUT)
    full_env["MPIEXEC_TIMEOUT"] = str(int(timeout) + 5)  # second line of defence, if we are killed
    full_env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), full_env.get("PYTHONPATH", "")])
    full_env.update(env or {})
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full_env,
                            start_new_session=True, stdin=subprocess.DEVNULL)
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    seconds = time.monotonic() - start
    results, progress = {}, {}
    for r in range(n):
        f = outdir / f"rank{r}.json"
        if f.exists():
            data = json.loads(f.read_text())
            results[r], progress[r] = data["results"], data["progress"]
    shutil.rmtree(outdir, ignore_errors=True)
    return LaunchResult(n, None if timed_out else proc.returncode, timed_out, seconds,
                        out.decode(errors="replace"), results, progress, modules)


def _short(name: str) -> str:
    """``<module file>::<check>`` of a results key, for messages."""
    module, sep, check = name.rpartition("::")
    return f"{Path(module).name}::{check}" if sep else name


def _find(result: LaunchResult, name: str) -> str:
    """The results key of ``name``: a ``key()``, or a bare check name of a launch of one module."""
    return key(result.modules[0], name) if "::" not in name and len(result.modules) == 1 else name


def explain(result: LaunchResult, name: str) -> str | None:
    """Why check ``name`` (``key(module, check)``) failed in this launch (None if it passed on every rank)."""
    name = _find(result, name)
    problems = []
    for r in range(result.n):
        got = result.results.get(r, {}).get(name)
        if got is None:
            where = _short(result.progress.get(r, "start-up"))
            how = (f"the launch was killed after {result.seconds:.0f} s" if result.timed_out
                   else f"the launch exited with code {result.returncode}")
            problems.append(f"rank {r}: no result ({how}; rank {r} was last in {where})")
        elif not got["ok"]:
            problems.append(f"rank {r}:\n{got['error']}")
    if not problems:
        return None
    return "\n".join(problems) + f"\n---- output of the launch (tail) ----\n{result.tail()}"


def skipped(result: LaunchResult, name: str) -> str | None:
    """The reason check ``name`` skipped itself (``pytest.skip``) on some rank, if it did and passed."""
    name = _find(result, name)
    for r in range(result.n):
        why = result.results.get(r, {}).get(name, {}).get("skipped")
        if why:
            return f"rank {r}: {why}"
    return None


def _skipped():
    import pytest

    return pytest.skip.Exception


def seed(name: str, rank: int = 0) -> None:
    """Seed torch's and numpy's generators for one test (``name``) on one rank: a test's random data is the same
    in every run (a failure repeats; a pass is not luck of the draw), and differs between ranks.
    ``XELINK_TEST_SEED`` (any text) draws other data everywhere: a hunt for tests that pass by luck."""
    import numpy as np
    import torch

    salt = os.environ.get("XELINK_TEST_SEED", "")
    value = (zlib.crc32(f"{salt}{name}".encode()) + rank) % 2**32
    torch.manual_seed(value)
    np.random.seed(value)


def _run_rank(outdir: str, launcher: str, module_paths: list[str]) -> int:
    """Per rank: init xelink, run every check of every module, record each result as it finishes."""
    import xelink

    world = xelink.init()
    out = Path(outdir) / f"rank{world.rank}.json"
    record = {"results": {}, "progress": "start-up"}

    def save():
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(out)

    failed = False
    for path in map(Path, module_paths):
        record["progress"] = f"{path} (import)"
        save()
        module = load_module(path)
        for name in check_names(module, launcher, world.size):
            record["progress"] = k = key(path, name)
            save()
            start = time.monotonic()
            seed(name, world.rank)
            try:
                getattr(module, name)(world)
                record["results"][k] = {"ok": True, "error": ""}
            except _skipped() as exc:  # pytest.skip("why") inside a check: the item is reported skipped
                record["results"][k] = {"ok": True, "error": "", "skipped": str(exc) or "skipped"}
            except BaseException:  # noqa: BLE001 - a failing check is recorded, then the next one runs
                failed = True
                record["results"][k] = {"ok": False, "error": traceback.format_exc()}
            record["results"][k]["seconds"] = round(time.monotonic() - start, 3)
            save()
            world = xelink.get_world() if xelink.is_initialized() else xelink.init()
    record["progress"] = "<done>"
    save()
    xelink.finalize()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_run_rank(sys.argv[1], sys.argv[2], sys.argv[3:]))

"""Multi-rank test harness: launch a module of checks once per world size, every rank running them all.

A module ``tests/**/ranks_*.py`` defines ``check_*(world)`` functions and, optionally,
``WORLD_SIZES`` (default ``(1, 2, 4)``), ``LAUNCHERS`` (default ``("mpi",)``; ``"torchrun"`` too) and
``LAUNCH_TIMEOUT`` (seconds, default 300). The conftest turns each (check, launcher, size) into one
pytest item; the first item of a (module, launcher, size) triggers one launch that runs every check
on every rank, so a module costs one start-up per size, not one per check.

Each rank writes its results after every check (``<out>/rank<r>.json``), so a rank that dies or
hangs still leaves what it finished, and ``progress`` says where it stopped. A launch that outlives
its timeout is killed, process group and all.

A check decorated with ``@ranks.only(launchers=..., sizes=...)`` runs only under those launchers
and world sizes; a check that calls ``pytest.skip(reason)`` (e.g. a GPU check whose baseline cannot
run on this machine) is reported skipped with that reason.

This file is also the per-rank runner: ``python tests/ranks.py <module.py> <outdir> <launcher>``.
"""
from __future__ import annotations

import dataclasses
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
from pathlib import Path

DEFAULT_WORLD_SIZES = (1, 2, 4)
DEFAULT_LAUNCHERS = ("mpi",)
DEFAULT_LAUNCH_TIMEOUT = 300
# The deadline of every xelink wait inside the checks: short, so a check that leaves a rank behind
# fails with xelink's own timeout long before the launch is killed.
CHECK_TIMEOUT = "60"


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location(f"ranks_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
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
    funcs = [(f.__code__.co_firstlineno, name) for name, f in vars(module).items()
             if name.startswith("check_") and callable(f)
             and (launcher is None or getattr(f, "launchers", None) is None or launcher in f.launchers)
             and (n is None or getattr(f, "sizes", None) is None or n in f.sizes)]
    return [name for _, name in sorted(funcs)]


def mpiexec() -> str | None:
    """The mpiexec that belongs to this Python environment (the mpich wheel's), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def launch_command(launcher: str, n: int, module: Path, outdir: Path) -> list[str]:
    runner = [str(Path(__file__).resolve()), str(module), str(outdir), launcher]
    if launcher == "mpi":
        exe = mpiexec()
        if exe is None:
            raise RuntimeError("no mpiexec found: install the test extra (pip install mpich) so multi-rank tests run")
        return [exe, "-n", str(n), sys.executable, *runner]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *runner]
    raise ValueError(f"unknown launcher {launcher!r}")


@dataclasses.dataclass
class LaunchResult:
    """What one launch left behind: per-rank results by check name, exit status, output."""

    n: int
    returncode: int | None
    timed_out: bool
    seconds: float
    output: str
    results: dict  # rank -> {check name -> {"ok": bool, "error": str}}
    progress: dict  # rank -> name of the check it was in when last heard of ("<done>" at the end)

    def tail(self, chars: int = 4000) -> str:
        return self.output[-chars:]


def launch(module: Path, n: int, launcher: str = "mpi", timeout: float = DEFAULT_LAUNCH_TIMEOUT,
           env: dict | None = None) -> LaunchResult:
    """Run every check of ``module`` on ``n`` ranks; never waits longer than ``timeout``."""
    outdir = Path(tempfile.mkdtemp(prefix="xelink-ranks-"))
    cmd = launch_command(launcher, n, module, outdir)
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
                        out.decode(errors="replace"), results, progress)


def explain(result: LaunchResult, name: str) -> str | None:
    """Why check ``name`` failed in this launch (None if it passed on every rank)."""
    problems = []
    for r in range(result.n):
        got = result.results.get(r, {}).get(name)
        if got is None:
            where = result.progress.get(r, "start-up")
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
    for r in range(result.n):
        why = result.results.get(r, {}).get(name, {}).get("skipped")
        if why:
            return f"rank {r}: {why}"
    return None


def _skipped():
    import pytest

    return pytest.skip.Exception


def _run_rank(module_path: str, outdir: str, launcher: str) -> int:
    """Per rank: init xelink, run every check, record each result as it finishes."""
    import xelink

    world = xelink.init()
    module = load_module(Path(module_path))
    out = Path(outdir) / f"rank{world.rank}.json"
    record = {"results": {}, "progress": "start-up"}

    def save():
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(out)

    failed = False
    for name in check_names(module, launcher, world.size):
        record["progress"] = name
        save()
        try:
            getattr(module, name)(world)
            record["results"][name] = {"ok": True, "error": ""}
        except _skipped() as exc:  # pytest.skip("why") inside a check: the item is reported skipped
            record["results"][name] = {"ok": True, "error": "", "skipped": str(exc) or "skipped"}
        except BaseException:  # noqa: BLE001 - a failing check is recorded, then the next one runs
            failed = True
            record["results"][name] = {"ok": False, "error": traceback.format_exc()}
        save()
        world = xelink.get_world() if xelink.is_initialized() else xelink.init()
    record["progress"] = "<done>"
    save()
    xelink.finalize()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_run_rank(sys.argv[1], sys.argv[2], sys.argv[3]))

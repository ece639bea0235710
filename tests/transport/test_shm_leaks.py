"""Shared-memory segments stay private and leave nothing in /dev/shm, after a crash as well.

Where MPICH 5 keeps a job's shared memory (found with strace, checked here on every run):
- each ``MPI_Win_allocate_shared`` window (a ``PeerWindow``, ``PeerCounters``): a ``mkstemp`` file
  ``/dev/shm/mpich_shar_tmpXXXXXX``, mode 0600, unlinked by its creator once every node rank has
  mapped it, before the call returns: only the mappings hold it, and the kernel frees it when the
  last rank exits, however it exits;
- MPICH's own intra-node slab ``/dev/shm/mpich_shm_<job>_<node>``, mode 0600, created in
  ``MPI_Init`` and unlinked only by ``MPI_Finalize``: a crashed job leaves it behind (the ``plain``
  case shows it), so xelink unlinks it as soon as it builds peer memory
  (``xelink.transport.shm.unlink_mpich_init_segment``);
- UCX (MPICH's network module) maps ``/dev/shm/ucx_shm_posix_*`` files (0600, unlinked at once) and
  SysV segments (removed at once with IPC_RMID, so they cannot leak, but created mode 0660).

The listing of /dev/shm is compared before and after each job. Other jobs of this user may run at the
same time on a shared machine, so a new entry counts against this job unless it is another job's MPICH
slab (a ``mpich_shm_<job>_*`` name whose ``<job>`` none of this job's ranks mapped).
"""
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ranks

JOB = Path(__file__).resolve().parents[1] / "data" / "shm_leak_job.py"
SHM = Path("/dev/shm")
N = 4
_SLAB = re.compile(r"^mpich_shm_([0-9a-f]+)_\d+$")

pytestmark = [pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this system"),
              pytest.mark.skipif(ranks.open_mpi(), reason="written for MPICH's files (CI's MPI); Open MPI keeps its "
                                                          "own (sm_segment.*, osc_sm.*)")]


def listing() -> dict:
    """``/dev/shm`` entries owned by this user: name -> stat."""
    out = {}
    for entry in os.scandir(SHM):
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:  # unlinked while we looked
            continue
        if st.st_uid == os.getuid():
            out[entry.name] = st
    return out


@dataclasses.dataclass
class Job:
    returncode: int
    seconds: float
    output: str
    before: dict
    during: dict
    after: dict
    reports: dict  # rank -> {"pid", "maps"}
    start: float

    def mapped(self, kind="file") -> set:
        return {m["name"] for r in self.reports.values() for m in r["maps"] if m["kind"] == kind}

    def new(self, listing: dict) -> dict:
        """Entries of ``listing`` created during the run (not there before)."""
        return {n: st for n, st in listing.items() if n not in self.before and st.st_ctime >= self.start - 1}

    def job_ids(self) -> set:
        return {m.group(1) for m in map(_SLAB.match, self.mapped()) if m}

    def ours(self, listing: dict) -> set:
        """New entries that may be this job's: all but other jobs' MPICH slabs."""
        mine = self.job_ids()
        return {n for n in self.new(listing) if not (_SLAB.match(n) and _SLAB.match(n).group(1) not in mine)}


def run_job(mode: str, tmp_path: Path, kill_rank: int | None = None) -> Job:
    outdir = tmp_path / mode
    outdir.mkdir()
    env = dict(os.environ, XELINK_TIMEOUT="60", MPIEXEC_TIMEOUT="90",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]))
    before = listing()
    start = time.time()
    proc = subprocess.Popen([ranks.mpiexec(), "-n", str(N), sys.executable, str(JOB), mode, str(outdir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            stdin=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 90
        while not (outdir / "ready").exists():
            assert proc.poll() is None, f"the {mode} job ended before it was ready:\n{proc.communicate()[0].decode()}"
            assert time.monotonic() < end, f"the {mode} job was not ready after 90 s"
            time.sleep(0.02)
        during = listing()  # the job is alive and holds its segments now
        reports = {r: json.loads((outdir / f"rank{r}.json").read_text()) for r in range(N)}
        if kill_rank is not None:
            os.kill(reports[kill_rank]["pid"], signal.SIGKILL)
        else:
            (outdir / "go").write_text("")
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return Job(proc.returncode, time.time() - start, out.decode(errors="replace"), before, during, listing(),
               reports, start)


def check_private(job: Job) -> None:
    """Every segment the ranks map is closed to other users (files: to everyone else, 0600)."""
    for r, report in job.reports.items():
        for m in report["maps"]:
            if m["mode"] is None:
                continue
            if m["kind"] == "file":
                assert m["mode"] & 0o077 == 0, f"rank {r} maps /dev/shm/{m['name']} with mode {m['mode']:o}"
            else:  # UCX's SysV segments are 0660 (its fixed choice); never open to other users
                assert m["mode"] & 0o007 == 0, f"rank {r} maps SysV {m['name']} with mode {m['mode']:o}"
    for name in job.ours(job.during):
        mode = job.during[name].st_mode & 0o777
        assert mode & 0o077 == 0, f"/dev/shm/{name} has mode {mode:o} while the job runs"


def check_xelink_job(job: Job) -> None:
    files = [m for r in job.reports.values() for m in r["maps"] if m["kind"] == "file"]
    # The windows are mkstemp files, already unlinked while the job runs, and of a known, private mode.
    windows = [m for m in files if m["name"].startswith("mpich_shar_tmp")]
    assert windows and all(m["deleted"] for m in windows), files
    assert any(m["mode"] is not None for m in windows), "no mode of a window segment could be read"
    # MPICH's init slab is mapped, but xelink has unlinked it already.
    slabs = [m for m in files if _SLAB.match(m["name"])]
    assert slabs and all(m["deleted"] for m in slabs), slabs
    assert not (job.mapped() & set(job.during)), "a segment of the job is still linked in /dev/shm"
    check_private(job)
    leaked = job.ours(job.after)
    assert not leaked, f"left in /dev/shm: {sorted(leaked)}\n{job.output[-3000:]}"


def test_normal_exit_leaves_nothing(tmp_path):
    job = run_job("normal", tmp_path)
    assert job.returncode == 0, job.output[-3000:]
    check_xelink_job(job)


def test_rank_exiting_mid_job_leaves_nothing(tmp_path):
    job = run_job("exit", tmp_path)
    assert job.returncode != 0 and job.seconds < 60, job.output[-3000:]
    check_xelink_job(job)


def test_rank_killed_mid_job_leaves_nothing(tmp_path):
    job = run_job("kill", tmp_path, kill_rank=2)
    assert job.returncode != 0 and job.seconds < 60, job.output[-3000:]
    check_xelink_job(job)


def test_mpich_alone_leaves_its_slab_after_a_crash(tmp_path):
    """Why xelink unlinks MPICH's slab: without it, a crashed MPICH job leaves the slab behind."""
    job = run_job("plain", tmp_path)
    try:
        assert job.returncode != 0, job.output[-3000:]
        slabs = {m["name"] for r in job.reports.values() for m in r["maps"] if _SLAB.match(m["name"])}
        assert len(slabs) == 1, slabs
        (slab,) = slabs
        assert slab in job.during and job.during[slab].st_mode & 0o777 == 0o600  # linked while running, private
        check_private(job)
        assert slab in job.after, ("MPICH now removes its slab after a crash by itself; "
                                   "xelink.transport.shm.unlink_mpich_init_segment may be unnecessary")
        assert job.ours(job.after) == {slab}  # and nothing else
    finally:  # remove this job's slab only: other jobs' files are theirs
        for name in job.ours(job.after):
            m = _SLAB.match(name)
            if m and m.group(1) in job.job_ids():
                (SHM / name).unlink(missing_ok=True)

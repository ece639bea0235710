"""A job for tests/test_shm_leaks.py: make peer memory, report what this rank maps, end as told.

    python shm_leak_job.py MODE OUTDIR

MODE: ``normal`` (free, finalize, exit 0), ``exit`` (rank 1 calls ``os._exit(1)`` mid-job), ``kill``
(the test SIGKILLs a rank while the job waits), ``plain`` (mpi4py only, no xelink; rank 1 exits).
Every rank writes ``OUTDIR/rank<r>.json`` (its pid and mappings); rank 0 then writes
``OUTDIR/ready`` and waits for ``OUTDIR/go``, so the test can look at ``/dev/shm`` while the job runs.
"""
import json
import os
import sys
import time
from pathlib import Path

WAIT_S = 60.0


def sysv_modes() -> dict:
    modes = {}
    try:
        with open("/proc/sysvipc/shm") as f:
            next(f)
            for line in f:
                fields = line.split()
                modes[int(fields[1])] = int(fields[2], 8) & 0o777  # perms are printed in octal
    except (OSError, StopIteration):
        pass
    return modes


def mappings() -> list:
    """The /dev/shm files and SysV segments this process maps, with their modes where readable."""
    sysv = sysv_modes()
    seen, out = set(), []
    with open("/proc/self/maps") as f:
        lines = f.readlines()
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        path = parts[5].strip()
        deleted = path.endswith(" (deleted)")
        if deleted:
            path = path[: -len(" (deleted)")]
        if path.startswith("/dev/shm/"):
            mode = None
            try:  # the inode behind the mapping, linked or not
                mode = os.stat(f"/proc/self/map_files/{parts[0]}").st_mode & 0o777
            except OSError:
                if not deleted:
                    try:
                        mode = os.stat(path).st_mode & 0o777
                    except OSError:
                        pass
            key = ("file", path[len("/dev/shm/"):])
            entry = {"kind": "file", "name": key[1], "deleted": deleted, "mode": mode}
        elif path.startswith("/SYSV"):
            shmid = int(parts[4])  # the inode number of a SysV mapping is its shmid
            key = ("sysv", shmid)
            entry = {"kind": "sysv", "name": f"shmid {shmid}", "deleted": deleted, "mode": sysv.get(shmid)}
        else:
            continue
        if key not in seen:
            seen.add(key)
            out.append(entry)
    return out


def main(mode: str, outdir: Path) -> int:
    if mode == "plain":
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
        barrier = MPI.COMM_WORLD.Barrier
    else:
        import xelink
        from xelink.transport.shm import PeerCounters, PeerWindow

        world = xelink.init()
        rank = world.rank
        barrier = world.barrier
        pw = PeerWindow(world, 1 << 20)
        pc = PeerCounters(world)
        pw.local()[:] = rank + 1
        pw.barrier()
        assert all(int(pw.peer(i)[-1]) == i + 1 for i in range(pw.node_size))
        pc.barrier()
    tmp = outdir / f"rank{rank}.tmp"
    tmp.write_text(json.dumps({"pid": os.getpid(), "maps": mappings()}))
    tmp.replace(outdir / f"rank{rank}.json")
    barrier()
    if rank == 0:
        (outdir / "ready").write_text("")
        end = time.monotonic() + WAIT_S
        while not (outdir / "go").exists():
            if time.monotonic() > end:
                return 2
            time.sleep(0.02)
    barrier()
    if mode == "normal":
        pw.free()
        pc.free()
        xelink.finalize()
        return 0
    if rank == 1:
        os._exit(1)
    time.sleep(WAIT_S)  # the launcher kills the job when rank 1 dies
    return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))

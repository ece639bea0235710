"""Peer memory in a plain process: a communicator without MPI gets a clear error, not a window; and under a small
/dev/shm (a container's), ranks that would have died with SIGBUS."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import xelink
from xelink.comm import Communicator
from xelink.transport import SelfTransport
from xelink.transport import shm
from xelink.transport.shm import PeerCounters, PeerMemoryUnavailable, PeerWindow


def self_comm() -> Communicator:
    return Communicator(SelfTransport(), name="t", world_ranks=[0], hosts=["localhost"],
                        device=torch.device("cpu"), timeout=5.0, launch=None)


def test_non_mpi_transport_is_refused_by_name():
    comm = self_comm()
    assert not shm.available(comm)
    with pytest.raises(PeerMemoryUnavailable, match=r"PeerWindow: comm.transport.name='self': peer memory needs "
                                                    r"the 'mpi' transport") as info:
        PeerWindow(comm, 64)
    assert isinstance(info.value, ValueError)  # callers may catch either and fall back to point-to-point
    with pytest.raises(PeerMemoryUnavailable, match=r"PeerCounters: comm.transport.name='self'"):
        PeerCounters(comm)
    comm.free()


def test_freed_communicator_and_wrong_types():
    comm = self_comm()
    comm.free()
    assert not shm.available(comm)
    with pytest.raises(xelink.XelinkError, match=r"PeerWindow: the communicator was freed"):
        PeerWindow(comm, 64)
    with pytest.raises(TypeError, match=r"PeerWindow: comm=None is not an xelink Communicator"):
        PeerWindow(None, 64)
    assert not shm.available(None)


def test_free_all_without_windows():
    assert shm.free_all(self_comm()) == 0


def _small_dev_shm() -> list[str] | None:
    """The command prefix that runs a shell in a private mount namespace, where it may mount a small /dev/shm (root),
    or None where that cannot be done."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or not os.path.isdir("/dev/shm"):
        return None
    probe = ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=16m tmpfs /dev/shm && test -d /dev/shm"]
    try:
        ok = subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return ["unshare", "-m", "sh", "-c"] if ok else None


def test_direct_all_reduce_under_a_small_dev_shm():
    """2 ranks, 24 MiB of /dev/shm (MPICH itself needs about 16): a 32 MiB one-shot all-reduce's window cannot
    fit, and made anyway it killed the ranks with SIGBUS at the first touch past the free space. Now every call
    gives the right sum: the large ones by messages, a small one after them through the window."""
    prefix = _small_dev_shm()
    if prefix is None:
        pytest.skip("needs root and a mount namespace (unshare -m) to give the ranks a small /dev/shm")
    from ranks import mpiexec  # tests/ is on sys.path (conftest.py)

    exe = mpiexec()
    if exe is None:
        pytest.skip("no mpiexec")
    script = textwrap.dedent("""
        import torch, xelink
        xelink.init()
        for n, algo in ((8 << 20, "direct"), (8 << 20, "auto"), (1 << 10, "direct"), (8 << 20, "direct")):
            x = torch.full((n,), float(xelink.get_rank() + 1))
            xelink.all_reduce(x, algo=algo)
            assert torch.equal(x, torch.full((n,), 3.0)), (n, algo)
        print("rank", xelink.get_rank(), "ok", flush=True)
        xelink.finalize()
    """)
    inner = f"mount -t tmpfs -o size=24m tmpfs /dev/shm && {exe} -n 2 {sys.executable} -c '{script}'"
    proc = subprocess.run([*prefix, inner], capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.count(" ok") == 2 and "SIGBUS" not in out and "Bus error" not in out, out[-3000:]

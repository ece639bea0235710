"""MPI host transport (mpi4py), used under mpirun/mpiexec of MPICH, Open MPI or Intel MPI."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..config import resolve_timeout
from ..errors import TimeoutError
from .base import Deadline, Request, SizeMismatch, Transport, as_bytes, iter_peers, spin_until, wait_all

__all__ = ["MPITransport"]

# Control messages use a duplicate of the data communicator, so they never match user traffic; the tag
# cycles with the exchange count so that a message left over from a timed-out exchange cannot be
# taken for the next one.
_TAG_CYCLE = 1 << 15
# A message left over from a timed-out exchange can also outlive its communicator: MPI reuses a freed
# communicator's context for a new one (MPICH does, soon), and a message still queued for the old one
# then matches a receive of the new one. Seen: an allgather of the window sizes of a new communicator
# received a stale size, the ranks' windows differed, and a one-shot all-reduce returned wrong sums. So
# every control message carries its communicator's id (unique in the job) and its exchange number;
# the receiver drops one that is not for this exchange. Data messages (``isend``/``irecv``) cannot carry
# one: ``free`` drains what is queued, and every collective of a communicator uses its own tag.


_MPI = None

# What the watchdog of MPI_Init runs (``python -I -S -c``, argv: pid, seconds, message): it waits for its stdin to
# close (MPI_Init returned, or this process died), else stops the process. Another process, because MPI_Init holds
# the interpreter's lock: a thread of this one never runs while it waits.
_WATCHDOG = """import os, select, signal, sys
if not select.select([sys.stdin], [], [], float(sys.argv[2]))[0]:
    sys.stderr.write(sys.argv[3])
    sys.stderr.flush()
    os.kill(int(sys.argv[1]), signal.SIGKILL)
"""


def mpi(timeout: float | None = None):
    """The ``mpi4py.MPI`` module, imported on first use (importing it initialises MPI).

    MPI_Init waits for every process of the launch, and one that exited before it (an import error on one rank)
    left the others waiting forever (MPICH's launcher waits for them). So the first import runs under a
    watchdog that stops this process, saying why, when MPI_Init has not returned within ``timeout`` seconds
    (``config.resolve_timeout``: ``XELINK_TIMEOUT`` or 300 s); the launcher then ends the job.
    """
    global _MPI
    if _MPI is None:
        import sys

        if "mpi4py.MPI" in sys.modules:  # initialised by the user's own import
            from mpi4py import MPI
        else:
            MPI = _init_under_watchdog(resolve_timeout(timeout))
        _MPI = MPI
    return _MPI


def _init_under_watchdog(seconds: float):
    import os
    import subprocess
    import sys

    rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))
    why = (f"xelink: MPI_Init (rank {rank}) did not return within {seconds:g} s (XELINK_TIMEOUT or init's "
           f"timeout): a process of this launch exited or hung before initialising MPI (its error should be above "
           f"this line); stopping this one\n")
    dog = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHDOG, str(os.getpid()), str(seconds), why],
                           stdin=subprocess.PIPE)
    try:
        from mpi4py import MPI
    finally:
        dog.stdin.close()
        dog.wait()
    return MPI


def _buffer(buf):
    """The bytes of ``buf`` as mpi4py takes them, without a copy. A contiguous CPU tensor is passed by its
    address (0.5 us where ``as_bytes``' three tensor views cost 2.3 us, most of a small message's host time);
    the caller keeps it alive until the transfer completes (``_MPIRequest.buf``)."""
    if isinstance(buf, np.ndarray) or not (buf.is_cpu and buf.is_contiguous()) or buf.is_conj() or buf.is_neg():
        return as_bytes(buf)  # numpy arrays, and tensors whose bytes are not a plain view (as_bytes says why)
    return mpi().buffer.fromaddress(buf.data_ptr(), buf.nbytes)


class _MPIRequest(Request):
    """``expect``: a receive's byte count, checked when it completes (``SizeMismatch``): MPI takes a shorter
    message silently and reports a longer one as a bare truncation error. ``buf``: what the transfer reads or
    writes, held until the request goes (MPI has only its address)."""

    def __init__(self, req, peer: int, expect: int | None = None, buf=None):
        self.req, self.peer, self.expect, self.buf = req, peer, expect, buf
        self._done = False
        self._status = None if expect is None else mpi().Status()  # one for every poll of a receive

    def test(self) -> bool:
        if self.expect is None:
            return self.req.Test()
        if self._done:  # a completed request is MPI_REQUEST_NULL: its status would read 0 bytes
            return True
        try:
            done = self.req.Test(self._status)
        except mpi().Exception as exc:
            if exc.Get_error_class() != mpi().ERR_TRUNCATE:
                raise
            raise SizeMismatch(self.peer, None, self.expect) from None
        if done:
            self._done = True
            if self.peer is None:  # an any-source receive: the sender is known now
                self.peer = self._status.Get_source()
            got = self._status.Get_count(mpi().BYTE)
            if got != self.expect:
                raise SizeMismatch(self.peer, got, self.expect)
        return done

    def cancel(self) -> None:
        if not self.req.Test():
            self.req.Cancel()


class MPITransport(Transport):
    """Point-to-point and control exchanges over an mpi4py communicator."""

    name = "mpi"

    def __init__(self, comm, uid: str = "w"):
        self.comm = comm
        self.ctl = comm.Dup()
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.uid = uid  # the same on every member, unique in the job (see _TAG_CYCLE)
        self.tag_limit = mpi().COMM_WORLD.Get_attr(mpi().TAG_UB) + 1
        self._epoch = 0
        self._splits = 0

    @classmethod
    def world(cls, uid: str = "w", timeout: float | None = None) -> "MPITransport":
        """The job's transport; ``timeout``: how long MPI_Init may wait for the launch's processes (``mpi``)."""
        MPI = mpi(timeout)
        # A duplicate, so that the user's own traffic on COMM_WORLD never matches ours.
        return cls(MPI.COMM_WORLD.Dup(), uid)

    def exchange(self, obj: Any, deadline: Deadline, what: str) -> list:
        epoch = self._epoch
        tag = epoch % _TAG_CYCLE
        self._epoch += 1
        out: list = [None] * self.size
        out[self.rank] = obj
        if self.size == 1:
            return out
        stamp = (self.uid, epoch)
        sends = [_MPIRequest(self.ctl.isend((stamp, obj), dest=p, tag=tag), p)
                 for p in iter_peers(self.rank, self.size)]
        pending = set(iter_peers(self.rank, self.size))

        def poll() -> bool:
            for p in list(pending):
                msg = self.ctl.improbe(source=p, tag=tag)
                if msg is not None:
                    got, value = msg.recv()
                    if got != stamp:  # left over from another communicator or exchange: not ours
                        continue
                    out[p] = value
                    pending.discard(p)
            return not pending

        if not spin_until(poll, deadline):
            for s in sends:
                s.cancel()
            raise TimeoutError(what, pending, deadline.seconds)
        wait_all(sends, deadline, what)
        return out

    def split(self, color, key, members: Sequence[int]):
        MPI = mpi()
        self._splits += 1
        sub = self.comm.Split(MPI.UNDEFINED if color is None else color, key)
        if sub == MPI.COMM_NULL:
            return None
        return MPITransport(sub, f"{self.uid}.{self._splits}c{color}")

    def isend(self, buf, dst: int, tag: int = 0, sync: bool = False) -> Request:
        send = self.comm.Issend if sync else self.comm.Isend
        return _MPIRequest(send(_buffer(buf), dest=dst, tag=tag), dst, buf=buf)

    def irecv(self, buf, src: int | None, tag: int = 0) -> Request:
        data = _buffer(buf)
        source = mpi().ANY_SOURCE if src is None else src
        return _MPIRequest(self.comm.Irecv(data, source=source, tag=tag), src, data.nbytes, buf)

    def free(self) -> None:
        """Drop what is still queued for this communicator (after a timeout), then free it."""
        MPI = mpi()
        if MPI.Is_finalized():
            return
        status = MPI.Status()
        for c in (self.ctl, self.comm):
            if c != MPI.COMM_NULL:
                while True:
                    msg = c.Improbe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status)
                    if msg is None:
                        break
                    msg.Recv(bytearray(max(status.Get_count(MPI.BYTE), 1)))
                c.Free()

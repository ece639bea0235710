"""MPI host transport (mpi4py), used under mpirun/mpiexec of MPICH, Open MPI or Intel MPI."""
from __future__ import annotations

import threading
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


# Transfers dropped before MPI finished them, as (request, buffer): a send MPI could not cancel after a
# timeout (MPICH cannot, once the receiver has its envelope: it still reads the buffer when the receive comes),
# an isend or irecv whose handle the caller dropped. MPI has only the buffer's address, so the buffer lives here
# until MPI reports the request done (checked as transfers start): freed, it was reused, and a receiver got
# that memory's new contents (or MPICH failed reading it), a late receive wrote into it. A dict keyed by each
# entry's id, whose single operations need no lock (a request may be dropped on the worker thread of async calls).
_ORPHANS: dict = {}
_PRUNING = threading.Lock()  # one thread tests them at a time (MPI: no request is tested by two threads at once)
_ABANDONED: list = []  # communicators a member's failed call may still send into, left to MPI_Finalize
# Frees waiting for every member's word (MPITransport.free), as (request, word, communicators): the MPI
# communicators go once the word has come from every member, and only if no member's calls failed part way.
_FREEING: list = []
_SETTLING = threading.Lock()  # one thread settles them at a time


def _settle_frees() -> None:
    """Free the communicators whose members have all given their word (``MPITransport.free``), or keep them
    until MPI_Finalize where one member's calls failed part way; the others wait for the members still to come."""
    if not _FREEING or not _SETTLING.acquire(blocking=False):
        return
    try:
        MPI = mpi()
        if MPI.Is_finalized():
            return
        for entry in list(_FREEING):
            request, word, comms = entry
            if not request.Test():
                continue
            _FREEING.remove(entry)
            if word[0]:
                _ABANDONED.extend(comms)
                continue
            status = MPI.Status()
            for c in comms:  # drop what is still queued for it, then free it
                while True:
                    msg = c.Improbe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status)
                    if msg is None:
                        break
                    msg.Recv(bytearray(max(status.Get_count(MPI.BYTE), 1)))
                c.Free()
    finally:
        _SETTLING.release()


def _prune_orphans() -> None:
    if not _PRUNING.acquire(blocking=False):
        return  # another thread is at it
    try:
        for key, (req, _) in list(_ORPHANS.items()):
            if req.Test():
                _ORPHANS.pop(key, None)
    finally:
        _PRUNING.release()


class _MPIRequest(Request):
    """``expect``: a receive's byte count, checked when it completes (``SizeMismatch``, raised again by every
    later ``test``): MPI takes a shorter message silently and reports a longer one as a bare truncation error.
    ``buf``: what the transfer reads or writes, held until MPI has finished with it (``_ORPHANS``)."""

    def __init__(self, req, peer: int, expect: int | None = None, buf=None):
        self.req, self.peer, self.expect, self.buf = req, peer, expect, buf
        self._done = False  # MPI finished the request (a completed request is MPI_REQUEST_NULL)
        self._error: SizeMismatch | None = None
        self._status = None if expect is None else mpi().Status()  # one for every poll of a receive

    def test(self) -> bool:
        if self._error is not None:
            raise self._error
        if self._done:
            return True
        if self.expect is None:
            self._done = self.req.Test()
            return self._done
        try:
            done = self.req.Test(self._status)
        except mpi().Exception as exc:
            if exc.Get_error_class() != mpi().ERR_TRUNCATE:
                raise
            self._done = True
            source = self._status.Get_source()
            self._error = SizeMismatch(self.peer if self.peer is not None or source < 0 else source, None,
                                       self.expect)
            raise self._error from None
        if done:
            self._done = True
            if self.peer is None:  # an any-source receive: the sender is known now
                self.peer = self._status.Get_source()
            got = self._status.Get_count(mpi().BYTE)
            if got != self.expect:
                self._error = SizeMismatch(self.peer, got, self.expect)
                raise self._error
        return done

    def cancel(self) -> None:
        """Cancel a receive, so that it does not take a later message; a send stays pending (an orphan once
        dropped) until a receive matches it or its communicator is freed: MPI may not cancel a send (the
        feature is deprecated) and MPICH crashed trying, with another send to that peer pending."""
        if self.expect is not None and not self._done and not self.req.Test():
            self.req.Cancel()

    def __del__(self):
        try:
            if not self._done and self.req:  # (a request MPI has finished is MPI_REQUEST_NULL: falsy)
                entry = (self.req, self.buf)
                _ORPHANS[id(entry)] = entry
        except Exception:  # noqa: BLE001 - at interpreter exit, MPI may be gone
            pass


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
        _settle_frees()  # (a world made again after finalize: the old one's contexts go first)
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
        _settle_frees()
        sub = self.comm.Split(MPI.UNDEFINED if color is None else color, key)
        if sub == MPI.COMM_NULL:
            return None
        return MPITransport(sub, f"{self.uid}.{self._splits}c{color}")

    def isend(self, buf, dst: int, tag: int = 0, sync: bool = False) -> Request:
        if _ORPHANS:
            _prune_orphans()
        send = self.comm.Issend if sync else self.comm.Isend
        return _MPIRequest(send(_buffer(buf), dest=dst, tag=tag), dst, buf=buf)

    def irecv(self, buf, src: int | None, tag: int = 0) -> Request:
        if _ORPHANS:
            _prune_orphans()
        data = _buffer(buf)
        source = mpi().ANY_SOURCE if src is None else src
        return _MPIRequest(self.comm.Irecv(data, source=source, tag=tag), src, data.nbytes, buf)

    def free(self, abandon: bool = False) -> None:
        """Free both MPI communicators once every member has freed this transport and said that no call on it
        failed part way (``abandon``: one timed out, say); otherwise keep them until MPI_Finalize.

        A peer still in a timed-out call may send after this rank's free, and MPI gives a freed communicator's id
        to the next one made, whose calls then took the late message: a world made again after a timeout hung
        in its first all_reduce (Open MPI), and Open MPI aborted a later job step where the rank that freed had
        never entered the timed-out call (it could not know its peers still sent). So the members agree first:
        a non-blocking all-reduce of their words (it never waits: ``_settle_frees``, at the next free or
        communicator made, frees what it finished; one that never finishes keeps its communicators)."""
        MPI = mpi()
        if MPI.Is_finalized():
            return
        comms = [c for c in (self.ctl, self.comm) if c != MPI.COMM_NULL]
        word = np.array([int(abandon)], dtype=np.int32)
        request = self.ctl.Iallreduce(MPI.IN_PLACE, word, op=MPI.MAX)
        _FREEING.append((request, word, comms))
        _settle_frees()

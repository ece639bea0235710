"""MPI host transport (mpi4py), used under mpirun/mpiexec of MPICH, Open MPI or Intel MPI."""
from __future__ import annotations

from typing import Any, Sequence

from ..errors import TimeoutError
from .base import Deadline, Request, Transport, as_bytes, iter_peers, spin_until, wait_all

__all__ = ["MPITransport"]

# Control messages use a duplicate of the data communicator, so they never match user traffic; the tag
# cycles with the exchange count so that a message left over from a timed-out exchange cannot be
# taken for the next one.
_TAG_CYCLE = 1 << 15


def mpi():
    """The ``mpi4py.MPI`` module, imported on first use (importing it initialises MPI)."""
    from mpi4py import MPI

    return MPI


class _MPIRequest(Request):
    def __init__(self, req, peer: int):
        self.req, self.peer = req, peer

    def test(self) -> bool:
        return self.req.Test()

    def cancel(self) -> None:
        if not self.req.Test():
            self.req.Cancel()


class MPITransport(Transport):
    """Point-to-point and control exchanges over an mpi4py communicator."""

    name = "mpi"

    def __init__(self, comm):
        self.comm = comm
        self.ctl = comm.Dup()
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._epoch = 0

    @classmethod
    def world(cls) -> "MPITransport":
        MPI = mpi()
        # A duplicate, so that the user's own traffic on COMM_WORLD never matches ours.
        return cls(MPI.COMM_WORLD.Dup())

    def exchange(self, obj: Any, deadline: Deadline, what: str) -> list:
        tag = self._epoch % _TAG_CYCLE
        self._epoch += 1
        out: list = [None] * self.size
        out[self.rank] = obj
        if self.size == 1:
            return out
        sends = [_MPIRequest(self.ctl.isend(obj, dest=p, tag=tag), p) for p in iter_peers(self.rank, self.size)]
        pending = set(iter_peers(self.rank, self.size))

        def poll() -> bool:
            for p in list(pending):
                msg = self.ctl.improbe(source=p, tag=tag)
                if msg is not None:
                    out[p] = msg.recv()
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
        sub = self.comm.Split(MPI.UNDEFINED if color is None else color, key)
        if sub == MPI.COMM_NULL:
            return None
        return MPITransport(sub)

    def isend(self, buf, dst: int, tag: int = 0) -> Request:
        return _MPIRequest(self.comm.Isend(as_bytes(buf), dest=dst, tag=tag), dst)

    def irecv(self, buf, src: int, tag: int = 0) -> Request:
        return _MPIRequest(self.comm.Irecv(as_bytes(buf), source=src, tag=tag), src)

    def free(self) -> None:
        MPI = mpi()
        if MPI.Is_finalized():
            return
        for c in (self.ctl, self.comm):
            if c != MPI.COMM_NULL:
                c.Free()

"""The transport interface, deadlines, and the size-1 transport."""
from __future__ import annotations

import abc
import os
import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from ..errors import TimeoutError

__all__ = ["Deadline", "Request", "SizeMismatch", "Transport", "SelfTransport", "spin_until", "wait_all",
           "USER_TAG_LIMIT", "SETUP_TAG", "OBJECT_TAG", "COLLECTIVE_TAGS"]

# The tags on a transport: users' point-to-point tags live below USER_TAG_LIMIT; symm's set-up messages and the
# object messages of send_object_list take one tag each just above it; collectives take the tags from
# COLLECTIVE_TAGS up to the transport's ``tag_limit``, a fresh one a call (``collectives.cpu.base.tag_for``), so
# that none of the three takes another's messages, and a message nobody received (a collective whose ranks
# disagreed) is not taken by a later call before the tags come round again (2**29 calls under MPICH).
USER_TAG_LIMIT = 1 << 14
SETUP_TAG, OBJECT_TAG, COLLECTIVE_TAGS = USER_TAG_LIMIT, USER_TAG_LIMIT + 1, USER_TAG_LIMIT + 2

# After this long without progress a waiting rank sleeps between polls instead of only yielding: with
# more ranks than cores a yielding rank still competes for the core the rank it waits for needs (8
# ranks on 2 cores: a ring all-reduce took 30 ms with a 50 ms spin phase, 17 ms with 0.2 ms).
_SPIN_BEFORE_SLEEP_S = 0.0002
_SLEEP_S = 0.00005


class Deadline:
    """A point in time a wait must not pass; ``seconds`` is kept for the error message."""

    __slots__ = ("seconds", "end")

    def __init__(self, seconds: float):
        self.seconds = float(seconds)
        self.end = time.monotonic() + self.seconds

    def remaining(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.end


def spin_until(poll: Callable[[], bool], deadline: Deadline) -> bool:
    """Call ``poll`` until it returns True (-> True) or the deadline passes (-> False).

    Every iteration yields the CPU: with more ranks than cores a spinning rank would otherwise hold
    its core for a whole time slice and a barrier would cost milliseconds.
    """
    start = time.monotonic()
    while True:
        if poll():
            return True
        now = time.monotonic()
        if now >= deadline.end:
            return False
        if now - start > _SPIN_BEFORE_SLEEP_S:
            time.sleep(_SLEEP_S)
        else:
            os.sched_yield()


class Request(abc.ABC):
    """A pending point-to-point transfer with ``peer`` (rank in the transport's communicator)."""

    peer: int

    @abc.abstractmethod
    def test(self) -> bool:
        """Whether the transfer has completed; never blocks."""

    def wait_for(self, seconds: float) -> bool:
        """Block up to ``seconds``; True when complete. Transports with a blocking wait override this."""
        return spin_until(self.test, Deadline(seconds))

    def cancel(self) -> None:
        """Give up on the transfer (after a timeout); best effort."""


class SizeMismatch(ValueError):
    """A receive got another number of bytes than its buffer holds: the ranks passed different sizes."""

    def __init__(self, peer: int | None, got: int | None, expected: int):
        sent = "more" if got is None else str(got)
        who = "a rank" if peer is None else f"rank {peer}"  # None: an any-source receive that failed
        super().__init__(f"{who} sent {sent} bytes where this rank expected {expected} (the ranks passed "
                         f"different sizes)")


def wait_all(requests: Sequence[Request], deadline: Deadline, what: str) -> None:
    """Wait for every request, or raise ``xelink.TimeoutError`` naming the peers that did not answer (a
    ``ValueError`` naming ``what`` and the peer for a receive of another size than was sent)."""
    try:
        _wait_all(requests, deadline, what)
    except SizeMismatch as exc:
        raise ValueError(f"{what}: {exc}") from None


def _wait_all(requests: Sequence[Request], deadline: Deadline, what: str) -> None:
    pending = [r for r in requests if not r.test()]
    for i, req in enumerate(pending):
        if req.wait_for(deadline.remaining()):
            continue
        # Of the rest, only those still unfinished count as missing (one last look at each: some
        # transports learn of completion only by waiting).
        missing = {req.peer} | {r.peer for r in pending[i + 1:] if not r.wait_for(0.0)}
        for r in pending[i:]:
            r.cancel()
        raise TimeoutError(what, missing, deadline.seconds)


class Transport(abc.ABC):
    """Moves bytes and small control objects between ``size`` ranks; ``rank`` is this process's.

    Buffers are torch CPU tensors or numpy arrays, contiguous; only their bytes matter.
    """

    name: str = "?"
    rank: int
    size: int
    tag_limit: int = 1 << 15  # one past the largest tag (MPI guarantees at least this much)

    @abc.abstractmethod
    def exchange(self, obj: Any, deadline: Deadline, what: str) -> list:
        """All-gather one picklable object per rank, or raise ``TimeoutError`` naming absent ranks.

        Collective. Also the host barrier: ``exchange(None, ...)``.
        """

    @abc.abstractmethod
    def split(self, color: int | None, key: int, members: Sequence[int]) -> "Transport | None":
        """The transport of the sub-communicator with ``color`` (None: not a member -> None).

        ``members`` lists the parent ranks of the new communicator in their new order; every rank
        learned it from an ``exchange`` just before, so the split itself cannot wait on an absent rank.
        Collective over the parent.
        """

    @abc.abstractmethod
    def isend(self, buf, dst: int, tag: int = 0, sync: bool = False) -> Request:
        """Start sending the bytes of ``buf`` to rank ``dst``. ``sync``: the request completes only once ``dst``
        has posted the matching receive (MPI's synchronous mode), so that a send nobody receives times out
        rather than completing from a buffer and staying queued; a transport without such a mode ignores it."""

    @abc.abstractmethod
    def irecv(self, buf, src: int | None, tag: int = 0) -> Request:
        """Start receiving into ``buf`` from rank ``src`` (None: from any rank; the request's ``peer`` is the
        sender once it completed, None before)."""

    def free(self, abandon: bool = False) -> None:
        """Release what the transport holds; it must not be used afterwards. ``abandon``: a call on it failed part
        way (a timeout), so peers may still send into it: keep what their late messages reach instead."""


class SelfTransport(Transport):
    """World size 1: every collective is a no-op; there is no peer to talk to."""

    name = "self"

    def __init__(self):
        self.rank, self.size = 0, 1

    def exchange(self, obj, deadline, what):
        return [obj]

    def split(self, color, key, members):
        return None if color is None else SelfTransport()

    def isend(self, buf, dst, tag=0, sync=False):
        raise ValueError(f"isend: dst={dst} is this rank itself (world size 1)")

    def irecv(self, buf, src, tag=0):
        if src is None:
            raise ValueError("irecv: src=None (any source) in a world of one rank: no other rank can send")
        raise ValueError(f"irecv: src={src} is this rank itself (world size 1)")


def as_bytes(buf) -> Any:
    """A flat uint8 view of a contiguous numpy array or torch CPU tensor (no copy)."""
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    import torch

    return buf.reshape(-1).view(torch.uint8).numpy()


def iter_peers(rank: int, size: int) -> Iterable[int]:
    """Peers in the order that spreads load: rank+1, rank+2, ... (wrapping)."""
    return ((rank + i) % size for i in range(1, size))

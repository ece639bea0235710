"""Peer memory on one host: MPI-3 shared-memory windows and a peer-counter barrier.

The latency path of the collectives reads and writes its peers' buffers directly instead of sending
messages. ``PeerWindow(comm, nbytes)`` gives every rank of ``comm`` that sits on this host one segment
of a shared-memory window (``MPI_Win_allocate_shared`` over the host's ranks) and numpy / torch views
of every peer's segment; ``PeerCounters`` is the synchronisation that goes with it: one monotonic
counter per rank in a second, small shared window, so a barrier between phases costs a few stores and
polls instead of a host round trip.

Indices: ``peer(i)``, ``view(i, ...)``, ``wait_for([i, ...])`` take *node ranks* (0 .. node_size-1,
this host's ranks of ``comm`` in comm-rank order); ``node_ranks[i]`` is node rank i's rank in
``comm``. When every rank of ``comm`` is on this host (``spans_comm``), node rank == comm rank.
Errors (``xelink.TimeoutError``) always name comm ranks.

A one-shot all-gather on one host, for example::

    if not shm.available(comm):           # e.g. torchrun: fall back to point-to-point
        ...
    pw = PeerWindow(comm, nbytes)         # collective; keep it and ensure() per call
    pw.ensure(x.nbytes)                   # collective; True when reallocated (views are stale)
    pw.view(pw.node_rank, x.dtype, x.size)[:] = x
    pw.barrier()                          # everyone's data is written and visible
    for i in range(pw.node_size):
        out[i] = pw.view(i, x.dtype, x.size)
    pw.barrier()                          # nobody overwrites its segment while a peer still reads

Lifetime: ``free()`` (collective) releases a window; ``free_all(comm)`` releases every window made on
``comm`` and ``free_all()`` those of every communicator, in an order all ranks agree on.

Where the memory lives (MPICH 5, measured with strace; see ``tests/test_shm_leaks.py``): each window
is a file ``/dev/shm/mpich_shar_tmpXXXXXX`` made by ``mkstemp`` (mode 0600), opened by the other node
ranks and unlinked by its creator as soon as all have mapped it, inside ``MPI_Win_allocate_shared``;
from then on only the mappings keep it, and the kernel frees it when the last process exits, crashed
or not. MPICH's own intra-node slab ``/dev/shm/mpich_shm_<job>_<node>`` (mode 0600) is different: it
stays linked for the whole job and only ``MPI_Finalize`` unlinks it, so every crashed MPICH job leaves
one behind. ``unlink_mpich_init_segment()`` unlinks it early (safe: every local rank has mapped it
before any rank's ``MPI_Init`` returns); creating a ``PeerWindow``/``PeerCounters`` calls it.
"""
from __future__ import annotations

import os
import re
import time
import weakref
from typing import Iterable

import numpy as np

from .. import log
from ..config import integer
from ..errors import ConfigError, TimeoutError, XelinkError
from .base import Deadline, spin_until

__all__ = [
    "PeerWindow",
    "PeerCounters",
    "PeerMemoryUnavailable",
    "ProgressBoard",
    "SHM_DIR",
    "available",
    "free_all",
    "shm_free_bytes",
    "unlink_mpich_init_segment",
]

_log = log.get_logger("shm")

# Segments are sized in whole cache lines: peers' segments never share a line (no false sharing
# between a writer and its neighbours' readers) and every dtype up to 64 bytes is aligned.
_ALIGN = 64
# One cache line of int64 slots per rank in the counter window; only the owner writes its line.
_LINE_SLOTS = _ALIGN // 8
_EPOCH, _POSTED, _CONTROL = 0, 1, 2
_NOTE = 3  # _NOTE + epoch % 2: what a rank announced with a barrier (one slot per parity: a peer is a barrier ahead
# at most, so it cannot overwrite the value of the barrier others are still reading)


class PeerMemoryUnavailable(ValueError):
    """Peer memory cannot be had: the communicator's transport is not MPI, or this host's shared-memory
    filesystem has no room for the window (``SHM_DIR``); use point-to-point instead."""


# Where MPICH puts its shared windows (above). A window is a tmpfs file whose pages are taken when first touched, so
# one larger than the free space there (a container's default /dev/shm is 64 MB) is made without an error and then
# kills the process with SIGBUS when a rank writes past what is left. A window is checked against it first.
SHM_DIR = "/dev/shm"
_PAGE = 4096


def shm_free_bytes() -> int | None:
    """Free bytes of ``SHM_DIR`` for an unprivileged writer, or None where it cannot be read (no such directory)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _node_free(node) -> int | None:
    """``shm_free_bytes()`` as node rank 0 reads it, on every node rank (collective over the node's ranks), so that
    they all take the same decision."""
    free = shm_free_bytes() if node.rank == 0 else None
    return node.mpi.bcast(free, root=0) if node.size > 1 else free


def _shm_need(node, each: int) -> int:
    """Bytes of ``SHM_DIR`` a window of ``each`` bytes per node rank takes (a segment starts on its own page)."""
    return node.size * (-(-(each + _ALIGN) // _PAGE) * _PAGE)


def _fits(node, each: int, free: int | None) -> bool:
    """A window of ``each`` bytes per node rank fits in ``free`` bytes (``_node_free``; None: not known, taken)."""
    return free is None or _shm_need(node, each) <= free


def _no_room(fn: str, node, each: int, free: int) -> PeerMemoryUnavailable:
    return PeerMemoryUnavailable(
        f"{fn}: a shared window of {each} B for each of the {node.size} rank(s) on this host needs "
        f"{_shm_need(node, each)} B of {SHM_DIR}, which has {free} B free (a container's is often 64 MB: docker run "
        f"--shm-size, or smaller messages); pages past its free space would kill the ranks with SIGBUS when touched")


def _mpi():
    from mpi4py import MPI

    return MPI


def available(comm) -> bool:
    """Whether ``PeerWindow(comm, ...)`` can work: the communicator is live and its transport is MPI."""
    return getattr(getattr(comm, "transport", None), "name", None) == "mpi" and not getattr(comm, "_freed", True)


def _check_comm(fn: str, comm):
    # Duck-typed: this module sits below ``comm`` (which imports it to free windows) and must not import it.
    if not all(hasattr(comm, a) for a in ("transport", "allgather_object", "world_ranks", "_live")):
        raise TypeError(f"{fn}: comm={comm!r} is not an xelink Communicator")
    transport = comm._live(fn)
    if transport.name != "mpi":
        raise PeerMemoryUnavailable(
            f"{fn}: comm.transport.name={transport.name!r}: peer memory needs the 'mpi' transport (MPI-3 "
            f"shared-memory windows); use point-to-point over the {transport.name!r} transport instead")
    return transport


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _as_deadline(fn: str, deadline, comm) -> Deadline | None:
    """A ``Deadline``, seconds (validated now) or None: the communicator's default, made only if a
    wait has to spin (building one costs about as much as a whole uncontended barrier)."""
    if deadline is None or isinstance(deadline, Deadline):
        return deadline
    return comm.deadline(deadline, fn)


def _read_delay(comm) -> float:
    """Seconds this rank sleeps after each ``PeerWindow.barrier`` (test hook, 0 unless asked for).

    ``XELINK_TEST_READ_DELAY="<world rank>[,<world rank>...]:<seconds>"`` makes the named ranks late
    readers: they leave the barrier, sleep, then read their peers' segments. Tests use it to make a
    slot-reuse race happen on every run instead of now and then. Read when a window is made.
    """
    spec = os.environ.get("XELINK_TEST_READ_DELAY", "")
    if not spec:
        return 0.0
    try:
        ranks, seconds = spec.split(":")
        late = {int(r) for r in ranks.split(",")}
        delay = float(seconds)
    except ValueError:
        raise ConfigError(f"XELINK_TEST_READ_DELAY={spec!r} is not '<rank>[,<rank>...]:<seconds>'") from None
    return delay if comm.world_ranks[comm.rank] in late else 0.0


# ---------------------------------------------------------------------------------------------
# MPICH's init slab

_MPICH_SLAB = re.compile(r"^/dev/shm/(mpich_shm_[0-9a-f]+_\d+)$")


def unlink_mpich_init_segment() -> list[str]:
    """Unlink MPICH's intra-node slab ``/dev/shm/mpich_shm_<job>_<node>`` that this process maps.

    MPICH creates the slab during ``MPI_Init`` and unlinks it only in ``MPI_Finalize``, so a job that
    crashes leaves it in ``/dev/shm`` (about 2 MiB each). Unlinking it early is safe: during
    ``MPI_Init`` every local rank maps the slab and then waits until all the others have flagged that
    they mapped it too, so once ``MPI_Init`` has returned nobody opens it by name again; the mappings
    keep the memory, and the kernel frees it when the last rank exits. MPICH's own unlink at
    finalize then fails with ENOENT, which MPICH ignores. Only names this process has mapped are
    touched, so other jobs' slabs are never removed. (MPICH's per-VCI slab ``mpich_vci_*`` can be
    created later, lazily, and is left alone.)

    Returns:
        The names unlinked by this call (empty when already gone or not on Linux).
    """
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[5].strip() for line in f if line.count(" ") >= 5 and "/dev/shm/" in line}
    except OSError:
        return []
    done = []
    for path in sorted(paths):
        m = _MPICH_SLAB.match(path)
        if m is None:
            continue
        try:
            os.unlink(path)
            done.append(m.group(1))
        except FileNotFoundError:  # another local rank was first
            pass
    if done:
        _log.debug("unlinked MPICH's init slab %s early, so a crash cannot leave it behind", done)
    return done


# ---------------------------------------------------------------------------------------------
# Registry: what free_all(comm) frees


# comm -> weak references to its PeerWindow/PeerCounters, in creation order. Creation is collective,
# so the order is the same on every rank, and free_all frees (collectively) in that order.
_registry: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _register(comm, obj) -> None:
    refs = _registry.setdefault(comm, [])
    refs[:] = [r for r in refs if r() is not None]
    refs.append(weakref.ref(obj))


# Windows given up without MPI_Win_free (``abandon_all``): held until the process ends, MPI_Finalize frees them.
_abandoned: list = []


def abandon_all() -> None:
    """Forget every live window without freeing it: where the world broke (a timeout), its ranks may be anywhere,
    and MPI_Win_free, which has no deadline, could wait for one forever; MPI_Finalize releases them at exit."""
    for refs in _registry.values():
        _abandoned.extend(obj for obj in (ref() for ref in refs) if obj is not None)
    _registry.clear()


def free_all(comm=None) -> int:
    """Free every live ``PeerWindow``/``PeerCounters`` made on ``comm`` (all communicators: None).

    With ``comm=None`` the communicators are taken in the order of their names (equal on every rank and
    unique in the job), so ranks that belong to different sets of communicators still free the windows
    they share in the same order, and no two ranks wait on each other's ``MPI_Win_free``.

    Returns:
        How many objects were freed here.

    Collective: every rank of ``comm`` (of every communicator, for None) must call this.
    """
    if comm is None:
        comms = sorted(list(_registry.keys()), key=lambda c: c.name)
    else:
        comms = [comm]
    freed = 0
    for c in comms:
        for ref in _registry.pop(c, []):
            obj = ref()
            if obj is not None and not obj.freed:
                obj.free()
                freed += 1
    return freed


# ---------------------------------------------------------------------------------------------
# The host's ranks


class _Node:
    """The ranks of ``comm`` on this host: an MPI communicator and the rank translation."""

    def __init__(self, comm, transport):
        MPI = _mpi()
        parent = transport.comm
        # key = comm rank: node order is comm-rank order, so node rank == comm rank on one host.
        self.mpi = parent.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
        self.rank, self.size = self.mpi.Get_rank(), self.mpi.Get_size()
        mine, theirs = self.mpi.Get_group(), parent.Get_group()
        try:
            self.comm_ranks = [int(r) for r in MPI.Group.Translate_ranks(mine, list(range(self.size)), theirs)]
        finally:
            mine.Free()
            theirs.Free()
        unlink_mpich_init_segment()

    def free(self) -> None:
        MPI = _mpi()
        if not MPI.Is_finalized() and self.mpi != MPI.COMM_NULL:
            self.mpi.Free()


def _allocate(node: _Node, nbytes: int, disp_unit: int = 1):
    """A shared window of ``nbytes`` per node rank, under a passive-target epoch, and its segments.

    Returns the window and one uint8 array of ``nbytes`` per node rank, each starting 64-byte aligned.
    """
    MPI = _mpi()
    info = MPI.Info.Create()
    # Non-contiguous: every rank's segment starts on its own page, so the owner's first touch places
    # it on the owner's NUMA node and segments never share a page.
    info.Set("alloc_shared_noncontig", "true")
    # One spare line: a node of one rank gets plain malloc memory from MPICH (16-byte aligned only,
    # measured), so the segment's aligned start may lie up to 63 bytes in.
    padded = nbytes + _ALIGN if nbytes else 0
    try:
        win = MPI.Win.Allocate_shared(padded, disp_unit, info=info, comm=node.mpi)
    finally:
        info.Free()
    # One passive-target epoch for the window's whole life: loads and stores need no MPI calls, and
    # Win_sync (legal only inside an epoch) serves as the memory barrier.
    win.Lock_all(MPI.MODE_NOCHECK)
    segs = []
    for i in range(node.size):
        mem, _ = win.Shared_query(i)
        if not nbytes:
            segs.append(np.empty(0, dtype=np.uint8))
            continue
        whole = np.frombuffer(mem, dtype=np.uint8)
        start = -mem.address % _ALIGN  # the same on every rank: it depends on the address only
        segs.append(whole[start:start + nbytes])
    return win, segs


def _lines(node: _Node):
    """A window of one zeroed cache line of int64 slots per node rank, seen by every node rank.

    Returns the window, one memoryview of int64 ('q') per node rank and this rank's own. Item access
    through a memoryview is a single aligned 8-byte load or store (CPython copies a fixed 8 bytes) and
    costs a third of a numpy scalar access on a polling path. Collective over the node's ranks.
    """
    win, segs = _allocate(node, _ALIGN, 8)
    lines = [memoryview(s).cast("q") for s in segs]
    mine = lines[node.rank]
    for k in range(_LINE_SLOTS):
        mine[k] = 0
    # Zeroed lines must be visible before anyone reads them; every node rank is inside this call.
    win.Sync()
    node.mpi.Barrier()
    win.Sync()
    return win, lines, mine


def _release(win) -> None:
    MPI = _mpi()
    if win is None or MPI.Is_finalized():
        return
    win.Unlock_all()
    win.Free()


# ---------------------------------------------------------------------------------------------
# Counters


class _OnNode:
    """Placement on the host that PeerCounters and PeerWindow share (both keep ``_node`` and ``_freed``)."""

    @property
    def node_rank(self) -> int:
        return self._node.rank

    @property
    def node_size(self) -> int:
        return self._node.size

    @property
    def node_ranks(self) -> list[int]:
        """``node_ranks[i]``: node rank i's rank in ``comm``."""
        return list(self._node.comm_ranks)

    @property
    def freed(self) -> bool:
        return self._freed


class PeerCounters(_OnNode):
    """Monotonic per-rank counters in shared memory: a barrier and flags among one host's ranks.

    Memory-ordering argument (why plain loads and stores suffice, with no read-modify-write):
    every slot has exactly one writer, its owner, who keeps the value it last wrote in a Python
    int and stores the next one; nobody else ever writes it, so no update can be lost and no atomic
    increment is needed (a shared ``+=`` in numpy is *not* atomic: it loses updates). The slots are
    8-byte aligned int64, whose loads and stores are single-copy atomic on x86-64 and aarch64, so a
    reader sees either the old or the new value, never a torn one. Values only grow, so a reader that
    sees a stale value merely waits a little longer, and one that sees a later epoch than it waits
    for (the writer is already a barrier ahead) is right to go on: waits compare with ``>=``.
    Ordering with the data: the writer issues ``Win_sync`` (a full memory barrier in MPICH and Open
    MPI) between its data stores and the counter store (release); the reader issues ``Win_sync``
    after it saw the counter and before it reads the data (acquire). ``Win_sync`` is also called in
    every poll, which the unified memory model asks for before a load can be relied on to see a
    peer's store.

    Each rank owns one cache line of slots: ``epoch`` (barriers), ``posted`` (``post``/``wait_value``),
    ``control`` (the rendezvous of ``ensure``/``free``, kept apart from ``epoch`` so that a barrier
    that timed out on some ranks cannot shift it) and two ``note`` slots (what a rank announces with a
    ``barrier``, by the parity of its epoch: written before the epoch's release, read after its acquire).

    Args:
        comm: an xelink communicator whose transport is MPI; the counters cover its ranks on this host.
        timeout: deadline (seconds) of the creation rendezvous; the communicator's default when None.

    Collective: every rank of ``comm`` must call this.
    """

    def __init__(self, comm, timeout=None, *, _node: _Node | None = None, _what: str = "PeerCounters"):
        transport = _check_comm(_what, comm)
        self.comm = comm
        self._freed = False
        self._broken: Exception | None = None
        self._own_node = _node is None
        if _node is None:
            # Everyone arrives before the MPI collectives, which have no deadline of their own.
            comm.rendezvous(_what, timeout, _what)
            _node = _Node(comm, transport)
        self._node = _node
        self._win, self._lines, self._mine = _lines(_node)
        self.epoch = 0  # barriers this rank has arrived at
        self.posted = 0  # the last value this rank posted
        self._control = 0
        self._guard([self._win])
        if self._own_node:
            _register(comm, self)

    # -- the memory barrier --------------------------------------------------------------------
    def _guard(self, wins) -> None:
        # Win_sync on every window whose memory the counters order: the standard promises it only
        # for the window it is called on (in MPICH it is one processor-wide barrier anyway).
        self._syncs = tuple(w.Sync for w in wins)

    def _fence(self) -> None:
        for sync in self._syncs:
            sync()

    def _usable(self, fn: str) -> None:
        if self._freed:
            raise XelinkError(f"{fn}: the counters were freed")
        if self._broken is not None:
            raise XelinkError(f"{fn}: the counters are unusable after an earlier timeout ({self._broken}); "
                              f"free them and make new ones")

    def _node_ranks_arg(self, fn: str, ranks) -> list[int]:
        if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
            raise TypeError(f"{fn}: ranks={ranks!r} must be a sequence of node ranks")
        out = []
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, (int, np.integer)):
                raise TypeError(f"{fn}: rank {r!r} must be an int (a node rank)")
            if not 0 <= r < self._node.size:
                raise ValueError(f"{fn}: rank {r} is not a node rank (0..{self._node.size - 1})")
            out.append(int(r))
        return out

    def _wait(self, slot: int, ranks: Iterable[int], target: int, deadline: Deadline | None, what: str,
              mark_broken: bool = True) -> None:
        lines, me, fence = self._lines, self._node.rank, self._fence
        fence()
        pending = [i for i in ranks if i != me and lines[i][slot] < target]
        if pending:
            def poll() -> bool:
                fence()
                pending[:] = [i for i in pending if lines[i][slot] < target]
                return not pending

            if deadline is None:
                deadline = Deadline(self.comm.timeout)
            if not spin_until(poll, deadline):
                exc = TimeoutError(what, [self._node.comm_ranks[i] for i in pending], deadline.seconds,
                                   group=self.comm)
                if mark_broken:
                    self._broken = exc
                raise exc
        fence()  # acquire: the data the peers wrote before their counters, not older values

    # -- barrier --------------------------------------------------------------------------------
    def arrive(self) -> int:
        """Announce that this rank reached the next barrier epoch; returns the epoch. Never waits."""
        self._usable("PeerCounters.arrive")
        self.epoch += 1
        # Release: my stores before the barrier become visible no later than the counter. No fence
        # after the store is needed: the store drains on its own, and whoever waits next fences.
        self._fence()
        self._mine[_EPOCH] = self.epoch
        return self.epoch

    def wait_all(self, deadline=None, what: str = "PeerCounters.wait_all") -> None:
        """Wait until every node rank has arrived at this rank's epoch.

        Args:
            deadline: a ``Deadline``, seconds, or None for the communicator's default timeout.
            what: the operation named in the error.

        Raises:
            xelink.TimeoutError: naming (comm ranks) those that did not arrive; the counters are
                unusable afterwards (the ranks' epochs disagree): free them.
        """
        self._usable(what)
        d = _as_deadline(what, deadline, self.comm)
        self._wait(_EPOCH, range(self._node.size), self.epoch, d, what)

    def wait_for(self, ranks: Iterable[int], deadline=None, what: str = "PeerCounters.wait_for") -> None:
        """Like ``wait_all``, for the node ranks in ``ranks`` only (e.g. the peers this rank reads)."""
        self._usable(what)
        ranks = self._node_ranks_arg(what, ranks)
        d = _as_deadline(what, deadline, self.comm)
        self._wait(_EPOCH, ranks, self.epoch, d, what)

    def barrier(self, deadline=None, what: str = "PeerCounters.barrier", note: int = 0) -> None:
        """``arrive()`` then ``wait_all()``: no rank leaves before every node rank has come. ``note``: an int
        this rank announces with the barrier, which ``notes()`` reads back from every rank after it (e.g. the
        size each rank passed, to catch a mismatch).

        Collective: every node rank must call this.
        """
        d = _as_deadline(what, deadline, self.comm)  # a bad deadline fails before anyone is told we came
        self._usable(what)
        self.epoch += 1
        self._mine[_NOTE + self.epoch % 2] = note
        self._fence()  # release, as in arrive()
        self._mine[_EPOCH] = self.epoch
        self._wait(_EPOCH, range(self._node.size), self.epoch, d, what)

    def notes(self) -> list[int]:
        """Every node rank's ``note`` of the last barrier, in node order (call between that barrier and the next)."""
        k = _NOTE + self.epoch % 2
        return [line[k] for line in self._lines]  # a 'q' memoryview's items are ints already

    # -- flags ------------------------------------------------------------------------------------
    def post(self, value: int) -> None:
        """Publish ``value`` (>= the last value posted: the slot is monotonic), after my earlier stores.

        E.g. "chunks 0..j of my buffer are written": ``post(base + j + 1)``. Never waits.
        """
        self._usable("PeerCounters.post")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"PeerCounters.post: value={value!r} must be an int")
        if value < self.posted:
            raise ValueError(f"PeerCounters.post: value={value} < the last value posted ({self.posted}); "
                             f"posted values must not decrease")
        self.posted = int(value)
        self._fence()  # release: the stores this value announces first
        self._mine[_POSTED] = self.posted

    def wait_value(self, rank: int, value: int, deadline=None, what: str = "PeerCounters.wait_value") -> None:
        """Wait until node rank ``rank`` has posted a value >= ``value``; then its earlier stores are visible.

        Raises:
            xelink.TimeoutError: naming the comm rank of ``rank``.
        """
        self._usable(what)
        (rank,) = self._node_ranks_arg(what, [rank])
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{what}: value={value!r} must be an int")
        d = _as_deadline(what, deadline, self.comm)
        if rank == self._node.rank:
            if self.posted < value:
                raise ValueError(f"{what}: waiting for this rank's own value {value}, but it posted {self.posted}")
            return
        self._wait(_POSTED, [rank], int(value), d, what)

    def peek(self, rank: int) -> tuple[int, int]:
        """``(epoch, posted)`` of node rank ``rank`` as seen now; never waits."""
        (rank,) = self._node_ranks_arg("PeerCounters.peek", [rank])
        self._fence()
        line = self._lines[rank]
        return line[_EPOCH], line[_POSTED]

    # -- control ----------------------------------------------------------------------------------
    def _rendezvous(self, deadline: Deadline, what: str) -> None:
        """Every node rank has entered the same control operation (``ensure``, ``free``), in two rounds (as
        ``Communicator.rendezvous``'s): a rank that timed out in the first has posted it, never the second, so a
        late rank cannot take the first alone for everyone going on into the MPI call after it."""
        for _ in range(2):
            self._control += 1
            self._fence()
            self._mine[_CONTROL] = self._control
            self._wait(_CONTROL, range(self._node.size), self._control, deadline, what, mark_broken=False)

    def _free_windows(self) -> None:
        for mv in self._lines or ():
            mv.release()  # before the memory goes away
        self._lines = self._mine = None
        _release(self._win)
        self._win = None
        self._syncs = ()

    def free(self, timeout=None) -> None:
        """Release the counter window. Idempotent.

        Waits (up to ``timeout``, default the communicator's) until every node rank is freeing too,
        so that ``MPI_Win_free`` cannot block on an absent rank; raises ``xelink.TimeoutError``
        naming those that did not come (the window is then left to the end of the process).

        Collective: every node rank must call this.
        """
        if self._freed:
            return
        MPI = _mpi()
        if not MPI.Is_finalized():
            self._rendezvous(self.comm.deadline(timeout, "PeerCounters.free"), "PeerCounters.free")
        self._freed = True
        self._free_windows()
        if self._own_node:
            self._node.free()

    def __repr__(self) -> str:
        state = ", freed" if self._freed else ""
        return f"PeerCounters(node_rank={self._node.rank}, node_size={self._node.size}, epoch={self.epoch}{state})"


# ---------------------------------------------------------------------------------------------
# Progress board


class ProgressBoard(_OnNode):
    """Which collective each rank of this host entered last, for errors that name the rank holding
    the others up (one board for the world, shared by every communicator made from it).

    Each rank owns one cache line and stores three values in it as it enters a collective: the
    communicator's id, the call's sequence number on that communicator, and the time
    (``time.monotonic_ns``: CLOCK_MONOTONIC, one clock for every process of a host). Nobody waits on
    these values: they are read only when a wait has timed out, long after they were stored, so
    plain stores with no fence cost a few nanoseconds on the collectives' path and are visible by
    the time anyone looks.

    Not in ``free_all``'s registry: the world owns it and ``free()``s it last, in ``finalize``.

    Collective: every rank of ``world`` must call this.
    """

    _ID, _SEQ, _AT = 0, 1, 2

    def __init__(self, world, timeout=None):
        transport = _check_comm("ProgressBoard", world)
        self.comm = world
        self._freed = False
        world.rendezvous("ProgressBoard", timeout, "ProgressBoard")  # everyone is here before the MPI calls
        self._node = _Node(world, transport)
        self._win, self._lines, self._mine = _lines(self._node)
        self._index = {w: i for i, w in enumerate(world.world_ranks[r] for r in self._node.comm_ranks)}

    def enter(self, comm_id: int, seq: int) -> None:
        """Post that this rank entered call ``seq`` of the communicator ``comm_id``; never waits."""
        mine = self._mine
        mine[self._AT] = time.monotonic_ns()
        mine[self._SEQ] = seq
        mine[self._ID] = comm_id

    def entries(self) -> dict[int, tuple[int, int, int]]:
        """``{world rank: (communicator id, sequence number, monotonic ns)}`` for this host's ranks."""
        if self._freed:
            return {}
        self._win.Sync()
        return {w: (self._lines[i][self._ID], self._lines[i][self._SEQ], self._lines[i][self._AT])
                for w, i in self._index.items()}

    def free(self) -> None:
        """Release the board (collective over this host's ranks, like ``MPI_Win_free``). Idempotent."""
        if self._freed:
            return
        self._freed = True
        for mv in self._lines:
            mv.release()
        self._lines = self._mine = None
        _release(self._win)
        self._win = None
        self._node.free()


# ---------------------------------------------------------------------------------------------
# Windows


class PeerWindow(_OnNode):
    """One shared-memory segment per rank of ``comm`` on this host, readable and writable by all of them.

    Args:
        comm: an xelink communicator whose transport is MPI (else ``PeerMemoryUnavailable``, a
            ``ValueError``: fall back to point-to-point). It may span hosts; the window then covers
            this host's ranks of it.
        nbytes: bytes of each segment (0 allowed); the largest value any rank passes is taken.
        timeout: deadline (seconds) of the creation rendezvous; the communicator's default when None.
        fn: the call its errors name (a collective making its window on first use).

    Raises:
        PeerMemoryUnavailable: the transport is not MPI, or (on every node rank alike) ``SHM_DIR`` has no room for
            the window: the pages past its free space would kill the ranks with SIGBUS when first touched.

    Attributes:
        node_ranks: the comm ranks on this host, in node order (``peer(i)`` is ``node_ranks[i]``'s).
        node_rank, node_size: this rank's index in ``node_ranks`` and their number.
        spans_comm: every rank of ``comm`` is on this host (node rank == comm rank).
        nbytes: the usable bytes of every segment (the largest asked for so far).
        capacity: bytes allocated per segment (``nbytes`` rounded up to 64, grown geometrically).
        generation: incremented whenever ``ensure`` reallocates.
        counters: ``PeerCounters`` on the same ranks; their barrier orders this window's memory too.

    Views (``local``, ``peer``, ``view``, ``torch_view``) alias the shared memory. They become invalid
    (using one may crash the process) when ``ensure`` reallocates or ``free`` runs: take them afresh
    after either.

    Collective: every rank of ``comm`` must call this.
    """

    def __init__(self, comm, nbytes: int, timeout=None, fn: str = "PeerWindow"):
        transport = _check_comm(fn, comm)
        nbytes = integer(fn, "nbytes", nbytes, 0)
        self.comm = comm
        self._freed = False
        # Everyone arrives (with a deadline) before the MPI collectives, which have none.
        sizes = comm.rendezvous(("PeerWindow", nbytes), timeout, fn)
        odd = [r for r, s in enumerate(sizes) if not (isinstance(s, tuple) and s[0] == "PeerWindow")]
        if odd:
            raise XelinkError(f"{fn}: rank(s) {odd} called another collective ({sizes[odd[0]]!r}) "
                              f"while this rank created a PeerWindow")
        self._node = _Node(comm, transport)
        self.nbytes = max(s[1] for s in sizes)
        self.capacity = _round_up(self.nbytes)
        free = _node_free(self._node)
        if not _fits(self._node, self.capacity, free):
            self._node.free()
            raise _no_room("PeerWindow", self._node, self.capacity, free)
        self.counters = PeerCounters(comm, _node=self._node, _what="PeerWindow")
        self.generation = 0
        self._win, self._segs = _allocate(self._node, self.capacity)
        self._tslots = None  # torch_slot's views, made on first use
        self.counters._guard([self.counters._win, self._win])
        self.read_delay = _read_delay(comm)
        self._calls = 0  # next_slot's parity
        _register(comm, self)

    @property
    def spans_comm(self) -> bool:
        return self._node.size == self.comm.size

    def node_index(self, comm_rank: int) -> int:
        """The node rank of ``comm_rank`` (ValueError if that rank is not on this host)."""
        try:
            return self._node.comm_ranks.index(comm_rank)
        except ValueError:
            raise ValueError(f"PeerWindow.node_index: comm rank {comm_rank!r} is not on this host "
                             f"(node ranks are comm ranks {self._node.comm_ranks})") from None

    # -- views --------------------------------------------------------------------------------
    def _seg(self, fn: str, i) -> np.ndarray:
        if self._freed:
            raise XelinkError(f"{fn}: the window was freed")
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"{fn}: i={i!r} must be an int (a node rank)")
        if not 0 <= i < self._node.size:
            raise ValueError(f"{fn}: i={i} is not a node rank (0..{self._node.size - 1})")
        return self._segs[i]

    def _span(self, fn: str, count, offset, itemsize: int) -> tuple[int, int]:
        count = integer(fn, "count", count, 0)
        offset = integer(fn, "offset", offset, 0)
        if offset % itemsize:
            raise ValueError(f"{fn}: offset={offset} is not a multiple of the item size {itemsize}")
        end = offset + count * itemsize
        if end > self.nbytes:
            raise ValueError(f"{fn}: offset={offset} + count={count} * itemsize={itemsize} = {end} bytes "
                             f"exceeds the segment's nbytes={self.nbytes} (call ensure() first)")
        return offset, end

    def local(self) -> np.ndarray:
        """This rank's segment: a uint8 array of ``nbytes`` bytes."""
        return self.peer(self._node.rank)

    def peer(self, i: int) -> np.ndarray:
        """Node rank ``i``'s segment: a uint8 array of ``nbytes`` bytes (writable)."""
        return self._seg("PeerWindow.peer", i)[: self.nbytes]

    def view(self, i: int, dtype, count: int, offset: int = 0) -> np.ndarray:
        """``count`` items of numpy ``dtype`` at byte ``offset`` of node rank ``i``'s segment.

        numpy has no bfloat16: use ``torch_view`` (or ``np.uint16`` for the raw bits).
        """
        fn = "PeerWindow.view"
        seg = self._seg(fn, i)
        try:
            dt = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"{fn}: dtype={dtype!r} is not a numpy dtype (for torch dtypes such as bfloat16 "
                            f"use torch_view)") from None
        if dt.hasobject or dt.itemsize == 0:
            raise TypeError(f"{fn}: dtype={dt} cannot live in shared memory")
        start, end = self._span(fn, count, offset, dt.itemsize)
        return seg[start:end].view(dt)

    def torch_slot(self, i: int, dtype, offset: int, nbytes: int):
        """``nbytes`` bytes at ``offset`` of node rank ``i``'s segment as a torch tensor of ``dtype``, zero-copy
        and remembered per arguments until ``ensure`` reallocates or ``free`` runs (then invalid, as every view):
        for protocols that reuse a few slots call after call (the one-shot all-reduce), where ``torch_view``'s
        checks and ``frombuffer`` cost more than the small call's data movement. ``offset`` and ``nbytes`` are
        multiples of the dtype's size within ``capacity`` (the caller's; not checked here)."""
        key = (i, dtype, offset, nbytes)
        got = self._tslots.get(key) if self._tslots is not None else None
        if got is None:
            import torch

            seg = self._seg("PeerWindow.torch_slot", i)
            if self._tslots is None or len(self._tslots) > 256:
                self._tslots = {}
            whole = torch.frombuffer(seg, dtype=torch.uint8) if len(seg) else torch.empty(0, dtype=torch.uint8)
            got = self._tslots[key] = whole[offset:offset + nbytes].view(dtype)
        return got

    def torch_view(self, i: int, dtype, count: int, offset: int = 0):
        """``count`` items of torch ``dtype`` (e.g. ``torch.bfloat16``) at byte ``offset``; zero-copy."""
        import torch

        fn = "PeerWindow.torch_view"
        seg = self._seg(fn, i)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{fn}: dtype={dtype!r} is not a torch.dtype")
        itemsize = torch.empty(0, dtype=dtype).element_size()
        start, end = self._span(fn, count, offset, itemsize)
        if count == 0:
            return torch.empty(0, dtype=dtype)  # frombuffer refuses empty buffers; nothing to alias
        # frombuffer on the writable numpy view of the segment: the tensor aliases the shared memory.
        return torch.frombuffer(seg, dtype=dtype, count=int(count), offset=start)

    # -- synchronisation --------------------------------------------------------------------------
    def sync(self) -> None:
        """A memory barrier for this window (``MPI_Win_sync``): order my stores/loads around a flag."""
        if self._freed:
            raise XelinkError("PeerWindow.sync: the window was freed")
        self._win.Sync()

    def barrier(self, deadline=None, what: str = "PeerWindow.barrier", note: int = 0) -> None:
        """``counters.barrier``: after it, every node rank's stores before it are visible to all (``note``: as
        there, read back with ``counters.notes()``)."""
        self.counters.barrier(deadline, what, note)
        if self.read_delay:
            time.sleep(self.read_delay)

    # -- growth and release ------------------------------------------------------------------------
    def ensure(self, nbytes: int, timeout=None) -> bool:
        """Make every segment hold at least ``nbytes`` bytes; returns True if it reallocated.

        When the capacity already suffices this only raises ``nbytes``, without communicating. Else
        the window is reallocated (capacity at least doubles where ``SHM_DIR`` has room for that, so a series
        of growing messages costs few reallocations; else exactly ``nbytes``): segment contents are lost and
        earlier views become invalid.

        Collective: every rank of ``comm`` must call this with the same ``nbytes`` (the node ranks'
        rendezvous raises ``xelink.TimeoutError`` naming those that did not come).

        Raises:
            PeerMemoryUnavailable: on every node rank alike, where ``SHM_DIR`` has no room for the larger window
                beside the old one; the window is then left as it was.
        """
        fn = "PeerWindow.ensure"
        if self._freed:
            raise XelinkError(f"{fn}: the window was freed")
        nbytes = integer(fn, "nbytes", nbytes, 0)
        if nbytes <= self.capacity:
            self.nbytes = max(self.nbytes, nbytes)
            return False
        MPI = _mpi()
        # Everyone is here, done with the old segments, before MPI_Win_free (which has no deadline).
        self.counters._rendezvous(self.comm.deadline(timeout, fn), fn)
        need = self._node.mpi.allreduce(nbytes, op=MPI.MAX)
        capacity = _round_up(max(need, 2 * self.capacity))
        free = _node_free(self._node)
        # Not counting the old window as room (only its touched pages hold memory, fewer than its size may): growth
        # takes exactly what is asked where doubling has no room.
        if not _fits(self._node, capacity, free):
            capacity = _round_up(need)
            if not _fits(self._node, capacity, free):
                raise _no_room(fn, self._node, capacity, free)  # the window as it was: nothing released
        _release(self._win)
        self._win = None
        self._segs, self._tslots = [], None
        self.capacity = capacity
        self.nbytes = need
        self._win, self._segs = _allocate(self._node, self.capacity)
        self.counters._guard([self.counters._win, self._win])
        self.generation += 1
        return True

    def next_slot(self, nbytes: int, timeout=None) -> int:
        """Byte offset of this call's slot, for protocols with one barrier per call: write, barrier, read.

        The segments are two slots of ``capacity // 2`` bytes and calls alternate between them, so a
        rank overwrites slot k % 2 in call k only after passing call k-1's barrier, which every rank
        reaches only after it finished reading call k-2, the last user of that slot. The slots stay
        where they are whatever a call's size: a small call after a large one must not land inside
        the large call's slot while a late rank still reads it. A call larger than a slot grows the
        window (``ensure``), whose rendezvous waits until every rank is inside this call, so nobody
        reads the old segments any more; the parity carries on across the growth.

        Collective: every rank of ``comm`` must call this, with the same ``nbytes``, once per call.
        """
        fn = "PeerWindow.next_slot"
        need = 2 * _round_up(integer(fn, "nbytes", nbytes, 0))
        if self._freed or need > self.capacity:  # else ensure would only raise nbytes, which the next line does
            self.ensure(need, timeout)
        half = self.capacity // 2 // _ALIGN * _ALIGN
        self.nbytes = max(self.nbytes, 2 * half)
        self._calls += 1
        return (self._calls % 2) * half

    def free(self, timeout=None) -> None:
        """Release the window, its counters and its node communicator. Idempotent.

        Waits (up to ``timeout``) until every node rank frees too, then frees; ``xelink.TimeoutError``
        names the ranks that did not come. Also run by ``free_all(comm)``.

        Collective: every node rank must call this.
        """
        if self._freed:
            return
        MPI = _mpi()
        if not MPI.Is_finalized():
            self.counters._rendezvous(self.comm.deadline(timeout, "PeerWindow.free"), "PeerWindow.free")
        self._freed = True
        _release(self._win)
        self._win, self._segs, self._tslots = None, [], None
        self.counters._freed = True
        self.counters._free_windows()
        self._node.free()

    def __repr__(self) -> str:
        state = ", freed" if self._freed else ""
        return (f"PeerWindow(node_rank={self._node.rank}, node_size={self._node.size}, nbytes={self.nbytes}, "
                f"capacity={self.capacity}{state})")

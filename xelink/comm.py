"""Communicators: a set of ranks, where they sit, and the transport that joins them.

``xelink.init()`` returns the world communicator; ``split(color, key)`` and ``new_group(ranks)``
make sub-communicators; ``process_group()`` bridges to torch.distributed. Every collective takes
``group=`` (a communicator or None for the world) and resolves it once, with ``resolve_group``.

A communicator also owns what other layers attach to it (``attach``/``resource``): peer windows,
GPU peer-memory teams, package sub-communicators, caches. ``free()`` releases them in the reverse
order of attachment, which every rank shares (they are attached inside collective calls), then the
transport. This module imports no layer above the transports.
"""
from __future__ import annotations

import zlib
from typing import Any, Callable, Sequence

from . import bridge, config
from .errors import NotInitializedError, TimeoutError, XelinkError
from .transport import Deadline, Transport, shm

__all__ = ["Communicator", "NON_GROUP_MEMBER", "new_group", "new_subgroups", "new_subgroups_by_enumeration",
           "resolve_group", "get_rank", "get_world", "get_world_size", "get_global_rank", "get_group_rank",
           "get_process_group_ranks", "named"]

# Every live communicator of this process (finalize frees them) and the world (None: not initialised). Held
# strongly: a dropped communicator must stay until free() or finalize() releases it on every rank together (a weak
# set let each rank's cyclic collector take it at its own time, and the ranks that still held it then waited at
# finalize for ranks that no longer knew it).
_live: set = set()
_world: "Communicator | None" = None


class _NonGroupMember:
    """What ``new_group`` and ``split`` give a rank left out of the new group (torch's
    ``GroupMember.NON_GROUP_MEMBER``, MPI's ``MPI_COMM_NULL``): falsy, and refused with a clear error by every
    call that takes ``group=`` (``None`` there means the world, so it must not stand for "no group")."""

    __slots__ = ()

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "xelink.NON_GROUP_MEMBER"


NON_GROUP_MEMBER = _NonGroupMember()


class _WorldAttribute(type):
    @property
    def WORLD(cls) -> "Communicator | None":  # noqa: N802 - torch's name
        return _world


class group(metaclass=_WorldAttribute):  # noqa: N801 - torch.distributed's name
    """``group.WORLD``: the world communicator (None before ``xelink.init``), as torch.distributed.group.WORLD."""


class GroupMember(metaclass=_WorldAttribute):
    """``GroupMember.WORLD`` (as ``group.WORLD``) and ``GroupMember.NON_GROUP_MEMBER``, as torch.distributed's."""

    NON_GROUP_MEMBER = NON_GROUP_MEMBER


class Backend(str):
    """torch.distributed.Backend's names, plain lowercase strings as torch's (``Backend("NCCL") == Backend.NCCL ==
    "nccl"``): ``init_process_group`` takes any of them and runs xelink's own (``get_backend`` answers
    ``Backend.XELINK``)."""

    UNDEFINED, GLOO, NCCL, XCCL, UCC, MPI, XELINK = "undefined", "gloo", "nccl", "xccl", "ucc", "mpi", "xelink"
    backend_list = [UNDEFINED, GLOO, NCCL, XCCL, UCC, MPI, XELINK]

    def __new__(cls, name: str):
        if not isinstance(name, str):
            raise ValueError(f"Backend: name={name!r} must be a string such as 'nccl'")
        return str.__new__(cls, name.lower())


def get_world() -> "Communicator":
    """The world communicator; raises ``NotInitializedError`` before ``xelink.init()``."""
    if _world is None:
        raise NotInitializedError("xelink.init() has not been called (or xelink.finalize() was)")
    return _world


def set_world(world: "Communicator | None") -> None:
    """Make ``world`` the communicator that ``group=None`` means (``xelink.init``/``finalize``)."""
    global _world
    _world = world


def live() -> list["Communicator"]:
    """Every communicator of this process not yet freed, in name order (the same order on every rank)."""
    return sorted((c for c in list(_live) if not c._freed), key=lambda c: c.name)


def named(name: str) -> "Communicator":
    """The live communicator called ``name`` ("" is the world), e.g. for a custom op that names its group."""
    if not name:
        return get_world()
    for c in list(_live):
        if c.name == name and not c._freed:
            return c
    raise XelinkError(f"no live communicator named {name!r}")


_INT_MAX = 2 ** 31 - 1  # MPI's colors and keys are C ints


def _check_int(fn: str, name: str, value, minimum: int | None = 0):
    value = config.integer(fn, name, value, minimum)
    if not -_INT_MAX - 1 <= value <= _INT_MAX:
        raise ValueError(f"{fn}: {name}={value!r} must fit a 32-bit int")
    return value


class Communicator:
    """A group of ranks with a host transport between them.

    Attributes:
        rank, size: this process's rank in the communicator and the number of ranks.
        device: the torch device this rank drives (``cuda:i``, ``xpu:i`` or ``cpu``).
        timeout: default deadline (seconds) of every wait on this communicator.
        hosts: ``hosts[r]`` is the host name of rank r.
        world_ranks: ``world_ranks[r]`` is rank r's rank in the world communicator.
        launch: the ``runtime.Launch`` this job was started with.
        name: the communicator's name, the same on every member and unique in the job.
        topology: the machine's ``xelink.topology.Topology`` (discovered or ``XELINK_TOPOLOGY``).
        world_placement: which device each *world* rank drives in ``topology``.
    """

    def __init__(self, transport: Transport, *, name: str, world_ranks: Sequence[int], hosts: Sequence[str],
                 device, timeout: float, launch, topology=None, world_placement=None, board=None,
                 device_idents: Sequence | None = None):
        self.transport = transport
        self.name = name  # unique in the job and equal on every member: "w", "w.1c0", ...
        # The world's progress board (shm.ProgressBoard, on one host under MPI; else None): collectives
        # post (board_id, calls) to it as they start, so a timeout can name the ranks furthest behind.
        self.board = board
        self.board_id = zlib.crc32(name.encode())
        self.calls = 0  # collectives entered on this communicator
        # Collective calls made on this communicator, counted as each starts, before its arguments are checked:
        # a call that one rank's checks refuse still takes, on that rank, the tags its peers' call uses, so
        # the messages they sent are not taken by its next call (collectives.cpu.base.tag_for).
        self.issued = 0
        self._splits = 0
        self.rank, self.size = transport.rank, transport.size
        self.world_ranks = list(world_ranks)
        self.hosts = list(hosts)
        # Fixed for the communicator's life; kept because the one-shot all-reduce asks for it on every call.
        self._local_ranks = tuple(r for r, h in enumerate(self.hosts) if h == self.hosts[self.rank])
        self.device = device
        self.timeout = timeout
        self.launch = launch
        self.topology = topology
        self.world_placement = world_placement
        # device_idents[r]: (host, device UUID) of rank r's device, None for CPU ranks.
        self.device_idents = list(device_idents) if device_idents is not None else [None] * self.size
        # XELINK_CHECK=1: every collective first checks that all ranks make the same call.
        self.check_calls = config.env_flag("XELINK_CHECK")
        self._packages: list[list[int]] | None = None
        self._derived: tuple | None = None  # (world_placement, the packages derived from it): see _groups
        self._pg = None
        self._freed = False
        self._broken: Exception | None = None
        self._resources: dict[Any, Any] = {}
        _live.add(self)

    # -- placement --------------------------------------------------------------------------
    @property
    def host(self) -> str:
        return self.hosts[self.rank]

    @property
    def local_ranks(self) -> list[int]:
        """The ranks of this communicator on this rank's host."""
        return list(self._local_ranks)

    @property
    def local_rank(self) -> int:
        return self._local_ranks.index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self._local_ranks)

    @property
    def packages(self) -> list[list[int]]:
        """The ranks of this communicator in each package, in rank order.

        From the topology's placement of the world (``XELINK_TOPOLOGY`` or discovery), else one package
        per host. Assigning a partition of ``range(size)`` overrides it, e.g. to run the hierarchical
        algorithms with an emulated layout (every rank must assign the same one).
        """
        return [list(p) for p in self._groups()]

    def _groups(self) -> list[list[int]]:
        """``packages`` itself (not to be modified): the assigned layout, else the placement's packages, derived
        once per placement (collectives on several packages ask on every call)."""
        if self._packages is not None:
            return self._packages
        placement = self.world_placement
        if self._derived is None or self._derived[0] is not placement:
            keys = self.hosts if placement is None else [placement.package_of(w) for w in self.world_ranks]
            groups: dict = {}
            for r, k in enumerate(keys):
                groups.setdefault(k, []).append(r)
            self._derived = (placement, list(groups.values()))
        return self._derived[1]

    @packages.setter
    def packages(self, value) -> None:
        groups = [list(p) for p in value]
        flat = sorted(r for p in groups for r in p)
        if flat != list(range(self.size)) or any(not p for p in groups):
            raise ValueError(f"packages: {groups} is not a partition of ranks 0..{self.size - 1} into non-empty "
                             f"packages")
        self._packages = [sorted(p) for p in groups]

    @property
    def placement(self):
        """Where this communicator's ranks sit in ``topology`` (an ``xelink.topology.Placement``: what the
        cost model prices), or None without a topology or with ``packages`` assigned by hand (the model
        would price a layout that is not the one in use)."""
        if self.topology is None or self.world_placement is None or self._packages is not None:
            return None
        from .topology import Placement

        return Placement(self.topology, tuple(self.world_placement.devices[w] for w in self.world_ranks))

    def group_rank_of(self, world_rank: int) -> int | None:
        """The rank in this communicator of world rank ``world_rank`` (None: not a member)."""
        ranks = self.world_ranks
        # the world, or a group that starts as it does: one comparison
        if 0 <= world_rank < self.size and ranks[world_rank] == world_rank:
            return world_rank
        return ranks.index(world_rank) if world_rank in ranks else None

    def package_index(self, rank: int) -> tuple[int, int]:
        """(package index, local index) of ``rank`` in ``packages``."""
        for p, members in enumerate(self._groups()):
            if rank in members:
                return p, members.index(rank)
        raise ValueError(f"package_index: rank {rank!r} is in no package of {self.name} ({self.packages})")

    def package_groups(self, timeout=None) -> tuple["Communicator", "Communicator"]:
        """(my package's communicator, the communicator of the ranks with my local index in every
        package), made once per layout and kept as resources (freed with this communicator).

        With uneven packages a cross group holds only the packages that have my local index.
        Collective on first use for a layout: every rank of the communicator must call this.
        """
        packages = self.packages
        key = ("package_groups", tuple(map(tuple, packages)))
        found = self._resources.get(key)
        if found is None:
            p, i = self.package_index(self.rank)
            found = self.attach(key, _Groups(self.split(p, key=i, timeout=timeout),
                                             self.split(i, key=p, timeout=timeout)))
        return found.package, found.cross

    def __repr__(self) -> str:
        state = ", freed" if self._freed else ""
        return (f"Communicator(rank={self.rank}, size={self.size}, device={self.device}, "
                f"transport={self.transport.name}{state})")

    # -- control ----------------------------------------------------------------------------
    def _live(self, fn: str) -> Transport:
        if self._freed:
            raise XelinkError(f"{fn}: the communicator was freed")
        if self._broken is not None:
            raise XelinkError(f"{fn}: the communicator is unusable after an earlier failure ({self._broken}); "
                              f"free it and make a new one")
        return self.transport

    def fail(self, exc: BaseException) -> None:
        """Refuse further use after ``exc`` interrupted an exchange part way (a timeout, an error between posted
        sends and receives): the ranks no longer agree on which messages belong to which call (as after an NCCL
        timeout), so later calls raise at once instead of matching stale messages or waiting for them."""
        if self._broken is None:
            self._broken = exc

    def _exchange(self, obj: Any, timeout, fn: str) -> list:
        """``transport.exchange`` under a deadline (``timeout``: seconds, or a ``Deadline``); a timeout leaves the
        communicator unusable.

        After a timeout the ranks disagree about which exchanges happened (as with an NCCL timeout),
        so the communicator refuses further use rather than mixing up messages.
        """
        deadline = timeout if isinstance(timeout, Deadline) else self.deadline(timeout, fn)
        self._live(fn)
        self._quiesce(fn)
        try:
            return self._live(fn).exchange(obj, deadline, fn)
        except TimeoutError as exc:
            self.fail(exc)
            raise exc.restate(group=exc.group or self)

    def _quiesce(self, fn: str) -> None:
        """Let the operations queued on this communicator (asynchronous collectives on a worker thread: the
        resources with a ``quiesce(comm, fn)``) finish before a control exchange from the caller's thread, which
        would otherwise race them on the same channel (a worker making a shared-memory window exchanges on it)."""
        for obj in list(self._resources.values()):
            quiesce = getattr(obj, "quiesce", None)
            if quiesce is not None:
                quiesce(self, fn)

    def deadline(self, timeout=None, fn: str = "wait") -> Deadline:
        """A deadline ``timeout`` seconds from now (the communicator's default when None)."""
        return Deadline(self.timeout if timeout is None else config.resolve_timeout(timeout, fn))

    def allgather_object(self, obj: Any, timeout=None) -> list:
        """Every rank's ``obj`` (picklable), indexed by rank.

        Raises ``xelink.TimeoutError`` naming the ranks that did not call within the deadline.
        Collective: every rank of the communicator must call this.
        """
        return self._exchange(obj, timeout, "allgather_object")

    def rendezvous(self, obj: Any, timeout=None, fn: str = "rendezvous") -> list:
        """Every rank's ``obj``, as ``allgather_object``, where the caller goes on into calls that cannot time out
        (MPI's own collectives: communicator splits, shared windows): two exchanges under one deadline. A rank that
        timed out in the first may have left its message behind (an eager send cannot always be cancelled), so the
        first alone could let a late rank on into a call its peers never make; the second is what they never send.

        Raises ``xelink.TimeoutError`` (``fn``'s) naming the ranks that did not call within the deadline.
        Collective: every rank of the communicator must call this.
        """
        deadline = self.deadline(timeout, fn)
        out = self._exchange(obj, deadline, fn)
        self._exchange(None, deadline, fn)
        return out

    def barrier(self, timeout=None) -> None:
        """Wait until every rank has called ``barrier``.

        Raises ``xelink.TimeoutError`` naming the ranks that did not arrive within the deadline.
        Collective: every rank of the communicator must call this.
        """
        self._exchange(None, timeout, "barrier")

    def split(self, color: int | None, key: int | None = None, timeout=None) -> "Communicator | _NonGroupMember":
        """Partition the ranks like ``MPI_Comm_split``.

        Args:
            color: ranks with the same color form one new communicator; None leaves this rank out.
            key: orders the ranks of the new communicator (ties by current rank); default: rank.

        Returns:
            The new communicator, or ``xelink.NON_GROUP_MEMBER`` (falsy; refused as a ``group``) for a rank that
            passed ``color=None``.

        Collective: every rank of the communicator must call this.
        """
        return self._split(color, key, timeout, "split")

    def _split(self, color, key, timeout, fn: str):
        """``split``, its errors naming ``fn`` (the call that splits: ``new_group``, ...)."""
        if color is not None:
            color = _check_int(fn, "color", color)
        key = self.rank if key is None else _check_int(fn, "key", key, None)
        pairs = self.rendezvous((color, key), timeout, fn)  # (MPI's split has no deadline)
        self._splits += 1
        if color is None:
            self.transport.split(None, key, [])
            return NON_GROUP_MEMBER
        members = sorted((r for r, (c, _) in enumerate(pairs) if c == color), key=lambda r: (pairs[r][1], r))
        sub = self.transport.split(color, key, members)
        return Communicator(sub, name=f"{self.name}.{self._splits}c{color}",
                            world_ranks=[self.world_ranks[r] for r in members],
                            hosts=[self.hosts[r] for r in members], device=self.device,
                            timeout=self.timeout, launch=self.launch, topology=self.topology,
                            world_placement=self.world_placement, board=self.board,
                            device_idents=[self.device_idents[r] for r in members])

    # -- resources ------------------------------------------------------------------------------
    def attach(self, key, obj):
        """Attach ``obj`` under ``key``; ``free()`` releases it (its ``free()`` or ``close()``). Returns ``obj``.

        Attach collective resources (whose release communicates) inside collective calls, so that
        every rank attaches, and so releases, them in the same order.
        """
        self._live("attach")
        if key in self._resources:
            raise XelinkError(f"attach: {self.name} already has a resource {key!r}")
        self._resources[key] = obj
        return obj

    def resource(self, key, make: Callable[[], Any] | None = None):
        """The resource attached under ``key``; when there is none, ``make()``'s result, attached (or None)."""
        obj = self._resources.get(key)
        if obj is None and make is not None:
            obj = self.attach(key, make())
        return obj

    def detach(self, key):
        """Forget the resource under ``key`` without releasing it; returns it (or None)."""
        return self._resources.pop(key, None)

    # -- torch.distributed bridge -------------------------------------------------------------
    def process_group(self):
        """The torch.distributed process group of exactly these ranks, in this order.

        Created on first use: gloo for CPU tensors, plus nccl (CUDA) or xccl (XPU) for the device.
        For the world this is torch's default group (adopted if the application initialised
        torch.distributed itself). A sub-communicator's group is built only by its members; pass it
        to ``torch.distributed`` collectives with group-relative ranks (``group_src=``/``group_dst=``),
        since torch's global-rank lookup knows only the groups its own ``new_group`` made.
        Call it on the world communicator first. Collective: every rank of the communicator.
        """
        self._live("process_group")
        if self._pg is None:
            import torch.distributed as dist

            world = get_world()
            if self.world_ranks == list(range(world.size)):
                self._pg = bridge.world_group(world)
            elif not dist.is_initialized():
                raise XelinkError("process_group: torch.distributed is not initialised yet; call "
                                  "process_group() on the world communicator, on every rank, first")
            else:
                self._pg = bridge.subgroup(self)
        return self._pg

    def free(self) -> None:
        """Release the attached resources (last attached first), then the transport. Idempotent.

        Collective: every rank of the communicator must call this (peer memory and sub-communicators
        are released together with the other ranks).
        """
        if self._freed:
            return
        self._quiesce("free")  # asynchronous operations still queued finish before their resources go
        shm.free_all(self)  # windows made on this communicator directly (shm.PeerWindow(comm, ...))
        for key in reversed(list(self._resources)):
            obj = self._resources.pop(key)
            if self._broken is not None and isinstance(obj, (Communicator, _Groups)):
                obj.fail(self._broken)  # (a call on this one may have left messages in flight on its sub-groups)
            release = getattr(obj, "free", None) or getattr(obj, "close", None)
            if release is not None:
                release()
        self._freed = True
        self._pg = None  # a sub-group's backends close when the last reference goes
        self.transport.free(abandon=self._broken is not None)
        _live.discard(self)


class _Groups:
    """The package and cross-package sub-communicators of one layout (a resource of their parent)."""

    def __init__(self, package: Communicator, cross: Communicator):
        self.package, self.cross = package, cross

    def fail(self, exc: BaseException) -> None:
        self.package.fail(exc)
        self.cross.fail(exc)

    def free(self) -> None:
        self.cross.free()
        self.package.free()


def resolve_group(group, fn: str) -> Communicator:
    """The communicator a collective runs on: ``group`` itself, the world for None, or the communicator whose
    ``process_group()`` ``group`` is (torch.distributed's WORLD where xelink's world made or adopted it)."""
    if group is None:
        if _world is None:
            raise NotInitializedError("xelink.init() has not been called (or xelink.finalize() was)")
        return _world
    if group is NON_GROUP_MEMBER:
        raise ValueError(f"{fn}: this rank is not a member of the group (new_group / split gave it "
                         f"xelink.NON_GROUP_MEMBER); call {fn} on a group from its members only")
    if isinstance(group, Communicator):
        if group._freed:
            raise XelinkError(f"{fn}: group {group!r} was freed")
        return group
    import torch.distributed as dist

    if dist.is_available() and isinstance(group, dist.ProcessGroup):  # a communicator's (process_group(); WORLD)
        made = next((c for c in list(_live) if c._pg is not None and c._pg == group and not c._freed), None)
        if made is not None:
            return made
    raise TypeError(f"{fn}: group={group!r} is not an xelink Communicator (use xelink.init(), "
                    f"Communicator.split() or xelink.new_group()) nor the torch.distributed group of one "
                    f"(Communicator.process_group())")


def get_rank(group=None) -> int:
    """This process's rank in ``group`` (None: the world), as torch.distributed.get_rank: -1 on a rank that
    is not a member (``group`` is ``xelink.NON_GROUP_MEMBER``)."""
    return -1 if group is NON_GROUP_MEMBER else resolve_group(group, "get_rank").rank


def get_world_size(group=None) -> int:
    """The number of ranks of ``group`` (None: the world), as torch.distributed.get_world_size: -1 on a rank
    that is not a member."""
    return -1 if group is NON_GROUP_MEMBER else resolve_group(group, "get_world_size").size


def get_global_rank(group, group_rank: int) -> int:
    """The world rank of rank ``group_rank`` of ``group`` (None: the world), as
    torch.distributed.get_global_rank."""
    comm = resolve_group(group, "get_global_rank")
    group_rank = _check_int("get_global_rank", "group_rank", group_rank)
    if group_rank >= comm.size:
        raise ValueError(f"get_global_rank: group_rank={group_rank} is out of range for a group of size {comm.size}")
    return comm.world_ranks[group_rank]


def get_process_group_ranks(group) -> list[int]:
    """The world ranks of ``group``'s members in group-rank order (None: the world), as
    torch.distributed.get_process_group_ranks."""
    return list(resolve_group(group, "get_process_group_ranks").world_ranks)


def get_group_rank(group, global_rank: int) -> int:
    """The rank in ``group`` (None: the world) of world rank ``global_rank``, as
    torch.distributed.get_group_rank (a ValueError where that rank is not a member)."""
    comm = resolve_group(group, "get_group_rank")
    global_rank = _check_int("get_group_rank", "global_rank", global_rank)
    index = comm.group_rank_of(global_rank)
    if index is None:
        raise ValueError(f"get_group_rank: global_rank={global_rank} is not a member of {comm.name} (its world "
                         f"ranks: {comm.world_ranks})")
    return index


def new_group(ranks: Sequence[int] | None = None, timeout=None, backend=None, pg_options=None,
              use_local_synchronization: bool = False, group_desc: str | None = None, device_id=None,
              sort_ranks: bool = True, *, group: Communicator | None = None) -> "Communicator | _NonGroupMember":
    """A communicator of ``ranks`` (ranks of ``group``, default world), as torch.distributed.new_group (its
    arguments in its order; ``group``, xelink's own, by keyword).

    Args:
        ranks: distinct ranks of ``group``; every rank of ``group`` must pass the same list (None: all of
            them, as torch.distributed.new_group).
        sort_ranks: as torch's: True (the default) numbers the new ranks in the order of the old ones (the list
            sorted); False keeps the list's order (``ranks[i]`` becomes rank i).
        timeout: seconds (or a ``timedelta``): the new group's deadline of every wait, as torch's (None: the
            parent's); new_subgroups, new_subgroups_by_enumeration and split_group take it alike.
        backend, pg_options, group_desc, device_id: torch.distributed's, accepted so that its code runs and
            otherwise unused: one communicator serves CPU and CUDA tensors through the transport and device
            bound at ``init``.
        use_local_synchronization: only False: every rank of ``group`` calls this (one split).

    Returns:
        The new communicator on member ranks; ``xelink.NON_GROUP_MEMBER`` on the others (torch's non-member
        sentinel: falsy, and every call given it as ``group`` raises, where None would mean the world).

    Collective: every rank of ``group`` must call this, members or not.
    """
    fn = "new_group"
    parent = resolve_group(group, fn)
    _torch_group_options(fn, backend, group_desc, device_id)
    if not isinstance(sort_ranks, bool):
        raise TypeError(f"{fn}: sort_ranks={sort_ranks!r} must be a bool")
    if use_local_synchronization is not False:
        raise ValueError(f"{fn}: use_local_synchronization={use_local_synchronization!r} is not supported: every "
                         f"rank of the parent group calls new_group, members or not (one split)")
    ranks = _rank_list(fn, "ranks", range(parent.size) if ranks is None else ranks, parent.size)
    sub = _subgroups(fn, parent, [sorted(ranks) if sort_ranks else ranks], timeout)[0]
    return NON_GROUP_MEMBER if sub is None else sub


def _torch_group_options(fn: str, backend, group_desc, device_id) -> None:
    """torch.distributed's group-creation options that xelink takes and does not use, checked for their types."""
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"{fn}: backend={backend!r} must be None or a str (a torch.distributed backend name)")
    if group_desc is not None and not isinstance(group_desc, str):
        raise TypeError(f"{fn}: group_desc={group_desc!r} must be None or a str")
    if device_id is not None:
        import torch  # (the host layer imports torch only where a call needs it)

        if not isinstance(device_id, torch.device):
            raise TypeError(f"{fn}: device_id={device_id!r} must be None or a torch.device")


def _rank_list(fn: str, name: str, ranks, size: int) -> list[int]:
    """``ranks`` as a list of distinct ints in [0, size), at least one, or an error naming ``fn`` and ``name``."""
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        raise TypeError(f"{fn}: {name}={ranks!r} must be a sequence of ints")
    ranks = [_check_int(fn, "rank", r) for r in ranks]
    for r in ranks:
        if r >= size:
            raise ValueError(f"{fn}: rank {r} is out of range for a group of size {size}")
    if not ranks:
        raise ValueError(f"{fn}: {name}=[] is empty")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{fn}: {name}={ranks} has duplicates")
    return ranks


def new_subgroups(group_size: int | None = None, group: Communicator | None = None, timeout=None, backend=None,
                  pg_options=None, group_desc: str | None = None) -> tuple:
    """(this rank's subgroup, every subgroup), as torch.distributed.new_subgroups: ``group`` (None: the world) cut
    into consecutive blocks of ``group_size`` of its ranks (None: the ranks of one host, ``local_size``, which must
    then be the same on every host); the list holds ``xelink.NON_GROUP_MEMBER`` for the blocks of other ranks.
    ``backend``, ``pg_options``, ``group_desc``: accepted and unused (as :func:`new_group`).

    Collective: every rank of ``group`` must call this (one split, not one call a subgroup).
    """
    fn = "new_subgroups"
    parent = resolve_group(group, fn)
    _torch_group_options(fn, backend, group_desc, None)
    size = parent.local_size if group_size is None else _check_int(fn, "group_size", group_size, 1)
    if size > parent.size or parent.size % size:
        raise ValueError(f"{fn}: group_size={size} must divide the size of {parent.name}, {parent.size}")
    return _subgroups(fn, parent, [list(range(i, i + size)) for i in range(0, parent.size, size)], timeout)


def new_subgroups_by_enumeration(ranks_per_subgroup_list, timeout=None, backend=None, pg_options=None,
                                 group_desc: str | None = None) -> tuple:
    """(this rank's subgroup or None, every subgroup), as torch.distributed.new_subgroups_by_enumeration: one
    communicator a list of world ranks (numbered in the world's order, as torch's ``new_group`` sorts them; lists
    that share no rank, ranks in none allowed: their subgroup is None); the list holds ``xelink.NON_GROUP_MEMBER``
    for the subgroups of other ranks. ``backend``, ``pg_options``, ``group_desc``: accepted and unused (as
    :func:`new_group`).

    Collective: every rank of the world must call this with the same lists (one split).
    """
    fn = "new_subgroups_by_enumeration"
    world = resolve_group(None, fn)
    _torch_group_options(fn, backend, group_desc, None)
    blocks = _disjoint_lists(fn, "ranks_per_subgroup_list", "subgroup", ranks_per_subgroup_list, world)
    return _subgroups(fn, world, blocks, timeout)


def split_group(parent_pg: Communicator | None = None, split_ranks=None, timeout=None, pg_options=None,
                group_desc: str | None = None, backend=None) -> "Communicator | None":
    """This rank's communicator of ``split_ranks`` (lists of ranks of ``parent_pg``, None: the world; lists that
    share no rank, each numbered in the parent's order, ranks in none allowed), or None where this rank is in no
    list, as torch.distributed.split_group. ``pg_options``, ``group_desc``, ``backend``: accepted and unused (as
    :func:`new_group`).

    Collective: every rank of ``parent_pg`` must call this with the same lists (one split).
    """
    fn = "split_group"
    parent = resolve_group(parent_pg, fn)
    _torch_group_options(fn, backend, group_desc, None)
    return _subgroups(fn, parent, _disjoint_lists(fn, "split_ranks", "split", split_ranks, parent), timeout)[0]


def _disjoint_lists(fn: str, name: str, item: str, lists, parent: Communicator) -> list:
    """``lists`` (named ``name``, each an ``item``) as sorted lists of distinct ranks of ``parent`` that share no
    rank, or an error naming ``fn`` and what is wrong."""
    if isinstance(lists, (str, bytes)) or not isinstance(lists, Sequence) or not lists:
        raise ValueError(f"{fn}: {name}={lists!r} must be a non-empty list of lists of ranks")
    blocks, owner = [], {}
    for block in lists:
        block = _rank_list(fn, item, block, parent.size)
        for r in block:
            if r in owner:
                raise ValueError(f"{fn}: rank {r} is in both {item} {owner[r]} and {block}")
            owner[r] = block
        blocks.append(sorted(block))
    return blocks


def get_backend(group: Communicator | None = None) -> str:
    """The backend of ``group`` (None: the world), as torch.distributed.get_backend: ``"xelink"`` (one communicator
    serves every device, CPU and GPU tensors alike; a backend named at ``init_process_group`` is taken and not
    used). Given ``NON_GROUP_MEMBER`` or a freed communicator, the error every call given one raises."""
    resolve_group(group, "get_backend")
    return "xelink"


def _subgroups(fn: str, parent: Communicator, blocks: list, timeout) -> tuple:
    """(this rank's communicator or None, one entry a block: it or NON_GROUP_MEMBER): one split of ``parent``
    into ``blocks`` (disjoint lists of its ranks, in the new ranks' order; every caller's the same: checked).
    ``timeout`` (None: the parent's) is the split's deadline and, as torch's, the new groups' own (``timeout``
    of a ``Communicator``: every wait of their collectives)."""
    seen = parent._exchange(blocks, timeout, fn)
    differ = [r for r, other in enumerate(seen) if other != blocks]
    if differ:
        def shown(b):  # one list (new_group's) as the caller passed it
            return b[0] if len(b) == 1 else b
        raise ValueError(f"{fn}: ranks differ between callers: rank {parent.rank} passed {shown(blocks)}, rank "
                         f"{differ[0]} passed {shown(seen[differ[0]])}")
    mine = next((i for i, block in enumerate(blocks) if parent.rank in block), None)
    sub = parent._split(mine, None if mine is None else blocks[mine].index(parent.rank), timeout, fn)
    if timeout is not None and mine is not None:
        sub.timeout = config.resolve_timeout(timeout, fn)
    return (None if mine is None else sub), [sub if i == mine else NON_GROUP_MEMBER for i in range(len(blocks))]

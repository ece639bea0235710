"""Peer memory between the ranks of one host on NVIDIA GPUs: CUDA IPC, symmetric buffers, signal pads.

A ``Team`` belongs to one communicator whose ranks all sit on one host (several ranks may share a
GPU: IPC maps memory between processes on one device as well). It holds, per rank:

- a scratch buffer (two slots, see the kernels' parity rule) that copy-in collectives stage through;
- a signal pad: ``pads[b * MAX_WORLD + p]`` counts how often rank p has arrived at rank me's barrier
  for block b (monotonic int32 counters, one per peer and block, written by remote atomics);
- local epochs: how many barriers each block has passed (only this rank's kernels touch them);
- an error word in pinned host memory, set by a kernel whose wait ran past its deadline, with the
  peers it was waiting for, so the host can raise ``xelink.TimeoutError`` naming them.

``empty()`` allocates user tensors that every rank of the team can read (zero-copy collectives).
IPC goes through the CUDA driver (libcuda) with ctypes: no files, no sockets, nothing left behind
(handles close with the team; the memory belongs to torch's allocator and is freed by it).
"""
from __future__ import annotations

import bisect
import ctypes
import math
import os
import weakref

import torch

from .. import config
from ..errors import TimeoutError, XelinkError
from ..log import get_logger

__all__ = ["Team", "team_of", "empty", "copy", "available", "MAX_WORLD", "MAX_BLOCKS"]

_log = get_logger("cuda")
MAX_WORLD = 8
MAX_BLOCKS = 1024
_SLOT_MIN = 1 << 20
_SLOT_MAX = 256 << 20  # default cap of a scratch slot (XELINK_GPU_SCRATCH)


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


class _Driver:
    """The four CUDA driver calls IPC needs (the primary context torch made current is used)."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        self._err = lib.cuGetErrorString
        self._err.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self.get = lib.cuIpcGetMemHandle
        self.get.argtypes = [ctypes.POINTER(_Handle), ctypes.c_uint64]
        self.open = getattr(lib, "cuIpcOpenMemHandle_v2", None) or lib.cuIpcOpenMemHandle
        self.open.argtypes = [ctypes.POINTER(ctypes.c_uint64), _Handle, ctypes.c_uint]
        self.close = lib.cuIpcCloseMemHandle
        self.close.argtypes = [ctypes.c_uint64]
        self.copy = lib.cuMemcpyAsync
        self.copy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self.range = getattr(lib, "cuMemGetAddressRange_v2", None) or lib.cuMemGetAddressRange
        self.range.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]

    def check(self, status: int, what: str) -> None:
        if status != 0:
            msg = ctypes.c_char_p()
            self._err(status, ctypes.byref(msg))
            text = msg.value.decode() if msg.value else "unknown error"
            raise XelinkError(f"{what}: CUDA driver error {status} ({text})")

    def export(self, ptr: int) -> tuple[bytes, int]:
        """(IPC handle of the allocation holding ``ptr``, offset of ``ptr`` in it)."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self.check(self.range(ctypes.byref(base), ctypes.byref(size), ptr), "cuMemGetAddressRange")
        handle = _Handle()
        self.check(self.get(ctypes.byref(handle), base.value), "cuIpcGetMemHandle")
        return ctypes.string_at(ctypes.addressof(handle), 64), ptr - base.value

    def import_(self, handle: bytes) -> int:
        h = _Handle()
        ctypes.memmove(ctypes.addressof(h), handle, 64)
        ptr = ctypes.c_uint64()
        self.check(self.open(ctypes.byref(ptr), h, 1), "cuIpcOpenMemHandle")  # 1: lazy peer access
        return ptr.value


_driver: _Driver | None = None


def _drv() -> _Driver:
    global _driver
    if _driver is None:
        _driver = _Driver()
    return _driver


def copy(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Copy engine: ``nbytes`` from ``src`` to ``dst`` (any device addresses: peers over the links)."""
    drv = _drv()
    drv.check(drv.copy(dst, src, nbytes, stream), "cuMemcpyAsync")


def available(comm) -> bool:
    """Whether ``comm`` can use peer memory: CUDA device, one host, at most MAX_WORLD ranks."""
    dev = getattr(comm, "device", None)
    return (dev is not None and torch.device(dev).type == "cuda" and comm.size <= MAX_WORLD
            and len(set(comm.hosts)) == 1)


class Team:
    """Peer memory of one communicator (see the module docstring). Collective to create."""

    def __init__(self, comm):
        if not available(comm):
            raise XelinkError(f"peer memory: communicator {comm.name} needs its ranks on one host's CUDA "
                              f"devices, at most {MAX_WORLD} of them (has {comm.size} ranks on "
                              f"{len(set(comm.hosts))} host(s), device {comm.device})")
        if torch.cuda.is_current_stream_capturing():
            raise XelinkError(f"peer memory: the first GPU collective on {comm.name} sets up peer memory, "
                              "which cannot happen during CUDA graph capture; run one call before capturing")
        self.comm = comm
        self.device = torch.device(comm.device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.rank, self.size = comm.rank, comm.size
        self._opened: dict[bytes, int] = {}
        # Every kernel of the team runs on this many blocks (one per multiprocessor by default, the
        # same on every rank: blocks pair up across ranks).
        want = (config.env_int("XELINK_GPU_BLOCKS", 0)
                or torch.cuda.get_device_properties(self.device).multi_processor_count)
        self.blocks = min(MAX_BLOCKS, min(comm.allgather_object(want)))
        self.pads = torch.zeros(MAX_BLOCKS * MAX_WORLD, dtype=torch.int32, device=self.device)
        self.epochs = torch.zeros(MAX_BLOCKS, dtype=torch.int32, device=self.device)
        self.error = torch.zeros(1 + MAX_WORLD, dtype=torch.int32, pin_memory=True)
        self._error_view = self.error.numpy()
        self.pad_ptrs = self._share(self.pads)
        self.slot = 0
        self.scratch = None
        self._retired: list[torch.Tensor] = []  # earlier, smaller scratch buffers (see ensure_scratch)
        self.scratch_ptrs: list[int] = []
        self.symmetric = _Registry()
        self.kernels: dict = {}  # collectives/gpu/launch.py's kernels and launch plans (plans hold scratch addresses)
        self.plans: dict = {}
        torch.cuda.synchronize(self.device)
        comm.barrier()

    # -- buffers ------------------------------------------------------------------------------
    def _share(self, t: torch.Tensor) -> list[int]:
        """Every rank's address of its own ``t`` (collective; exchanges IPC handles)."""
        mine = _drv().export(t.data_ptr())
        everyone = self.comm.allgather_object(mine)
        ptrs = []
        for r, (handle, offset) in enumerate(everyone):
            if r == self.rank:
                ptrs.append(t.data_ptr())
                continue
            base = self._opened.get(handle)
            if base is None:
                try:
                    base = _drv().import_(handle)
                except XelinkError as e:
                    raise XelinkError(f"peer memory: rank {self.rank} of {self.comm.name} cannot map rank {r}'s "
                                      f"memory ({e}){_visibility_hint(self.size)}") from e
                self._opened[handle] = base
            ptrs.append(base + offset)
        return ptrs

    def ensure_scratch(self, nbytes: int, fn: str) -> int:
        """Slot size (bytes) of at least ``nbytes`` (capped); collective when it has to grow."""
        need = min(max(nbytes, _SLOT_MIN), self.slot_max)
        if need <= self.slot:
            return self.slot
        if torch.cuda.is_current_stream_capturing():
            raise XelinkError(f"{fn}: needs {need} B of peer scratch on {self.comm.name} but has {self.slot}; "
                              "grow it before CUDA graph capture by running the same call once first")
        slot = 1 << math.ceil(math.log2(need))
        # Peers may still read the old buffer: finish every queued kernel everywhere before replacing it.
        torch.cuda.synchronize(self.device)
        self.comm.barrier()
        if self.scratch is not None:
            # A CUDA graph captured earlier replays the plans that use the old buffer (and the peers'
            # mappings of theirs): it must stay allocated, not go back to the allocator for reuse.
            self._retired.append(self.scratch)
        self.scratch = torch.empty(2 * slot, dtype=torch.uint8, device=self.device)
        self.scratch_ptrs = self._share(self.scratch)
        self.slot = slot
        self.plans.clear()
        _log.debug("peer scratch on %s: 2 x %d B", self.comm.name, slot)
        return slot

    @property
    def slot_max(self) -> int:
        return config.env_int("XELINK_GPU_SCRATCH", _SLOT_MAX)

    def peer_addresses(self, t: torch.Tensor) -> list[int] | None:
        """Every rank's address of tensor ``t`` if ``t`` lies in memory from ``empty`` on this team."""
        return self.symmetric.lookup(t)

    # -- errors -------------------------------------------------------------------------------
    def check(self, fn: str) -> None:
        """Raise ``xelink.TimeoutError`` if a kernel of this team gave up waiting (and break the comm)."""
        if self._error_view[0]:
            missing = [p for p in range(self.size) if self._error_view[1 + p]]
            err = TimeoutError(fn, missing, self.comm.timeout,
                               "a GPU barrier ran past its deadline (the peers named never arrived)")
            self.comm._broken = err
            raise err

    def close(self) -> None:
        for base in self._opened.values():
            try:
                _drv().close(base)
            except Exception:  # noqa: BLE001 - best effort at teardown; nothing to report it to
                pass
        self._opened.clear()


class _Registry:
    """Address ranges of symmetric tensors (from ``empty``), with every rank's base address."""

    def __init__(self):
        self._starts: list[int] = []
        self._entries: dict[int, tuple[weakref.ref, int, list[int]]] = {}

    def __bool__(self) -> bool:
        return bool(self._starts)

    def add(self, t: torch.Tensor, ptrs: list[int]) -> None:
        start = t.data_ptr()
        if start not in self._entries:
            bisect.insort(self._starts, start)
        self._entries[start] = (weakref.ref(t), t.numel() * t.element_size(), ptrs)

    def lookup(self, t: torch.Tensor) -> list[int] | None:
        if not self._starts:
            return None
        p = t.data_ptr()
        i = bisect.bisect_right(self._starts, p) - 1
        if i < 0:
            return None
        start = self._starts[i]
        ref, nbytes, ptrs = self._entries[start]
        if ref() is None:  # freed: the allocator may hand the range to anything now
            del self._entries[start]
            self._starts.pop(i)
            return None
        if p + t.numel() * t.element_size() > start + nbytes:
            return None
        return [base + (p - start) for base in ptrs]


def _visibility_hint(ranks: int) -> str:
    """Why an IPC mapping may fail when this process sees fewer GPUs than the team has ranks, and the fix."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or torch.cuda.device_count() >= ranks:
        return ""
    return (f". This process sees {torch.cuda.device_count()} GPU(s) (CUDA_VISIBLE_DEVICES={visible}); CUDA IPC "
            f"between GPUs a process cannot see fails on some systems. Launch with every GPU visible "
            f"(launch_scripts/xelink-run --visible all, or mpirun alone: xelink.init binds local rank r to GPU r), "
            f"or use algo='nccl'")


def team_of(comm, fn: str = "peer memory") -> Team:
    """The communicator's team (its resource ``"cuda.team"``, closed when it is freed), made on first use."""
    return comm.resource("cuda.team", lambda: Team(comm))


def empty(*size, dtype=torch.float32, group=None) -> torch.Tensor:
    """A CUDA tensor every rank of ``group`` can read and write through peer memory.

    Collectives on such tensors skip the copy through the scratch buffer. Every rank must call
    this with the same size and dtype, and pass the same views to the collectives later.

    Collective: every rank of ``group`` must call this.
    """
    from ..comm import resolve_group

    comm = resolve_group(group, "empty")
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in size):
        raise ValueError(f"empty: size={size} must be non-negative ints")
    if torch.device(comm.device).type != "cuda":
        raise XelinkError(f"empty: symmetric memory needs a CUDA device; {comm.name} drives {comm.device}")
    team = team_of(comm, "empty")
    seen = comm.allgather_object((tuple(size), str(dtype)))
    if any(s != seen[0] for s in seen):
        raise ValueError(f"empty: ranks disagree: rank {comm.rank} asked for {(tuple(size), str(dtype))}, "
                         f"others for {sorted(set(seen))}")
    t = torch.empty(size, dtype=dtype, device=team.device)
    nbytes = t.numel() * t.element_size()
    # A zero-size tensor has no allocation to share; give it a one-byte backing so ranks agree.
    base = t if nbytes else torch.empty(1, dtype=torch.uint8, device=team.device)
    ptrs = team._share(base)
    team.symmetric.add(t if nbytes else base, ptrs)
    return t

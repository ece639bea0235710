"""Peer memory between the ranks of one host on NVIDIA GPUs (CUDA IPC), and the rules every kernel on it obeys.

Two kinds of peer memory:

- A ``Team`` belongs to one communicator whose ranks all sit on one host (several ranks may share a GPU:
  IPC maps memory between processes of one device as well). It is made collectively, on first use, and
  holds per rank: a scratch buffer of two slots, the barrier pads, the semaphore pads, the local epochs,
  an error word, the symmetric tensors (``empty``) and the cached launch plans.
- ``Mailboxes`` hold a rank's point-to-point memory on a communicator (an inbox and flags per peer), made
  on its first transfer without waiting for anyone; a ``Pair`` views the two sides of one rank pair.

Everything is enqueued on a CUDA stream (the caller's, or the current stream of the team's device) and
nothing synchronizes the host, so calls can be captured in CUDA graphs and replayed.

The rules (every kernel of xelink on peer memory follows them; composed ops that write their own kernels
with ``xelink.symm.device`` must too):

1. **Pairing.** A team kernel runs on exactly ``team.blocks`` programs; block b of rank r pairs with block
   b of every peer, and touches only the elements it is paired on (tiles ``j`` with ``j % blocks == b``),
   so a per-block barrier orders everything and no grid-wide sync is needed.
2. **Epochs.** Barrier pads ``pads[b * MAX_WORLD + p]`` count how often rank p arrived at this rank's
   barrier for block b; they only grow. ``epochs[b]`` (local) counts the barriers block b passed; a
   kernel reads it at entry, waits for ``epochs[b] + k`` at its k-th barrier and stores the new epoch at
   exit. No reset, so a replayed CUDA graph is a new call. Every rank must issue the same sequence of
   team kernels (as for NCCL collectives).
3. **Scratch parity.** Scratch has two slots. A kernel that starts at epoch ``e`` and ends at ``E``
   may, before its first barrier, write only slot ``e & 1`` (of any rank) and, after its last barrier,
   touch only slot ``(E - 1) & 1``. The next kernel, which a fast peer may start while this rank is still
   after its last barrier, writes slot ``E & 1``, never the one still being read. Hence: one call may
   be in flight per rank beyond the barrier all ranks passed; growing the scratch (``ensure_scratch``)
   synchronizes every rank and is refused during capture.
4. **Semaphores.** ``signal(rank, slot)`` adds one to ``rank``'s counter ``[slot][me]``; ``wait(rank,
   slot)`` consumes one signal of ``rank`` on that slot (it waits until the count exceeds the number it
   consumed before, a local count kept on the device). Signals and waits must balance; any number of
   signals may be outstanding. Point-to-point keeps its own per-pair counters the same way.
5. **Deadlines.** Every wait polls the global timer; past ``timeout`` it records the ranks it waited for
   in the error word (pinned host memory) and moves on. The next call on the team (or ``synchronize``)
   raises ``xelink.TimeoutError`` naming them and marks the communicator broken: results after a timeout
   are garbage, which is why the communicator refuses further calls.
6. **Graphs.** Plans hold raw addresses; anything a plan points at (scratch buffers, pads, symmetric
   tensors, pair inboxes) stays allocated while the team lives, including scratch retired by growth.
   Set-up (a team, a pair, scratch growth, compilation) cannot happen during capture: run each call once
   before capturing it.
"""
from __future__ import annotations

import bisect
import contextlib
import ctypes
import math
import os
import pickle
import weakref

import torch

from .. import config
from ..errors import TimeoutError, XelinkError
from ..log import get_logger
from ..transport.base import SETUP_TAG as _SETUP_TAG
from ..work import Work as Handle
from . import watchdog
from .device import MAX_WORLD

__all__ = ["Team", "Mailboxes", "Pair", "Kernel", "Bound", "Copy", "Join", "Work", "team_of", "pair_of", "empty",
           "available", "copy_engine", "copy_engine_2d", "peer_addresses", "peer_tensor", "put", "get", "signal",
           "wait", "barrier", "synchronize",
           "MAX_WORLD", "MAX_BLOCKS", "SIGNAL_SLOTS", "WORDS", "word_dtype", "timeout_ns"]

_log = get_logger("symm")
MAX_BLOCKS = 1024
SIGNAL_SLOTS = 64
_SLOT_MIN = 1 << 20
_SLOT_MAX = 256 << 20  # default cap of a scratch slot (XELINK_GPU_SCRATCH)
_raw_stream = torch._C._cuda_getCurrentRawStream if hasattr(torch._C, "_cuda_getCurrentRawStream") else None


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


class _Copy2D(ctypes.Structure):
    """CUDA_MEMCPY2D (cuda.h), device to device."""
    _fields_ = [(f"{side}{name}", kind) for side in ("src", "dst") for name, kind in (
        ("XInBytes", ctypes.c_size_t), ("Y", ctypes.c_size_t), ("MemoryType", ctypes.c_int),
        ("Host", ctypes.c_void_p), ("Device", ctypes.c_uint64), ("Array", ctypes.c_void_p),
        ("Pitch", ctypes.c_size_t))] + [("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t)]


class _Driver:
    """The CUDA driver calls IPC and the copy engine need (the primary context torch made current is used)."""

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
        self.copy2d = getattr(lib, "cuMemcpy2DAsync_v2", None) or lib.cuMemcpy2DAsync
        self.copy2d.argtypes = [ctypes.POINTER(_Copy2D), ctypes.c_void_p]
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


def copy_engine(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Copy engine: ``nbytes`` from address ``src`` to ``dst`` (any device addresses, peers' included)
    on the raw stream ``stream``."""
    drv = _drv()
    drv.check(drv.copy(dst, src, nbytes, stream), "cuMemcpyAsync")


def copy_engine_2d(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
                   stream: int) -> None:
    """Copy engine, strided: ``height`` rows of ``width`` bytes from ``src`` (rows ``src_pitch`` bytes apart) to
    ``dst`` (rows ``dst_pitch`` apart), device addresses (peers' included), on the raw stream ``stream``: e.g.
    a slice of columns of a row-major matrix."""
    for name, v in (("width", width), ("height", height), ("dst_pitch", dst_pitch), ("src_pitch", src_pitch)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"copy_engine_2d: {name}={v!r} must be a non-negative int")
    if height > 1 and (dst_pitch < width or src_pitch < width):
        raise ValueError(f"copy_engine_2d: pitches ({dst_pitch}, {src_pitch}) must be >= width={width}")
    if width == 0 or height == 0:
        return
    if height == 1:  # one row: its pitch is never used, and the driver wants every pitch >= the width
        dst_pitch, src_pitch = max(dst_pitch, width), max(src_pitch, width)
    drv = _drv()
    p = _Copy2D(srcMemoryType=2, srcDevice=src, srcPitch=src_pitch, dstMemoryType=2, dstDevice=dst,
                dstPitch=dst_pitch, WidthInBytes=width, Height=height)  # 2: CU_MEMORYTYPE_DEVICE
    drv.check(drv.copy2d(ctypes.byref(p), stream), "cuMemcpy2DAsync")


def available(comm) -> bool:
    """Whether ``comm`` can use peer memory: CUDA device, one host, at most MAX_WORLD ranks (worked out once
    a communicator: what it depends on does not change)."""
    known = comm.__dict__.get("_peer_memory")
    if known is None:
        dev = getattr(comm, "device", None)
        known = (dev is not None and torch.device(dev).type == "cuda" and comm.size <= MAX_WORLD
                 and len(set(comm.hosts)) == 1)
        comm.__dict__["_peer_memory"] = known
    return known


WORDS = ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2), (torch.uint8, 1))  # widest first


def word_dtype(nbytes: int, *addresses: int) -> torch.dtype:
    """The widest integer type that divides ``nbytes`` and every address: the element a raw byte copy
    moves (wider elements vectorize better)."""
    return next(d for d, w in WORDS if nbytes % w == 0 and all(a % w == 0 for a in addresses))


def timeout_ns(comm, timeout=None) -> int:
    """A kernel's deadline in nanoseconds: ``timeout`` seconds, or the communicator's default."""
    return int((comm.timeout if timeout is None else config.resolve_timeout(timeout, "timeout")) * 1e9)


def _device_of(comm) -> torch.device:
    dev = torch.device(comm.device)
    return torch.device("cuda", torch.cuda.current_device()) if dev.index is None else dev


def _refuse_capture(what: str) -> None:
    if torch.cuda.is_current_stream_capturing():
        raise XelinkError(f"{what}, which cannot happen during CUDA graph capture; run the same call once "
                          "before capturing it")


def _stream_handle(device: torch.device, stream) -> int:
    """The raw CUDA stream of ``stream`` (a ``torch.cuda.Stream``, a raw handle, or None: the device's
    current stream)."""
    if stream is None:
        return _raw_stream(device.index)
    return stream if isinstance(stream, int) else stream.cuda_stream


class _Mappings:
    """Peer allocations this process opened (IPC), each once; closed together."""

    def __init__(self):
        self._opened: dict[bytes, int] = {}

    def open(self, handle: bytes, offset: int, what: str, ranks: int) -> int:
        base = self._opened.get(handle)
        if base is None:
            try:
                base = _drv().import_(handle)
            except XelinkError as e:
                raise XelinkError(f"{what} ({e}){_visibility_hint(ranks)}") from e
            self._opened[handle] = base
        return base + offset

    def close(self) -> None:
        for base in self._opened.values():
            try:
                _drv().close(base)
            except Exception:  # noqa: BLE001 - best effort at teardown; nothing to report it to
                pass
        self._opened.clear()


class _ErrorWord:
    """A pinned host word a kernel sets when a wait ran past its deadline, with the peers it waited for (of
    ``ranks``, the ranks of ``comm`` its slots stand for; ``what``: the error's text); a pair's word (``pair``:
    one peer) also holds a received message's wrong size: ``[2]`` set, the size sent in ``[3]``. Watched by
    :mod:`watchdog` from its creation."""

    def __init__(self, comm, ranks, what: str, tensor: torch.Tensor | None = None, pair: bool = False):
        self.tensor = torch.zeros(1 + MAX_WORLD, dtype=torch.int32, pin_memory=True) if tensor is None else tensor
        self._view = self.tensor.numpy()
        self.comm, self.ranks, self.what, self.pair = comm, list(ranks), what, pair
        self.told = False  # a call raised it or the watchdog reported it: nothing more to say
        self._seen = False  # the watchdog saw it set once: it reads it again, whole, at its next poll
        watchdog.watch(self)

    def _state(self) -> tuple[str, object] | None:
        """What the word holds, read in one place: ``("size", bytes sent)`` (a pair's message of another size,
        told first), ``("deadline", the ranks waited for)``, or None."""
        view = self._view
        if self.pair and view[2]:
            return "size", int(view[3])
        if view[0]:
            return "deadline", [self.ranks[p] for p in range(len(self.ranks)) if view[1 + p]]
        return None

    def raise_if_set(self, fn: str) -> None:
        """Raise what the word holds (a pair's wrong size first, then a deadline) and break the communicator."""
        state, comm = self._state(), self.comm
        if state is None:
            return
        kind, value = state
        if kind == "size":
            err = XelinkError(f"{fn}: rank {self.ranks[0]} of {comm.name} sent a message of {value} B to "
                              f"a receive of another size on rank {comm.rank}; the data was dropped and "
                              f"{comm.name} is unusable (post receives of the sizes sent)")
        else:
            err = TimeoutError(fn, value, comm.timeout, self.what)
        self.told = True
        comm.fail(err)
        raise err

    def tripped(self) -> str | None:
        """The watchdog's line once a wait gave up (or a pair's message had another size) and neither a call nor
        the watchdog has told it yet, else None; None too the first time it is seen set (read again next poll)."""
        state, comm = None if self.told else self._state(), self.comm
        if state is None:
            return None
        if not self._seen:  # the kernels' stores land one at a time (the flag, each late program's peer, a size):
            self._seen = True  # a word first seen set is read again one poll later, when they all have
            return None
        kind, value = state
        if kind == "size":
            return (f"rank {comm.rank} of {comm.name}: rank {self.ranks[0]} sent a message of {value} B to a receive "
                    f"of another size; the data was dropped, and the next call on {comm.name} raises")
        return (f"rank {comm.rank} of {comm.name}: {self.what} (waited {comm.timeout:g} s for rank(s) {value}); what "
                f"that call should have written is not, and the next call on {comm.name} raises xelink.TimeoutError")


class Team:
    """Peer memory of one communicator (see the module docstring). Collective to create."""

    def __init__(self, comm):
        if not available(comm):
            raise XelinkError(f"peer memory: communicator {comm.name} needs its ranks on one host's CUDA "
                              f"devices, at most {MAX_WORLD} of them (has {comm.size} ranks on "
                              f"{len(set(comm.hosts))} host(s), device {comm.device})")
        _refuse_capture(f"peer memory: the first GPU call on {comm.name} sets up peer memory")
        self.comm = comm
        self.device = _device_of(comm)
        self.rank, self.size = comm.rank, comm.size
        self._maps = _Mappings()
        # Every team kernel runs on this many blocks (one per multiprocessor by default, the same on
        # every rank: blocks pair up across ranks).
        want = (config.env_int("XELINK_GPU_BLOCKS", 0, 0)
                or torch.cuda.get_device_properties(self.device).multi_processor_count)
        self.blocks = min(MAX_BLOCKS, min(comm.allgather_object(want)))
        self.pads = torch.zeros(MAX_BLOCKS * MAX_WORLD, dtype=torch.int32, device=self.device)
        self.epochs = torch.zeros(MAX_BLOCKS, dtype=torch.int32, device=self.device)
        self.signals = torch.zeros(SIGNAL_SLOTS * MAX_WORLD, dtype=torch.int32, device=self.device)
        self.consumed = torch.zeros(SIGNAL_SLOTS * MAX_WORLD, dtype=torch.int32, device=self.device)
        self._error = _ErrorWord(comm, range(self.size), "a GPU wait ran past its deadline (the peers named never "
                                 "arrived)")
        self.error = self._error.tensor
        self.pad_ptrs = self.share(self.pads)
        self.signal_ptrs = self.share(self.signals)
        self.slot = 0
        self.scratch = None
        self._retired: list[torch.Tensor] = []  # earlier, smaller scratch buffers (rule 6)
        self.scratch_ptrs: list[int] = []
        self.symmetric = _Registry()
        self.kernels: dict = {}  # Kernel objects by their caller's key
        self.plans: dict = {}    # launch plans by their caller's key (they hold scratch addresses)
        torch.cuda.synchronize(self.device)
        comm.barrier()

    # -- buffers ------------------------------------------------------------------------------
    def share(self, t: torch.Tensor) -> list[int]:
        """Every rank's address of its own ``t`` (collective; exchanges IPC handles)."""
        everyone = self.comm.allgather_object(_drv().export(t.data_ptr()))
        return [t.data_ptr() if r == self.rank else
                self._maps.open(h, off, f"peer memory: rank {self.rank} of {self.comm.name} cannot map rank {r}'s "
                                        f"memory", self.size)
                for r, (h, off) in enumerate(everyone)]

    def ensure_scratch(self, nbytes: int, fn: str) -> int:
        """Slot size (bytes) of at least ``nbytes`` (capped); collective when it has to grow."""
        need = min(max(nbytes, _SLOT_MIN), self.slot_max)
        if need <= self.slot:
            return self.slot
        _refuse_capture(f"{fn}: needs {need} B of peer scratch on {self.comm.name} but has {self.slot}; growing it")
        slot = 1 << math.ceil(math.log2(need))
        # Peers may still read the old buffer: finish every queued kernel everywhere before replacing it.
        torch.cuda.synchronize(self.device)
        self.comm.barrier()
        if self.scratch is not None:
            self._retired.append(self.scratch)
        self.scratch = torch.empty(2 * slot, dtype=torch.uint8, device=self.device)
        self.scratch_ptrs = self.share(self.scratch)
        self.slot = slot
        self.plans.clear()
        _log.debug("peer scratch on %s: 2 x %d B", self.comm.name, slot)
        return slot

    @property
    def slot_max(self) -> int:
        return config.env_int("XELINK_GPU_SCRATCH", _SLOT_MAX, _SLOT_MIN)

    def peer_addresses(self, t: torch.Tensor) -> list[int] | None:
        """Every rank's address of tensor ``t`` if ``t`` lies in memory from ``empty`` on this team."""
        return self.symmetric.lookup(t)

    # -- kernels and plans ----------------------------------------------------------------------
    def kernel(self, fn, key, dtype: torch.dtype, num_warps: int = 8, grid: int | None = None, pointers=None,
               **consts) -> "Kernel":
        """The team kernel ``fn`` (a ``triton.jit`` kernel following the team's argument names: ``S0..S7``
        pads, ``B0..B7`` peer buffers, ``EPOCH``, ``ERR``, ``RANK``, ``WORLD``) with these meta-parameters,
        built once under ``key``; ``dtype`` types the data pointers (``X``, ``Y``, ``B*``; ``pointers``
        names other raw-address arguments and their dtypes). ``grid``: the team's ``blocks`` unless given
        (only kernels that pair no blocks may run on another grid)."""
        k = self.kernels.get(key)
        if k is None:
            fixed = dict(consts, EPOCH=self.epochs.data_ptr(), ERR=self.error.data_ptr(), RANK=self.rank,
                         WORLD=self.size)
            for i in range(MAX_WORLD):
                fixed[f"S{i}"] = self.pad_ptrs[i] if i < self.size else None
                if i >= self.size:
                    fixed[f"B{i}"] = None
            types = dict(_team_pointers(fn.arg_names, dtype), **(pointers or {}))
            k = self.kernels[key] = Kernel(fn, grid or self.blocks, fixed, types, num_warps=num_warps)
        return k

    def run(self, fn: str, key, build, timeout=None, stream=None) -> None:
        """Enqueue the cached plan ``key`` on ``stream``; ``build(timeout_ns)`` makes it once.

        A plan is the list of launches of one call (``Bound`` kernels, ``Copy``, ``Join``), every argument
        fixed, so a repeated call costs a dict lookup and the launches. Keys hold everything a plan
        depends on (addresses, sizes, dtype, op, algorithm, deadline, peers' addresses); growing the
        scratch drops every plan.
        """
        self.check(fn)
        plan = self.plans.get(key)
        if plan is None:
            plan = build(self.timeout_ns(timeout))
            if len(self.plans) > 4096:  # many distinct buffers: start over rather than grow without bound
                self.plans.clear()
            self.plans[key] = plan
        if stream is None:
            raw = _raw_stream(self.device.index)
            for piece in plan:
                piece(raw)
            return
        with torch.cuda.stream(stream):  # Copy/Join fork from and join the current stream
            raw = stream.cuda_stream
            for piece in plan:
                piece(raw)

    def barrier_piece(self, timeout_ns: int) -> "Bound":
        """The device barrier as a piece of a plan (``run``)."""
        from .kernels import KERNELS

        return self.kernel(KERNELS["barrier"], ("symm.barrier",), torch.int32).bind(timeout_ns=timeout_ns)

    def timeout_ns(self, timeout=None) -> int:
        return timeout_ns(self.comm, timeout)

    # -- errors ---------------------------------------------------------------------------------
    def check(self, fn: str) -> None:
        """Raise ``xelink.TimeoutError`` if a kernel of this team gave up waiting (and break the comm)."""
        self._error.raise_if_set(fn)

    def close(self) -> None:
        self._maps.close()


class Mailboxes:
    """This rank's point-to-point memory on a communicator (resource ``"cuda.mailboxes"``), made on its first
    transfer without waiting for anyone: one inbox of ``inbox_bytes`` per peer, flags (int32 counters the
    peers signal) and counts (this rank's own), in one allocation each; their IPC handles are sent to every
    other rank right away (nonblocking), so a pair is ready as soon as the peer made its own mailboxes, and
    no rank waits for a third one (a ring of first transfers cannot deadlock on set-up).
    """

    FLAGS = 2 * MAX_BLOCKS  # per peer

    def __init__(self, comm, inbox_bytes: int, blocks: int):
        if not available(comm):
            raise XelinkError(f"peer memory: communicator {comm.name} needs its ranks on one host's CUDA devices")
        _refuse_capture(f"peer memory: the first point-to-point transfer of rank {comm.rank} on {comm.name} sets "
                        "up its mailboxes")
        self.comm, self.inbox_bytes, self.blocks = comm, inbox_bytes, blocks
        self.device = _device_of(comm)
        n = comm.size
        self._maps = _Mappings()
        self.inboxes = torch.empty(n * inbox_bytes, dtype=torch.uint8, device=self.device)
        self.flags = torch.zeros(n * self.FLAGS, dtype=torch.int32, device=self.device)
        self.counts = torch.zeros(n * self.FLAGS, dtype=torch.int32, device=self.device)
        self.errors = torch.zeros((n, 1 + MAX_WORLD), dtype=torch.int32, pin_memory=True)
        torch.cuda.synchronize(self.device)  # the zeroed flags are in place before any peer may signal them
        drv = _drv()
        mine = (drv.export(self.inboxes.data_ptr()), drv.export(self.flags.data_ptr()), inbox_bytes, blocks)
        self._sent = _post(comm, mine)  # kept until freed: the buffers of nonblocking sends
        self.pairs: dict[int, "Pair"] = {}

    def pair(self, peer: int, timeout=None) -> "Pair":
        found = self.pairs.get(peer)
        if found is None:
            _refuse_capture(f"peer memory: the first transfer between ranks {self.comm.rank} and {peer} of "
                            f"{self.comm.name} maps the peer's mailboxes")
            inbox_h, flags_h, their_bytes, their_blocks = _take(self.comm, peer, timeout)
            if their_bytes != self.inbox_bytes or their_blocks != self.blocks:
                raise XelinkError(f"peer memory: ranks {self.comm.rank} and {peer} of {self.comm.name} disagree on "
                                  f"the mailboxes ({self.inbox_bytes} B x {self.blocks} blocks vs {their_bytes} B x "
                                  f"{their_blocks}): set XELINK_P2P_BLOCKS the same on every rank")
            what = f"peer memory: rank {self.comm.rank} of {self.comm.name} cannot map rank {peer}'s memory"
            peer_inboxes = self._maps.open(*inbox_h, what, 2)
            peer_flags = self._maps.open(*flags_h, what, 2)
            found = self.pairs[peer] = Pair(self, peer, peer_inboxes, peer_flags)
        return found

    def check(self, fn: str) -> None:
        for p in self.pairs.values():
            p.check(fn)

    def close(self) -> None:
        for req in self._sent[1:]:  # a peer that never talked to this rank never took its message
            if not req.test():
                req.cancel()
        self._maps.close()


class Pair:
    """Peer memory of this rank and ``peer`` (point-to-point), views into the two ranks' ``Mailboxes``.

    ``inbox`` (``inbox_bytes``) is what the peer writes into here, ``flags`` (int32 counters) what the peer
    signals here, ``counts`` this rank's own counters for the pair; ``peer_inbox`` and ``peer_flags`` are
    the addresses of this rank's inbox and flags in the peer's mailboxes. What the counters mean is the
    protocol's business (``xelink.collectives.gpu.p2p``); rule 4 of the module docstring applies.
    """

    def __init__(self, boxes: Mailboxes, peer: int, peer_inboxes: int, peer_flags: int):
        me, f = boxes.comm.rank, Mailboxes.FLAGS
        self.comm, self.peer, self.device, self.blocks = boxes.comm, peer, boxes.device, boxes.blocks
        self.inbox = boxes.inboxes[peer * boxes.inbox_bytes:(peer + 1) * boxes.inbox_bytes]
        self.flags = boxes.flags[peer * f:(peer + 1) * f]
        self.counts = boxes.counts[peer * f:(peer + 1) * f]
        self._error = _ErrorWord(boxes.comm, [peer], "a point-to-point transfer waited past its deadline for the peer "
                                 "named", boxes.errors[peer], pair=True)
        self.error = self._error.tensor
        self.peer_inbox = peer_inboxes + me * boxes.inbox_bytes
        self.peer_flags = peer_flags + me * f * 4
        self.kernels: dict = {}  # the protocol's Kernel objects and cached launches, by its keys
        self.plans: dict = {}
        self.streams: dict = {}  # the protocol's side streams, by its keys

    def kernel(self, fn, key, pointers: dict, num_warps: int = 8, **consts) -> Kernel:
        """``fn`` on ``blocks`` programs with ``ERR`` (this pair's error word) and ``consts`` fixed."""
        k = self.kernels.get(key)
        if k is None:
            fixed = dict(consts, ERR=self.error.data_ptr())
            k = self.kernels[key] = Kernel(fn, self.blocks, fixed, dict(pointers, ERR=torch.int32),
                                           num_warps=num_warps)
        return k

    def check(self, fn: str) -> None:
        """Raise what a transfer's kernel reported: its error word holds ``[0]`` a wait timed out, ``[1]``
        it waited for the peer, ``[2]`` a received message had another size than the receive, ``[3]``
        that size (bytes, low 32 bits). Either breaks the communicator."""
        self._error.raise_if_set(fn)


_SETUP_BYTES = 512


def _post(comm, obj) -> list:
    """Send ``obj`` to every other rank of ``comm`` without waiting (host transport); returns what must
    stay alive until the sends complete (the requests and their buffers)."""
    blob = pickle.dumps(obj)
    if len(blob) > _SETUP_BYTES:
        raise XelinkError(f"peer memory: set-up message of {len(blob)} B exceeds {_SETUP_BYTES}")
    out = torch.zeros(_SETUP_BYTES, dtype=torch.uint8)
    out[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    t = comm._live("point-to-point set-up")
    return [out] + [t.isend(out, p, _SETUP_TAG) for p in range(comm.size) if p != comm.rank]


def _take(comm, peer: int, timeout):
    """The object ``peer`` posted (``_post``), waiting for it up to the deadline."""
    from ..transport import wait_all

    got = torch.zeros(_SETUP_BYTES, dtype=torch.uint8)
    req = comm._live("point-to-point set-up").irecv(got, peer, _SETUP_TAG)
    wait_all([req], comm.deadline(timeout, "point-to-point set-up"), "point-to-point set-up")
    return pickle.loads(got.numpy().tobytes())


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
    """Why an IPC mapping may fail when this process sees fewer GPUs than ``ranks``, and the fix."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or torch.cuda.device_count() >= ranks:
        return ""
    return (f". This process sees {torch.cuda.device_count()} GPU(s) (CUDA_VISIBLE_DEVICES={visible}); CUDA IPC "
            f"between GPUs a process cannot see fails on some systems. Launch with every GPU visible "
            f"(launch_scripts/xelink-run --visible all, or mpirun alone: xelink.init binds local rank r to GPU r), "
            f"or use algo='nccl'")


# -- launching Triton kernels with fixed arguments ----------------------------------------------

class _Ptr:
    """A raw device address with a dtype, which Triton accepts as a pointer argument."""

    __slots__ = ("_p", "dtype")

    def __init__(self, p: int, dtype: torch.dtype):
        self._p, self.dtype = p, dtype

    def data_ptr(self) -> int:
        return self._p


def _spec(v) -> int:
    """The class Triton specializes an int or address on (==1, multiple of 16, 64-bit), as a key."""
    if v is None:
        return 3
    return (v == 1) | ((v % 16 == 0) << 1) | ((v >= 1 << 31) << 2)


def _unspecialized_typed(fn) -> frozenset:
    """Names of ``fn``'s arguments Triton compiles the same for any value: ``do_not_specialize`` and annotated
    with a type (without one, an int's type still follows its value: i32 or i64)."""
    return frozenset(p.name for p in getattr(fn, "params", ()) if getattr(p, "do_not_specialize", False)
                     and getattr(p, "annotation_type", ""))


def _team_pointers(names, dtype: torch.dtype) -> dict:
    """The team's naming of raw-address arguments: ``X``, ``Y``, ``B0..B7`` typed ``dtype``; ``S0..S7``,
    ``EPOCH``, ``ERR`` int32."""
    out = {}
    for a in names:
        if a in ("X", "Y") or (len(a) == 2 and a[0] == "B" and a[1].isdigit()):
            out[a] = dtype
        elif a in ("EPOCH", "ERR") or (len(a) == 2 and a[0] == "S" and a[1].isdigit()):
            out[a] = torch.int32
    return out


class Kernel:
    """A ``triton.jit`` kernel on a fixed grid with some arguments fixed (``fixed``: name -> value).

    ``kernel.bind(**dynamic)`` fixes the rest (data addresses, counts, the deadline) and returns a ``Bound``
    launch. ``pointers`` (name -> dtype) names the arguments that are raw device addresses.
    """

    def __init__(self, fn, grid: int, fixed: dict, pointers: dict, num_warps: int = 8):
        self.fn, self.grid, self.num_warps = fn, grid, num_warps
        names = fn.arg_names
        self._template = [fixed.get(a) for a in names]
        self._slots = {a: i for i, a in enumerate(names) if a not in fixed}
        self._typed = _unspecialized_typed(fn)
        self.types = pointers
        self.compiled: dict = {}

    def _fill(self, dynamic: dict) -> tuple[list, tuple]:
        """(every argument in order, the specialization key of the dynamic ones: an argument the kernel neither
        specializes nor types by value (``do_not_specialize`` with a type annotation) is one class, so a
        preload's stand-in values, e.g. ``p2p._preload``'s, key the launches of real ones)."""
        args = self._template.copy()
        for name, value in dynamic.items():
            args[self._slots[name]] = value
        typed = self._typed
        return args, tuple(0 if name in typed else _spec(value) for name, value in dynamic.items())

    def bind(self, **dynamic) -> "Bound":
        return Bound(self, *self._fill(dynamic))

    def typed(self, args) -> list:
        """``args`` with raw addresses wrapped as typed pointers, as Triton's JIT takes them."""
        types = self.types
        return [_Ptr(a, types[n]) if n in types and a is not None else a for n, a in zip(self.fn.arg_names, args)]

    def preload(self, **dynamic) -> None:
        """Compile and load the kernel for the specialization of these arguments, launching nothing.

        A kernel that spins until another kernel of this process runs (a send waiting for a receive on
        another stream) must never meet the other's first launch: under CUDA's lazy loading, loading a
        kernel may wait for the running ones to finish, which would deadlock until the deadline.
        """
        args, key = self._fill(dynamic)
        if key not in self.compiled:
            c = self.fn.warmup(*self.typed(args), grid=(self.grid,), num_warps=self.num_warps)
            getattr(c, "_init_handles", lambda: None)()
            self.compiled[key] = c


class Bound:
    """A kernel launch with every argument fixed: ``bound(stream)`` enqueues it on a raw stream.

    The first launch of an alignment class compiles through Triton's JIT (which checks every argument);
    after that a launch goes straight to the compiled kernel's launcher, a few microseconds of host time.
    """

    __slots__ = ("_kernel", "_args", "_key", "_launch", "_tail")

    def __init__(self, kernel: Kernel, args: list, key: tuple):
        self._kernel, self._args, self._key = kernel, tuple(args), key
        self._launch = None
        c = kernel.compiled.get(key)
        if c is not None:
            self._bind(c)

    def _bind(self, c) -> None:
        """Call Triton's C launcher directly when the kernel needs no scratch (ours never do)."""
        run = c.run
        if (getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0
                and hasattr(run, "launch")):
            self._launch = run.launch
            self._tail = (c.function, run.launch_cooperative_grid, run.launch_pdl, None, None, c.packed_metadata,
                          None, None, None, *self._args)
        else:  # another Triton: its documented-by-use CompiledKernel.run signature
            self._launch = run
            self._tail = (c.function, c.packed_metadata, None, None, None, *self._args)

    def __call__(self, stream: int) -> None:
        if self._launch is not None:
            self._launch(self._kernel.grid, 1, 1, stream, *self._tail)
            return
        k = self._kernel
        other = _other_stream(stream)
        with contextlib.nullcontext() if other is None else torch.cuda.stream(other):
            c = k.fn[(k.grid,)](*k.typed(self._args), num_warps=k.num_warps)
        k.compiled[self._key] = c
        self._bind(c)


def _other_stream(raw: int):
    """The torch stream to make current for a JIT launch on the raw stream ``raw`` (Triton's JIT launches
    on the current stream), or None when ``raw`` is the current one.

    Raw 0 is the device's default stream: ``torch.cuda.ExternalStream(0)`` would not wrap it but hand out a
    fresh stream of torch's pool (a pointer of 0 reads as "none given"), and a first launch there ran
    unordered with the caller's work (the GPU collectives read inputs not yet written).
    """
    if raw == _raw_stream(torch.cuda.current_device()):
        return None
    return torch.cuda.default_stream() if raw == 0 else torch.cuda.ExternalStream(raw)


class Copy:
    """A copy-engine transfer in a plan: ``copy(stream)``; ``aside`` runs it on a side stream.

    On the side stream (forked from the calling stream and joined back at ``Join``) the local copy of this
    rank's own shard overlaps the pulls over the links instead of queueing behind them.
    """

    __slots__ = ("dst", "src", "nbytes", "aside")

    def __init__(self, dst, src, nbytes, aside=None):
        self.dst, self.src, self.nbytes, self.aside = dst, src, nbytes, aside

    def __call__(self, stream):
        if self.aside is None:
            copy_engine(self.dst, self.src, self.nbytes, stream)
            return
        side, forked, finished = self.aside
        forked.record(torch.cuda.current_stream())
        side.wait_event(forked)
        copy_engine(self.dst, self.src, self.nbytes, side.cuda_stream)
        finished.record(side)


class Join:
    """Make the calling stream wait for a ``Copy`` that ran aside."""

    __slots__ = ("finished",)

    def __init__(self, finished):
        self.finished = finished

    def __call__(self, stream):
        torch.cuda.current_stream().wait_event(self.finished)


class Work(Handle):
    """Handle of stream-ordered work (torch.distributed's Work for CUDA, with its protocol: ``xelink.work``):
    ``wait()`` makes the current stream wait for it, ``synchronize()`` blocks the host and raises a deadline that
    expired. ``keep``: tensors
    the work's stream uses, held until ``wait()`` (under CUDA-graph capture, where ``record_stream`` is not
    used, a tensor the caller drops would otherwise go to the next allocation while the work still uses it)."""

    def __init__(self, check, what: str, stream=None, keep=()):
        self._event = torch.cuda.Event()
        self._event.record(stream)
        self._check, self._what, self._keep = check, what, keep

    def is_completed(self) -> bool:
        return self._event.query()

    def wait(self, timeout=None) -> bool:
        torch.cuda.current_stream().wait_event(self._event)
        self._keep = ()  # later uses of the memory on the current stream come after the work
        return True

    def synchronize(self) -> None:
        self._event.synchronize()
        if self._check is not None:
            self._check(self._what)


# -- the public functions -------------------------------------------------------------------------

def team_of(comm, fn: str = "peer memory") -> Team:
    """The communicator's team (its resource ``"cuda.team"``, closed when it is freed), made on first use.

    Collective the first time: every rank of ``comm`` must call it.
    """
    return comm.resource("cuda.team", lambda: Team(comm))


def pair_of(comm, peer: int, inbox_bytes: int, blocks: int | None = None, timeout=None) -> Pair:
    """The ``Pair`` of this rank and ``peer`` on ``comm``, from this rank's ``Mailboxes`` (resource
    ``"cuda.mailboxes"``, made on first use without waiting; ``blocks`` then fixes its kernels' programs,
    default ``XELINK_P2P_BLOCKS`` or 16); the first call for a peer waits until the peer made its own
    mailboxes (its own first transfer on ``comm``). Not collective."""
    boxes = comm._resources.get("cuda.mailboxes")
    if boxes is None:
        if blocks is None:
            blocks = min(config.env_int("XELINK_P2P_BLOCKS", 16, 1), MAX_BLOCKS)
        boxes = comm.attach("cuda.mailboxes", Mailboxes(comm, inbox_bytes, blocks))
    return boxes.pair(peer, timeout)


def _comm(group, fn):
    from ..comm import resolve_group

    return resolve_group(group, fn)


def empty(*size, dtype=torch.float32, group=None) -> torch.Tensor:
    """A CUDA tensor every rank of ``group`` can read and write through peer memory (``xelink.empty``).

    Collectives on such tensors skip the copy through the scratch buffer, and ``peer_tensor`` views a
    peer's copy. Every rank must call this with the same size and dtype. The memory stays mapped while
    the tensor lives and the communicator is not freed.

    Collective: every rank of ``group`` must call this.
    """
    comm = _comm(group, "empty")
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
    team.symmetric.add(t if nbytes else base, team.share(base))
    return t


def _symmetric_team(fn, t, group):
    comm = _comm(group, fn)
    team = comm._resources.get("cuda.team")
    ptrs = None if team is None or not isinstance(t, torch.Tensor) else team.peer_addresses(t)
    if ptrs is None:
        raise ValueError(f"{fn}: the tensor is not in symmetric memory of {comm.name}; allocate it with "
                         "xelink.empty(..., group=...)")
    return comm, team, ptrs


def peer_addresses(t: torch.Tensor, group=None) -> tuple[int, ...] | None:
    """Every rank's address of ``t`` (a tensor in memory from ``empty`` on ``group``, or a view into one),
    rank order; None when ``t`` is not symmetric there. Not collective."""
    comm = _comm(group, "peer_addresses")
    team = comm._resources.get("cuda.team")
    if team is None or not team.symmetric:
        return None
    found = team.peer_addresses(t)
    return None if found is None else tuple(found)


def peer_tensor(t: torch.Tensor, rank: int, group=None) -> torch.Tensor:
    """A view of ``rank``'s copy of the symmetric tensor ``t``: same shape, strides and dtype, on this
    rank's device, reading and writing the peer's memory over the links. Not collective, and it orders
    nothing: pair it with ``signal``/``wait`` or ``barrier``. Valid while ``t`` lives and the group is not
    freed."""
    comm, team, ptrs = _symmetric_team("peer_tensor", t, group)
    if _rank("peer_tensor", rank, comm) == comm.rank:
        return t
    # bytes from the first element to one past the last: the sum of every dimension's farthest step
    span = (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1 if t.numel() else 0) * t.element_size()
    storage = torch._C._construct_storage_from_data_pointer(ptrs[rank], team.device, span)
    return torch.empty(0, dtype=t.dtype, device=team.device).set_(storage, 0, t.shape, t.stride())


def _transfer(fn, dst_addr, src_addr, ref: torch.Tensor, team, engine, stream):
    if engine not in ("copy", "sm"):
        raise ValueError(f"{fn}: engine={engine!r} must be 'copy' (the DMA engines) or 'sm' (a copy kernel)")
    nbytes = ref.numel() * ref.element_size()
    if not nbytes:
        return
    raw = _stream_handle(team.device, stream)
    if engine == "copy":
        copy_engine(dst_addr, src_addr, nbytes, raw)
        return
    from .kernels import KERNELS

    kind = word_dtype(nbytes, dst_addr, src_addr)
    k = team.kernel(KERNELS["copy"], ("symm.copy", kind), kind, num_warps=4, BLOCK=2048)
    n = nbytes // kind.itemsize
    k.bind(X=src_addr, Y=dst_addr, n=n)(raw)


def _contiguous(fn, name, t):
    if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
        raise TypeError(f"{fn}: {name} must be a CUDA tensor, got {type(t).__name__}"
                        + (f" on {t.device}" if isinstance(t, torch.Tensor) else ""))
    if not t.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous (stride {t.stride()} for shape {tuple(t.shape)})")


def put(dst: torch.Tensor, src: torch.Tensor, rank: int, *, group=None, engine: str = "copy", stream=None) -> None:
    """Write the local ``src`` into ``rank``'s copy of the symmetric ``dst`` (same number of bytes), on
    ``stream``: ``engine="copy"`` by the DMA engines, ``"sm"`` by a copy kernel. Orders nothing with the
    peer: ``signal`` after it, or ``barrier``. Not collective."""
    comm, team, ptrs = _symmetric_team("put", dst, group)
    _contiguous("put", "dst", dst)
    _contiguous("put", "src", src)
    _check_bytes("put", dst, src)
    _transfer("put", ptrs[_rank("put", rank, comm)], src.data_ptr(), src, team, engine, stream)


def get(dst: torch.Tensor, src: torch.Tensor, rank: int, *, group=None, engine: str = "copy", stream=None) -> None:
    """Read ``rank``'s copy of the symmetric ``src`` into the local ``dst`` (same number of bytes), on
    ``stream`` (see ``put``). Not collective."""
    comm, team, ptrs = _symmetric_team("get", src, group)
    _contiguous("get", "dst", dst)
    _contiguous("get", "src", src)
    _check_bytes("get", dst, src)
    _transfer("get", dst.data_ptr(), ptrs[_rank("get", rank, comm)], src, team, engine, stream)


def _check_bytes(fn, dst, src):
    a, b = dst.numel() * dst.element_size(), src.numel() * src.element_size()
    if a != b:
        raise ValueError(f"{fn}: dst has {a} B and src {b} B; they must match")


def _rank(fn, rank, comm):
    if not config.is_int(rank) or not 0 <= rank < comm.size:
        raise ValueError(f"{fn}: rank={rank!r} is not a rank of {comm.name} (size {comm.size})")
    return int(rank)


def _slot(fn, slot):
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < SIGNAL_SLOTS:
        raise ValueError(f"{fn}: slot={slot!r} must be an int in [0, {SIGNAL_SLOTS})")
    return slot


def signal(rank: int, slot: int = 0, *, group=None, stream=None) -> None:
    """Signal ``rank`` on semaphore ``slot``, on ``stream``: after everything queued before it there (the
    writes of earlier kernels and copies included) is done. Not collective; ``rank`` consumes it with
    ``wait(this rank, slot)``."""
    comm = _comm(group, "signal")
    # The bound launch of each (peer, slot), made once (the addresses are the team's for its lifetime).
    key = ("symm.signal", rank, slot) if rank.__class__ is int and slot.__class__ is int else None
    team = comm._resources.get("cuda.team")
    bound = None if team is None else team.plans.get(key)
    if bound is None:
        from .kernels import KERNELS

        peer, slot = _rank("signal", rank, comm), _slot("signal", slot)
        team = team_of(comm, "signal")
        k = team.kernel(KERNELS["signal"], ("symm.signal",), torch.int32, num_warps=1, grid=1,
                        pointers={"PEER_SLOT": torch.int32})
        bound = team.plans[key] = k.bind(PEER_SLOT=team.signal_ptrs[peer] + 4 * (slot * MAX_WORLD + comm.rank))
    team.check("signal")
    bound(_stream_handle(team.device, stream))


def wait(rank: int, slot: int = 0, *, group=None, stream=None, timeout=None) -> None:
    """Make ``stream`` wait until ``rank`` signalled ``slot`` once more than this rank consumed (a
    semaphore: each call consumes one signal), with a deadline: past it the next call on the group raises
    ``xelink.TimeoutError`` naming ``rank``. Not collective."""
    comm = _comm(group, "wait")
    deadline = timeout_ns(comm, timeout)
    key = ("symm.wait", rank, slot, deadline) if rank.__class__ is int and slot.__class__ is int else None
    team = comm._resources.get("cuda.team")
    bound = None if team is None else team.plans.get(key)
    if bound is None:
        from .kernels import KERNELS

        peer, slot = _rank("wait", rank, comm), _slot("wait", slot)
        team = team_of(comm, "wait")
        k = team.kernel(KERNELS["wait"], ("symm.wait",), torch.int32, num_warps=1, grid=1,
                        pointers={"MY_SLOT": torch.int32, "SEEN": torch.int32})
        at = 4 * (slot * MAX_WORLD + peer)
        bound = team.plans[key] = k.bind(MY_SLOT=team.signals.data_ptr() + at, SEEN=team.consumed.data_ptr() + at,
                                         who=peer, timeout_ns=deadline)
    team.check("wait")
    bound(_stream_handle(team.device, stream))


def barrier(group=None, *, stream=None, timeout=None) -> None:
    """A device barrier on ``stream``: work queued after it runs once every rank of ``group`` got there.

    The host does not wait. A rank that never arrives makes the kernel give up at the deadline; the next
    call (or ``synchronize``) raises ``xelink.TimeoutError`` naming it. Collective.
    """
    comm = _comm(group, "device_barrier")
    team = team_of(comm, "device_barrier")
    team.run("device_barrier", ("barrier", timeout), lambda t_ns: [team.barrier_piece(t_ns)], timeout, stream)


def synchronize(group=None) -> None:
    """Block until this rank's GPU work is done; raise ``xelink.TimeoutError`` if a GPU wait of the group
    (team or point-to-point, its own or a kept duplicate's) timed out."""
    comm = _comm(group, "synchronize")
    torch.cuda.synchronize(_device_of(comm))
    _raise_gpu_errors(comm)


def _raise_gpu_errors(comm) -> None:
    """Raise what the GPU waits of ``comm`` and of the duplicates it keeps as resources reported (e.g. the private
    duplicate of context-parallel attention's point-to-point, whose errors no call on ``comm`` itself would see;
    a duplicate that already failed has had its error raised)."""
    from ..comm import Communicator

    for key, obj in list(comm._resources.items()):
        if key in ("cuda.team", "cuda.mailboxes"):
            obj.check("synchronize")
        elif isinstance(obj, Communicator) and not obj._freed and obj._broken is None:
            _raise_gpu_errors(obj)

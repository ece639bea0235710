"""SYCL peer memory for one process driving several SYCL devices (or several queues of one device) through
dpctl: USM allocations every device of one context can read, copies between them on a queue, OpenCL C
kernels (``csrc/sycl_collectives.cl``) built once per (context, device), SYCL events for ordering, and a
device barrier on USM atomics with a deadline.

Unlike ``xelink.symm.cuda`` (one process per device, the group implicit), every call here names its queue and
the events it depends on: one host thread enqueues the work of every device.

Ordering, and where each mechanism is used:

- Collectives (``xelink.sycl``) order their phases by SYCL events at kernel boundaries: a phase on rank r's
  queue depends on the previous phase's events of every rank (``Team.last`` carries them from one call to the
  next). Nothing spins, so this is correct however the runtime schedules kernels, including several queues of
  one device standing for tiles and the 2-core CPU OpenCL device of CI.
- ``barrier`` is the device barrier: each rank's ``barrier_arrive`` kernel stores its epoch in a shared-USM
  word with an atomic, then its ``barrier_wait`` kernel spins on the others' words. The spin is bounded twice:
  by an iteration count and by an abort word that the host sets at the deadline; the host then raises
  ``xelink.TimeoutError`` naming the ranks (and devices) whose arrival never came. Measured on the CPU OpenCL
  runtime (2026.2, 2 cores): kernels of different queues run one at a time even on two sub-devices, in no
  fixed order, so each wait kernel of one ``barrier`` call also depends on the events of every arrival that
  call enqueued; an arrival enqueued by a later call (a rank entering after another rank's wait began) runs
  only after that wait gave up, which is the timeout case.

Copies: ``copy`` uses ``queue.memcpy_async`` when both allocations belong to one device. Between two
devices' allocations it runs the ``copy_<w>`` kernel instead: on the CPU OpenCL runtime a queue memcpy
between USM allocations of two sub-devices never completes (measured; kernels reading the same memory work).

dpctl finds no device until ``OCL_ICD_FILENAMES`` names the ICD library; when it is unset and the
environment ships ``<prefix>/lib/libintelocl.so`` (the ``intel-opencl-rt`` wheel), ``dpctl_module`` sets it
before importing dpctl.
"""
from __future__ import annotations

import ctypes
import time
from pathlib import Path

import numpy as np

from .. import config
from ..errors import TimeoutError
from ..work import Work as Handle

__all__ = ["DTYPES", "OPS", "USM_KINDS", "Buffer", "Team", "Work", "available", "dpctl_module", "alloc", "program",
           "kernel_source", "copy", "reduce", "barrier", "wait_events", "MAX_SOURCES"]

# name -> (numpy storage dtype, kernel suffix); bfloat16 is stored as 16-bit words (numpy has no bfloat16).
DTYPES = {
    "float32": (np.dtype(np.float32), "f32"),
    "float16": (np.dtype(np.float16), "f16"),
    "bfloat16": (np.dtype(np.uint16), "bf16"),
    "int32": (np.dtype(np.int32), "i32"),
    "int64": (np.dtype(np.int64), "i64"),
}
OPS = ("sum", "max", "min")
USM_KINDS = ("shared", "device")
MAX_SOURCES = 8  # sources of one reduce kernel launch (csrc/sycl_collectives.cl); more are chained
_SPIN_BOUND = 1 << 40  # the barrier's iteration bound, a backstop behind the host's abort word

_programs: dict = {}


def dpctl_module():
    """Import dpctl, first pointing the OpenCL ICD loader at the environment's ``libintelocl.so`` when
    ``OCL_ICD_FILENAMES`` is unset (must happen before dpctl loads). Raises ImportError if dpctl is absent."""
    config.opencl_runtime_default()
    import dpctl
    import dpctl.memory  # noqa: F401
    import dpctl.program  # noqa: F401
    return dpctl


def available() -> bool:
    """Whether dpctl imports and sees at least one device."""
    try:
        return bool(dpctl_module().get_devices())
    except ImportError:
        return False


def kernel_source() -> str:
    """The OpenCL C source of the collective kernels (``csrc/sycl_collectives.cl`` of the checkout)."""
    path = Path(__file__).resolve().parents[2] / "csrc" / "sycl_collectives.cl"
    if not path.exists():
        raise FileNotFoundError(f"xelink.symm.sycl: kernel source {path} is missing (the SYCL backend runs from a "
                                "checkout or an editable install)")
    return path.read_text()


def program(queue):
    """The collective kernels built for ``queue``'s (context, device), built at first use and cached."""
    dpctl = dpctl_module()
    key = (queue.sycl_context, queue.sycl_device)  # compared by the SYCL objects, not by the wrappers' addresses
    prog = _programs.get(key)
    if prog is None:
        try:
            prog = dpctl.program.create_program_from_source(queue, kernel_source())
        except dpctl.program.SyclProgramCompilationError as exc:  # dpctl gives no build log
            raise RuntimeError(f"program: csrc/sycl_collectives.cl did not build for "
                               f"{queue.sycl_device.name.strip()} (dpctl reports no build log: {exc!r})") from exc
        _programs[key] = prog
    return prog


class Buffer:
    """A byte range of one USM allocation: ``mem`` (the dpctl allocation), ``offset`` and ``nbytes``;
    ``device`` is the device the allocation belongs to, ``usm`` its kind (``"shared"`` or ``"device"``)."""

    def __init__(self, mem, offset: int, nbytes: int, usm: str):
        self.mem, self.offset, self.nbytes, self.usm = mem, offset, nbytes, usm
        self.device = mem.sycl_device

    @property
    def address(self) -> int:
        return self.mem._pointer + self.offset

    def sub(self, offset: int, nbytes: int) -> "Buffer":
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"Buffer.sub: range [{offset}, {offset + nbytes}) outside [0, {self.nbytes})")
        return Buffer(self.mem, self.offset + offset, nbytes, self.usm)

    def usm_memory(self):
        """A dpctl memory object for this range (a kernel argument or a memcpy end)."""
        if self.offset == 0 and self.nbytes == self.mem.nbytes:
            return self.mem
        dpctl = dpctl_module()
        return dpctl.memory.as_usm_memory(_View(self.mem, self.address, max(self.nbytes, 1)))

    def host_view(self) -> np.ndarray:
        """A writable uint8 numpy view (shared USM only)."""
        if self.usm != "shared":
            raise ValueError(f"Buffer.host_view: usm={self.usm!r} memory is not host-visible")
        whole = np.ndarray((self.mem.nbytes,), np.uint8, buffer=self.mem)
        return whole[self.offset:self.offset + self.nbytes]

    def overlaps(self, other: "Buffer") -> bool:
        return (self.nbytes > 0 and other.nbytes > 0 and self.address < other.address + other.nbytes
                and other.address < self.address + self.nbytes)


class _View:
    def __init__(self, mem, address: int, nbytes: int):
        self.__sycl_usm_array_interface__ = {"data": (address, False), "shape": (nbytes,), "strides": None,
                                             "typestr": "|u1", "version": 1, "syclobj": mem.sycl_queue}


def alloc(queue, nbytes: int, usm: str = "shared") -> Buffer:
    """``nbytes`` of USM on ``queue``'s device (``usm``: ``"shared"`` or ``"device"``), 64-byte aligned."""
    dpctl = dpctl_module()
    if usm not in USM_KINDS:
        raise ValueError(f"alloc: usm={usm!r} is not one of {', '.join(USM_KINDS)}")
    cls = dpctl.memory.MemoryUSMShared if usm == "shared" else dpctl.memory.MemoryUSMDevice
    mem = cls(max(int(nbytes), 64), alignment=64, queue=queue)
    return Buffer(mem, 0, int(nbytes), usm)


def _marker(queue, deps):
    return queue.submit_barrier(list(deps)) if deps else None


def copy(queue, dst: Buffer, src: Buffer, deps=()):
    """Enqueue a copy of ``src`` into ``dst`` (same length) on ``queue`` after ``deps``; returns its event
    (None when there is nothing to copy and nothing to wait for)."""
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copy: dst.nbytes={dst.nbytes} != src.nbytes={src.nbytes}")
    deps = [e for e in deps if e is not None]
    if dst.nbytes == 0 or dst.address == src.address:
        return _marker(queue, deps)
    if dst.device == src.device:
        return queue.memcpy_async(dst.usm_memory(), src.usm_memory(), dst.nbytes, deps or None)
    width = next(w for w in (8, 4, 2, 1) if dst.address % w == 0 and src.address % w == 0 and dst.nbytes % w == 0)
    kern = program(queue).get_sycl_kernel(f"copy_{width}")
    n = dst.nbytes // width
    return queue.submit_async(kern, [dst.usm_memory(), src.usm_memory(), ctypes.c_uint64(n)], [n], None, deps)


def reduce(queue, dst: Buffer, srcs, n: int, dtype: str, op: str, deps=()):
    """Enqueue ``dst[:n] = srcs[0] op srcs[1] op ...`` (elementwise over ``n`` elements of ``dtype``) on
    ``queue``; ``dst`` may be ``srcs[0]``. More than ``MAX_SOURCES`` sources chain launches through ``dst``
    (so ``dst`` must then not be any source but the first). Returns the last event."""
    deps = [e for e in deps if e is not None]
    srcs = list(srcs)
    if n == 0 or not srcs:
        return _marker(queue, deps)
    name = f"reduce_{DTYPES[dtype][1]}_{op}"
    kern = program(queue).get_sycl_kernel(name)
    ev = None
    first = True
    while srcs:
        take = srcs[:MAX_SOURCES] if first else [dst] + srcs[:MAX_SOURCES - 1]
        srcs = srcs[MAX_SOURCES:] if first else srcs[MAX_SOURCES - 1:]
        mems = [b.usm_memory() for b in take]
        args = [dst.usm_memory()] + mems + [mems[0]] * (MAX_SOURCES - len(mems))
        args += [ctypes.c_uint32(len(take)), ctypes.c_uint64(n)]
        ev = queue.submit_async(kern, args, [n], None, deps if first else [ev])
        first = False
    return ev


class Team:
    """The shared state of one group of queues in one context: ``queues[r]`` is rank r's, ``devices[r]``
    its device; ``last[r]`` the event of the latest work enqueued for rank r (collectives depend on these);
    the barrier's words live in one shared-USM allocation."""

    def __init__(self, queues):
        self.queues = list(queues)
        self.devices = [q.sycl_device for q in self.queues]
        self.size = len(self.queues)
        self.last: list = [None] * self.size
        self.epochs = [0] * self.size
        self._words = alloc(self.queues[0], 4 * (2 * self.size + 1), "shared")
        self.words = self._words.host_view().view(np.int32)
        self.words[:] = 0
        self._inflight: list = []

    def keep(self, work: "Work") -> None:
        """Hold ``work``'s buffers until its events complete (dropping a handle must not free memory a
        kernel still reads)."""
        self._inflight = [w for w in self._inflight if not w.is_completed()]
        self._inflight.append(work)

    def describe(self, rank: int) -> str:
        d = self.devices[rank]
        return f"rank {rank}: {d.name.strip()} ({d.filter_string if d.parent_device is None else 'sub-device'})"


class Work(Handle):
    """A handle on enqueued work: ``events`` (per rank, None where a rank had nothing to do), the buffers
    that must live until they complete, and ``wait(timeout)``; torch.distributed's Work protocol (``xelink.work``)."""

    def __init__(self, team: Team, what: str, events, keep=()):
        self.team, self.what, self.events, self._keep = team, what, list(events), list(keep)
        self._done = False

    def is_completed(self) -> bool:
        if not self._done:
            dpctl = dpctl_module()
            self._done = all(e is None or e.execution_status == dpctl.event_status_type.complete
                             for e in self.events)
        return self._done

    def wait(self, timeout=None) -> bool:
        """Wait for every rank's work, at most ``timeout`` seconds (None: ``XELINK_TIMEOUT``, else 300 s);
        raises ``xelink.TimeoutError`` naming the ranks whose work did not complete."""
        if not self._done:
            wait_events(self.events, timeout, self.what, self.team)
            self._done = True
            self._keep = []
        return True


def wait_events(events, timeout, what: str, team: Team | None = None) -> None:
    """Poll ``events`` (per rank; None entries are done) until all complete or the deadline passes."""
    dpctl = dpctl_module()
    limit = config.resolve_timeout(timeout, what)
    deadline = time.monotonic() + limit
    complete = dpctl.event_status_type.complete
    pause = 0.0
    while True:
        pending = [r for r, e in enumerate(events) if e is not None and e.execution_status != complete]
        if not pending:
            return
        if time.monotonic() > deadline:
            detail = "; ".join(team.describe(r) for r in pending) if team is not None else ""
            raise TimeoutError(what, pending, limit, detail)
        time.sleep(pause)
        pause = min(1e-3, pause + 2e-5)


def barrier(team: Team, ranks, timeout=None) -> None:
    """The device barrier of ``team``, entered by ``ranks`` (each rank's next epoch).

    Every rank of the team must arrive; ranks not in ``ranks`` arrive through a later call (after the
    deadline of this one passes on the CPU runtime: see the module docstring). On expiry the host sets the
    abort word, waits for the spinning kernels to leave, and raises ``xelink.TimeoutError`` naming the
    ranks whose arrival word is behind, with their devices; the late ranks then count as arrived (the next
    barrier starts from a common epoch).
    """
    limit = config.resolve_timeout(timeout, "barrier")
    n = team.size
    words_mem = team._words.usm_memory()
    epochs = {}
    for r in ranks:
        team.epochs[r] += 1
        epochs[r] = team.epochs[r]
    arrivals = {}
    for r in ranks:
        q = team.queues[r]
        arrive = program(q).get_sycl_kernel("barrier_arrive")
        deps = [e for e in team.last if e is not None]
        arrivals[r] = q.submit_async(arrive, [words_mem, ctypes.c_int32(r), ctypes.c_int32(epochs[r])], [1], None,
                                     deps)
    waits = {}
    for r in ranks:
        q = team.queues[r]
        wait_k = program(q).get_sycl_kernel("barrier_wait")
        waits[r] = q.submit_async(wait_k, [words_mem, ctypes.c_int32(r), ctypes.c_int32(n), ctypes.c_int32(epochs[r]),
                                           ctypes.c_uint64(_SPIN_BOUND)], [1], None, list(arrivals.values()))
    events = [waits.get(r) for r in range(n)]
    try:
        wait_events(events, limit, "barrier", team)
        timed_out = False
    except TimeoutError:
        timed_out = True
    outcome = {r: int(team.words[n + 1 + r]) for r in ranks}
    if timed_out or any(v != 1 for v in outcome.values()):
        team.words[n] = 1  # abort: every spinning wait leaves
        try:
            wait_events(events, limit, "barrier", team)
        finally:
            target = max(epochs.values())
            missing = [j for j in range(n) if int(team.words[j]) - target < 0]
            # Start the next barrier from a common epoch: the late ranks count as having arrived here.
            for j in range(n):
                team.epochs[j] = max(team.epochs[j], target)
                team.words[j] = team.epochs[j]
            team.words[n] = 0
            for r in ranks:
                team.last[r] = waits[r]
        detail = "; ".join(team.describe(j) for j in missing)
        raise TimeoutError("barrier", missing, limit, f"did not arrive: {detail}" if detail else "")
    for r in ranks:
        team.last[r] = waits[r]

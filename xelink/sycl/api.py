"""The single-process multi-device SYCL front door: one communicator per device entry, one host thread,
collectives that take one array per communicator in one call.

Every byte of payload is moved by queue copies or OpenCL kernels (``csrc/sycl_collectives.cl``) on the
ranks' queues; the host only enqueues and waits. Phases are ordered by SYCL events (``xelink.symm.sycl``
says why), so a collective is correct on any device list, including one device listed several times.

Algorithms (names as in ``xelink.cost.ALGOS``):
    all_reduce      direct (each rank reduces every input into a scratch, then copies it back),
                    two_shot (rank i reduces chunk i in place, then everyone copies the others' chunks),
                    ring (ring reduce-scatter then ring all-gather, in place),
                    hierarchical (package leaders reduce their package, then every package's partial,
                    then each rank copies from its leader)
    all_gather      direct, ring, topo (one crossing per remote package, then copies inside the package)
    reduce_scatter  dest_split (each rank reduces its block of every input), ring, hierarchical (each
                    package reduces every block over its members, then each rank reduces one partial
                    per package)
    all_to_all      dest_split
    broadcast       direct
"""
from __future__ import annotations

import numbers

import numpy as np

from .. import config
from ..collectives import registry
from ..symm import sycl as _s

__all__ = ["ALGOS", "SyclCommunicator", "SyclArray", "communicators", "empty", "all_reduce", "all_gather_into_tensor",
           "reduce_scatter_tensor", "all_to_all_single", "broadcast", "barrier", "topology"]

# The algorithms of this backend, registered in ``xelink.collectives.registry`` (backend ``"sycl"``, each name
# the cost model's schedule of the same name) at the end of this module; ``ALGOS`` is the registry's view.
_ALGOS = {
    "all_reduce": ("direct", "two_shot", "ring", "hierarchical"),
    "all_gather": ("direct", "ring", "topo"),
    "reduce_scatter": ("dest_split", "ring", "hierarchical"),
    "all_to_all": ("dest_split",),
    "broadcast": ("direct",),
}
_DIRECT_MAX_BYTES = 64 << 10  # auto: all_reduce below this takes the one-kernel direct path
_sub_devices: dict = {}
_contexts: dict = {}


class SyclCommunicator:
    """Rank ``rank`` of ``size`` entries in one process: ``device`` (a ``dpctl.SyclDevice``), ``queue`` (its own
    in-order ``dpctl.SyclQueue`` in the group's one context), ``packages`` (lists of ranks; entries on
    sub-devices of one parent form one package unless ``communicators(packages=...)`` says otherwise) and
    ``package`` (the index of this rank's)."""

    def __init__(self, team, rank: int, packages):
        self.team, self.rank, self.size = team, rank, team.size
        self.device, self.queue = team.devices[rank], team.queues[rank]
        self.packages = [list(p) for p in packages]
        self.package = next(i for i, p in enumerate(packages) if rank in p)

    def __repr__(self) -> str:
        return f"SyclCommunicator(rank={self.rank}, size={self.size}, device={self.device.name.strip()!r})"


class SyclArray:
    """``n`` elements of ``dtype`` in USM memory of ``comm``'s device (``usm``: ``"shared"`` or ``"device"``)."""

    def __init__(self, comm: SyclCommunicator, buf, n: int, dtype: str):
        if dtype not in _s.DTYPES:
            raise TypeError(f"SyclArray: dtype={dtype!r} is not one of {', '.join(_s.DTYPES)}")
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"SyclArray: n={n!r} must be an int (elements)")
        n = int(n)
        if n < 0 or n * _s.DTYPES[dtype][0].itemsize > buf.nbytes:
            raise ValueError(f"SyclArray: n={n!r} elements of {dtype} do not fit the buffer's {buf.nbytes} bytes")
        if buf.device != comm.device:
            raise ValueError(f"SyclArray: the buffer is on {buf.device.name.strip()!r}, not on rank {comm.rank}'s "
                             f"device {comm.device.name.strip()!r}")
        # the array is its n elements, not the whole buffer (numpy(), and the overlap checks of two arrays in one)
        self.comm, self.buffer, self.n, self.dtype = comm, buf.sub(0, n * _s.DTYPES[dtype][0].itemsize), n, dtype
        self.usm = buf.usm

    def __len__(self) -> int:
        return self.n

    @property
    def device(self):
        return self.buffer.device

    @property
    def itemsize(self) -> int:
        return _s.DTYPES[self.dtype][0].itemsize

    def numpy(self) -> np.ndarray:
        """A writable numpy view of shared USM (bfloat16 as uint16 words); device USM raises ValueError."""
        if self.usm != "shared":
            raise ValueError(f"SyclArray.numpy: usm={self.usm!r} is not host-visible; use to_host()/from_host()")
        return self.buffer.host_view().view(_s.DTYPES[self.dtype][0])

    def from_host(self, values) -> "SyclArray":
        """Copy ``values`` (n elements; bfloat16 as uint16 words) into the array with a queue copy; waits."""
        if self.dtype == "bfloat16" and np.asarray(values).dtype.kind not in "ui":
            # a float cast to uint16 would store its integer part as the word: silently wrong values
            raise TypeError("SyclArray.from_host: a bfloat16 array takes its 16-bit words (uint16), e.g. "
                            "torch.tensor(x, dtype=torch.bfloat16).view(torch.uint16).numpy(); got "
                            f"{np.asarray(values).dtype}")
        a = np.ascontiguousarray(values, dtype=_s.DTYPES[self.dtype][0]).reshape(-1)
        if a.size != self.n:
            raise ValueError(f"SyclArray.from_host: values has {a.size} elements, the array {self.n}")
        if self.n:
            # Every rank's queue may still read this array (collectives pull from peers): wait for all.
            _s.wait_events(self.comm.team.last, None, "from_host", self.comm.team)
            ev = self.comm.queue.memcpy_async(self.buffer.usm_memory(), a, a.nbytes)
            _s.wait_events([None] * self.comm.rank + [ev], None, "from_host", self.comm.team)
        return self

    def to_host(self) -> np.ndarray:
        """A numpy copy of the array, read by a queue copy after the rank's enqueued work completes."""
        out = np.empty(self.n, dtype=_s.DTYPES[self.dtype][0])
        if self.n:
            # Only rank r's queue writes rank r's arrays (every schedule pulls), so its own events suffice.
            last = [None] * self.comm.rank + [self.comm.team.last[self.comm.rank]]
            _s.wait_events(last, None, "to_host", self.comm.team)
            ev = self.comm.queue.memcpy_async(out, self.buffer.usm_memory(), out.nbytes)
            _s.wait_events([None] * self.comm.rank + [ev], None, "to_host", self.comm.team)
        return out

    def elements(self, start: int, count: int):
        """The USM buffer of elements ``[start, start + count)``."""
        return self.buffer.sub(start * self.itemsize, count * self.itemsize)


def _default_devices(dpctl):
    """Every GPU, each as its tiles where it partitions into them (Level Zero's composite hierarchy; under
    ``ZE_FLAT_DEVICE_HIERARCHY=FLAT``, how the Intel reference runs, each tile is a GPU of its own already),
    else the sub-devices of the CPU device (one compute unit each: the stand-ins of CPU tests)."""
    gpus = [d for d in dpctl.get_devices() if d.is_gpu]
    if gpus:
        return [tile for gpu in gpus for tile in _subs(gpu, "next_partitionable", whole=True)]
    cpus = [d for d in dpctl.get_devices() if d.is_cpu]
    if cpus:
        return list(_subs(cpus[0], 1))
    raise ValueError("communicators: dpctl sees no GPU or CPU device (is OCL_ICD_FILENAMES set?)")


def _subs(root, partition, whole: bool = False):
    """``root``'s sub-devices by ``partition``; where it cannot be partitioned so, ``[root]`` (``whole``) or
    ValueError."""
    # Keyed by the device (dpctl devices compare and hash by the SYCL device; a wrapper's address differs on
    # every lookup, which made every call partition, build and keep a new context): partitioning again would
    # give new sub-devices, so each root is partitioned once.
    key = (root, partition)
    if key not in _sub_devices:
        try:
            _sub_devices[key] = (root, root.create_sub_devices(partition=partition))
        except Exception as exc:  # dpctl raises its own SyclSubDeviceCreationError
            if not whole:
                raise ValueError(f"communicators: {root.name.strip()} cannot be partitioned: {exc}") from exc
            _sub_devices[key] = (root, [root])
    return _sub_devices[key][1]


def _resolve(dpctl, entry, i):
    if isinstance(entry, dpctl.SyclDevice):
        return entry
    if isinstance(entry, str):
        try:
            return dpctl.SyclDevice(entry)
        except Exception as exc:  # dpctl's SyclDeviceCreationError
            raise ValueError(f"communicators: devices[{i}]={entry!r} selects no device ({exc})") from exc
    raise TypeError(f"communicators: devices[{i}]={entry!r} is not a dpctl.SyclDevice or a filter string")


def communicators(devices=None, packages=None):
    """One communicator per entry of ``devices``, all in one SYCL context.

    Args:
        devices: a list of ``dpctl.SyclDevice`` or filter strings (``"opencl:cpu:0"``); the same device may
            appear more than once, each entry getting its own queue (tiles stand-ins). None: every GPU's
            tiles (a GPU that does not partition by ``"next_partitionable"`` is one entry: under Level Zero's
            flat hierarchy each tile is a GPU), else the sub-devices (one compute unit each) of the CPU device.
        packages: lists of ranks that share a fast link (a partition of ``range(len(devices))``). None: entries
            whose devices have one parent device (or are one device) form one package.

    Returns:
        list of ``SyclCommunicator``, rank order.
    """
    dpctl = _s.dpctl_module()
    if devices is None:
        devices = _default_devices(dpctl)
    if not isinstance(devices, (list, tuple)) or not devices:
        raise ValueError(f"communicators: devices={devices!r} must be a non-empty list")
    devs = [_resolve(dpctl, d, i) for i, d in enumerate(devices)]
    unique = []
    for d in devs:
        if not any(d == u for u in unique):
            unique.append(d)
    ctx_key = tuple(unique)  # the devices themselves (see _subs)
    ctx = _contexts.get(ctx_key)
    if ctx is None:
        ctx = _contexts[ctx_key] = (dpctl.SyclContext(unique), unique)
    ctx = ctx[0]
    queues = [dpctl.SyclQueue(ctx, d, property="in_order") for d in devs]
    n = len(devs)
    if packages is None:
        groups: list = []
        keys: list = []
        for r, d in enumerate(devs):
            parent = d.parent_device if d.parent_device is not None else d
            for k, g in zip(keys, groups):
                if k == parent:
                    g.append(r)
                    break
            else:
                keys.append(parent)
                groups.append([r])
        packages = groups
    else:
        packages = [list(p) for p in packages]
        flat = sorted(r for p in packages for r in p)
        if any(isinstance(r, bool) or not isinstance(r, int) for r in flat) or flat != list(range(n)) or \
                any(not p for p in packages):
            raise ValueError(f"communicators: packages={packages!r} is not a partition of ranks 0..{n - 1}")
    team = _s.Team(queues)
    return [SyclCommunicator(team, r, packages) for r in range(n)]


def empty(comm: SyclCommunicator, n: int, dtype: str = "float32", usm: str = "shared") -> SyclArray:
    """``n`` uninitialised elements of ``dtype`` (float32, float16, bfloat16, int32, int64) in USM memory of
    ``comm``'s device, readable by every device of its group."""
    if not isinstance(comm, SyclCommunicator):
        raise TypeError(f"empty: comm={comm!r} is not a SyclCommunicator")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"empty: n={n!r} must be a non-negative int")
    if dtype not in _s.DTYPES:
        raise ValueError(f"empty: dtype={dtype!r} is not one of {', '.join(_s.DTYPES)}")
    if usm not in _s.USM_KINDS:
        raise ValueError(f"empty: usm={usm!r} is not one of {', '.join(_s.USM_KINDS)}")
    n = int(n)
    buf = _s.alloc(comm.queue, n * _s.DTYPES[dtype][0].itemsize, usm)
    return SyclArray(comm, buf, n, dtype)


# ---------------------------------------------------------------- validation

def _check_arrays(fn: str, arrays, name: str = "arrays"):
    if not isinstance(arrays, (list, tuple)) or not arrays:
        raise TypeError(f"{fn}: {name} must be a non-empty list of SyclArray, one per communicator")
    for i, a in enumerate(arrays):
        if not isinstance(a, SyclArray):
            raise TypeError(f"{fn}: {name}[{i}]={a!r} is not a SyclArray (xelink.sycl.empty makes them)")
    team = arrays[0].comm.team
    if len(arrays) != team.size:
        raise ValueError(f"{fn}: len({name})={len(arrays)} != the group's size {team.size}")
    for i, a in enumerate(arrays):
        if a.comm.team is not team:
            raise ValueError(f"{fn}: {name}[{i}] belongs to another group of communicators")
        if a.comm.rank != i:
            raise ValueError(f"{fn}: {name}[{i}] lives on rank {a.comm.rank}'s device, not rank {i}'s "
                             f"({name} go in rank order)")
        if a.device != team.devices[i]:
            raise ValueError(f"{fn}: {name}[{i}] is on device {a.device.name.strip()!r}, not rank {i}'s")
        if a.dtype != arrays[0].dtype:
            raise TypeError(f"{fn}: {name}[{i}].dtype={a.dtype} != {name}[0].dtype={arrays[0].dtype}")
        if a.n != arrays[0].n:
            raise ValueError(f"{fn}: len({name}[{i}])={a.n} != len({name}[0])={arrays[0].n}")
        for j in range(i):  # (queues of one device may be handed views of one allocation)
            if a.buffer.overlaps(arrays[j].buffer):
                raise ValueError(f"{fn}: {name}[{i}] and {name}[{j}] share memory (every rank needs its own array)")
    config.resolve_timeout(None, fn)  # (a bad XELINK_TIMEOUT fails here, before any kernel is enqueued)
    return team


def _check_op(fn: str, op):
    if op not in _s.OPS:
        raise ValueError(f"{fn}: op={op!r} is not one of {', '.join(_s.OPS)}")


def _check_algo(fn: str, family: str, algo):
    if not isinstance(algo, str):
        raise TypeError(f"{fn}: algo={algo!r} must be a str ('auto' or an algorithm's name)")
    if algo != "auto":
        registry.get(fn, family, algo, "sycl")  # a ValueError naming fn and the choices


def _check_pair(fn: str, outs, ins, out_factor: int, in_factor: int):
    team = _check_arrays(fn, outs, "outs")
    if _check_arrays(fn, ins, "ins") is not team:
        raise ValueError(f"{fn}: outs and ins belong to different groups")
    if outs[0].dtype != ins[0].dtype:
        raise TypeError(f"{fn}: outs dtype {outs[0].dtype} != ins dtype {ins[0].dtype}")
    if outs[0].n * in_factor != ins[0].n * out_factor:
        lhs = f"len(outs[0])={outs[0].n}" if in_factor == 1 else f"{in_factor}*len(outs[0])={in_factor * outs[0].n}"
        rhs = f"len(ins[0])={ins[0].n}" if out_factor == 1 else f"{out_factor}*len(ins[0])={out_factor * ins[0].n}"
        raise ValueError(f"{fn}: {lhs} != {rhs}")
    return team


def _finish(team, what: str, events, keep, async_op: bool, outputs):
    work = _s.Work(team, what, events, keep)
    work.outputs = list(outputs)  # what the call writes: result() and the future's value
    team.last = list(events)
    team.keep(work)
    if async_op:
        return work
    work.wait()
    return None


# ---------------------------------------------------------------- schedules

def _bounds(n: int, parts: int, i: int):
    base, extra = divmod(n, parts)
    start = i * base + min(i, extra)
    return start, base + (1 if i < extra else 0)


class _Phases:
    """Runs steps in which every rank's work depends on the previous step of every rank."""

    def __init__(self, team):
        self.team = team
        self.events = list(team.last)

    def step(self, work):
        deps = [e for e in self.events if e is not None]
        new = list(self.events)
        for r in range(self.team.size):
            ev = work(r, self.team.queues[r], deps)
            if ev is not None:
                new[r] = ev
        self.events = new


def _all_reduce_direct(team, arrays, op, ph, keep):
    n, dt = arrays[0].n, arrays[0].dtype
    scratch = [_s.alloc(team.queues[r], n * arrays[0].itemsize, "device") for r in range(team.size)]
    keep += scratch
    whole = [a.elements(0, n) for a in arrays]
    ph.step(lambda r, q, deps: _s.reduce(q, scratch[r], whole, n, dt, op, deps))
    ph.step(lambda r, q, deps: _s.copy(q, whole[r], scratch[r], deps))


def _all_reduce_two_shot(team, arrays, op, ph, keep):
    n, dt, p = arrays[0].n, arrays[0].dtype, team.size

    def reduce_own(r, q, deps):
        s, c = _bounds(n, p, r)
        return _s.reduce(q, arrays[r].elements(s, c), [a.elements(s, c) for a in [arrays[r]] +
                                                        [a for j, a in enumerate(arrays) if j != r]], c, dt, op, deps)

    def gather(r, q, deps):
        ev = None
        for j in range(p):
            if j != r:
                s, c = _bounds(n, p, j)
                ev = _s.copy(q, arrays[r].elements(s, c), arrays[j].elements(s, c), deps) or ev
        return ev
    ph.step(reduce_own)
    ph.step(gather)


def _all_reduce_ring(team, arrays, op, ph, keep):
    n, dt, p = arrays[0].n, arrays[0].dtype, team.size
    for s in range(p - 1):
        def rs(r, q, deps, s=s):
            c = (r - s - 1) % p
            st, cnt = _bounds(n, p, c)
            mine = arrays[r].elements(st, cnt)
            return _s.reduce(q, mine, [mine, arrays[(r - 1) % p].elements(st, cnt)], cnt, dt, op, deps)
        ph.step(rs)
    for s in range(p - 1):
        def ag(r, q, deps, s=s):
            st, cnt = _bounds(n, p, (r - s) % p)
            return _s.copy(q, arrays[r].elements(st, cnt), arrays[(r - 1) % p].elements(st, cnt), deps)
        ph.step(ag)


def _all_reduce_hierarchical(team, arrays, op, ph, keep, packages):
    n, dt = arrays[0].n, arrays[0].dtype
    leaders = [pkg[0] for pkg in packages]
    leader_of = {r: pkg[0] for pkg in packages for r in pkg}
    scratch = {L: _s.alloc(team.queues[L], n * arrays[0].itemsize, "device") for L in leaders}
    keep += list(scratch.values())
    members = {pkg[0]: pkg for pkg in packages}
    ph.step(lambda r, q, deps: _s.reduce(q, scratch[r], [arrays[j].elements(0, n) for j in members[r]], n, dt, op,
                                         deps) if r in scratch else None)
    ph.step(lambda r, q, deps: _s.reduce(q, arrays[r].elements(0, n), [scratch[L] for L in leaders], n, dt, op,
                                         deps) if r in scratch else None)
    ph.step(lambda r, q, deps: None if r in scratch else
            _s.copy(q, arrays[r].elements(0, n), arrays[leader_of[r]].elements(0, n), deps))


def all_reduce(arrays, op: str = "sum", algo: str = "auto", async_op: bool = False):
    """Reduce ``arrays`` (one per communicator, rank order, equal length and dtype) elementwise; every array
    ends holding the result, in place.

    Args:
        arrays: list of ``SyclArray``, ``arrays[r]`` on rank r's device.
        op: ``"sum"``, ``"max"`` or ``"min"``.
        algo: ``"auto"``, ``"direct"``, ``"two_shot"``, ``"ring"`` or ``"hierarchical"``.
        async_op: return a handle (``wait(timeout=None)``) instead of waiting.

    collective: one call covers every communicator of the group.
    """
    fn = "all_reduce"
    team = _check_arrays(fn, arrays)
    _check_op(fn, op)
    _check_algo(fn, "all_reduce", algo)
    packages = arrays[0].comm.packages
    if algo == "auto":
        nbytes = arrays[0].n * arrays[0].itemsize
        algo = "direct" if nbytes <= _DIRECT_MAX_BYTES else ("hierarchical" if 1 < len(packages) < team.size
                                                             else "two_shot")
    keep: list = []
    ph = _Phases(team)
    if team.size > 1 and arrays[0].n > 0:
        if algo == "hierarchical":
            _all_reduce_hierarchical(team, arrays, op, ph, keep, packages)
        else:
            {"direct": _all_reduce_direct, "two_shot": _all_reduce_two_shot,
             "ring": _all_reduce_ring}[algo](team, arrays, op, ph, keep)
    return _finish(team, fn, ph.events, keep + list(arrays), async_op, arrays)


def all_gather_into_tensor(outs, ins, algo: str = "auto", async_op: bool = False):
    """Concatenate every rank's ``ins[r]`` (n elements) in rank order into each ``outs[r]`` (size*n).

    ``ins[r]`` may be rank r's own block of ``outs[r]`` (in-place gather). ``algo``: ``"auto"``, ``"direct"``,
    ``"ring"`` or ``"topo"``. collective: one call covers every communicator of the group.
    """
    fn = "all_gather_into_tensor"
    _check_algo(fn, "all_gather", algo)
    team = _check_pair(fn, outs, ins, _team_size(outs), 1)
    p, n = team.size, ins[0].n
    for r in range(p):
        own = outs[r].elements(r * n, n)
        for j in range(p):
            if outs[r].buffer.overlaps(ins[j].buffer) and not (j == r and own.address == ins[r].buffer.address):
                raise ValueError(f"{fn}: outs[{r}] overlaps ins[{j}] other than as rank {r}'s own block")
    packages = outs[0].comm.packages
    if algo == "auto":
        algo = "topo" if 1 < len(packages) < p else "direct"
    ph = _Phases(team)
    blk = [[outs[r].elements(j * n, n) for j in range(p)] for r in range(p)]
    src = [ins[j].elements(0, n) for j in range(p)]

    def copies(q, pairs, deps):
        ev = None
        for dst, s in pairs:
            ev = _s.copy(q, dst, s, deps) or ev
        return ev
    if n > 0:
        if algo == "direct":
            ph.step(lambda r, q, deps: copies(q, [(blk[r][j], src[j]) for j in range(p)], deps))
        elif algo == "ring":
            ph.step(lambda r, q, deps: copies(q, [(blk[r][r], src[r])], deps))
            for s in range(1, p):
                ph.step(lambda r, q, deps, s=s: copies(q, [(blk[r][(r - s) % p], blk[(r - 1) % p][(r - s) % p])],
                                                       deps))
        else:
            pkg_of = {r: i for i, pkg in enumerate(packages) for r in pkg}
            # fetcher[(i, k)]: the rank of package i that brings package k's blocks over the fabric
            fetcher = {}
            for i, pkg in enumerate(packages):
                remote = [k for k in range(len(packages)) if k != i]
                for t, k in enumerate(remote):
                    fetcher[(i, k)] = pkg[t % len(pkg)]

            def cross(r, q, deps):
                i = pkg_of[r]
                pairs = [(blk[r][j], src[j]) for j in packages[i]]
                pairs += [(blk[r][j], src[j]) for k in range(len(packages)) if k != i and fetcher[(i, k)] == r
                          for j in packages[k]]
                return copies(q, pairs, deps)

            def spread(r, q, deps):
                i = pkg_of[r]
                pairs = [(blk[r][j], blk[fetcher[(i, k)]][j]) for k in range(len(packages))
                         if k != i and fetcher[(i, k)] != r for j in packages[k]]
                return copies(q, pairs, deps)
            ph.step(cross)
            ph.step(spread)
    return _finish(team, fn, ph.events, list(outs) + list(ins), async_op, outs)


def _team_size(arrays) -> int:
    if isinstance(arrays, (list, tuple)) and arrays and isinstance(arrays[0], SyclArray):
        return arrays[0].comm.size
    return 1


def reduce_scatter_tensor(outs, ins, op: str = "sum", algo: str = "auto", async_op: bool = False):
    """Reduce ``ins`` (size*n elements each) elementwise; ``outs[r]`` (n elements) gets block r of the result.

    ``outs`` must not overlap ``ins``. ``algo``: ``"auto"``, ``"dest_split"``, ``"ring"`` or ``"hierarchical"``.
    collective: one call covers every communicator of the group.
    """
    fn = "reduce_scatter_tensor"
    _check_op(fn, op)
    _check_algo(fn, "reduce_scatter", algo)
    team = _check_pair(fn, outs, ins, 1, _team_size(outs))
    p, n, dt = team.size, outs[0].n, outs[0].dtype
    for r in range(p):
        for j in range(p):
            if outs[r].buffer.overlaps(ins[j].buffer):
                raise ValueError(f"{fn}: outs[{r}] overlaps ins[{j}]")
    if algo == "auto":
        algo = "dest_split"
    ph = _Phases(team)
    keep: list = list(outs) + list(ins)
    if n > 0:
        if algo == "hierarchical" and p > 1:
            keep += _reduce_scatter_hierarchical(team, outs, ins, op, ph, outs[0].comm.packages)
        elif algo in ("dest_split", "hierarchical") or p == 1:
            ph.step(lambda r, q, deps: _s.reduce(q, outs[r].elements(0, n), [ins[r].elements(r * n, n)] +
                                                 [ins[j].elements(r * n, n) for j in range(p) if j != r],
                                                 n, dt, op, deps))
        else:
            acc = [[_s.alloc(team.queues[r], n * outs[0].itemsize, "device") for _ in range(2)] for r in range(p)]
            keep += [b for pair in acc for b in pair]
            for s in range(p):
                def step(r, q, deps, s=s):
                    c = (r - 1 - s) % p
                    dst = outs[r].elements(0, n) if s == p - 1 else acc[r][s % 2]
                    srcs = [ins[r].elements(c * n, n)] + ([acc[(r - 1) % p][(s - 1) % 2]] if s else [])
                    return _s.reduce(q, dst, srcs, n, dt, op, deps)
                ph.step(step)
    return _finish(team, fn, ph.events, keep, async_op, outs)


def _reduce_scatter_hierarchical(team, outs, ins, op, ph, packages):
    p, n, dt = team.size, outs[0].n, outs[0].dtype
    # holder[(i, d)]: the member of package i that reduces block d over package i (spread over members)
    holder, slot, count = {}, {}, [0] * p
    for i, pkg in enumerate(packages):
        for d in range(p):
            m = pkg[d % len(pkg)]
            holder[(i, d)], slot[(i, d)] = m, count[m]
            count[m] += 1
    scratch = [_s.alloc(team.queues[r], max(count[r], 1) * n * outs[0].itemsize, "device") for r in range(p)]
    part = {key: scratch[m].sub(slot[key] * n * outs[0].itemsize, n * outs[0].itemsize) for key, m in holder.items()}

    def within(r, q, deps):
        ev = None
        for (i, d), m in holder.items():
            if m == r:
                srcs = [ins[j].elements(d * n, n) for j in packages[i]]
                ev = _s.reduce(q, part[(i, d)], srcs, n, dt, op, deps) or ev
        return ev

    def across(r, q, deps):
        own = next(i for i, pkg in enumerate(packages) if r in pkg)
        order = [own] + [i for i in range(len(packages)) if i != own]
        return _s.reduce(q, outs[r].elements(0, n), [part[(i, r)] for i in order], n, dt, op, deps)
    ph.step(within)
    ph.step(across)
    return scratch


def all_to_all_single(outs, ins, algo: str = "auto", async_op: bool = False):
    """Block j of ``ins[r]`` goes to block r of ``outs[j]`` (equal blocks: each array holds size*m elements).

    ``outs`` must not overlap ``ins``. ``algo``: ``"auto"`` or ``"dest_split"``.
    collective: one call covers every communicator of the group.
    """
    fn = "all_to_all_single"
    _check_algo(fn, "all_to_all", algo)
    team = _check_pair(fn, outs, ins, 1, 1)
    p = team.size
    if ins[0].n % p:
        raise ValueError(f"{fn}: len(ins[0])={ins[0].n} is not divisible by the group's size {p}")
    for r in range(p):
        for j in range(p):
            if outs[r].buffer.overlaps(ins[j].buffer):
                raise ValueError(f"{fn}: outs[{r}] overlaps ins[{j}]")
    m = ins[0].n // p
    ph = _Phases(team)

    def pull(r, q, deps):
        ev = None
        for j in range(p):
            ev = _s.copy(q, outs[r].elements(j * m, m), ins[j].elements(r * m, m), deps) or ev
        return ev
    if m:
        ph.step(pull)
    return _finish(team, fn, ph.events, list(outs) + list(ins), async_op, outs)


def broadcast(arrays, src: int = 0, algo: str = "auto", async_op: bool = False):
    """Copy ``arrays[src]`` into every other array. ``algo``: ``"auto"`` or ``"direct"``.
    collective: one call covers every communicator of the group."""
    fn = "broadcast"
    _check_algo(fn, "broadcast", algo)
    team = _check_arrays(fn, arrays)
    if isinstance(src, bool) or not isinstance(src, (int, np.integer)) or not 0 <= src < team.size:
        raise ValueError(f"{fn}: src={src!r} is not a rank of the group (0..{team.size - 1})")
    n = arrays[0].n
    ph = _Phases(team)
    if n:
        ph.step(lambda r, q, deps: None if r == src else
                _s.copy(q, arrays[r].elements(0, n), arrays[src].elements(0, n), deps))
    return _finish(team, fn, ph.events, list(arrays), async_op, arrays)


def barrier(comms, timeout=None) -> None:
    """The device barrier (USM atomics, ``xelink.symm.sycl.barrier``) entered by ``comms`` (communicators of
    one group; ranks left out must arrive through their own call). Raises ``xelink.TimeoutError`` naming the
    ranks and devices that did not arrive by the deadline (``timeout`` seconds; None: ``XELINK_TIMEOUT``,
    else 300 s)."""
    fn = "barrier"
    if isinstance(comms, SyclCommunicator):
        comms = [comms]
    if not isinstance(comms, (list, tuple)) or not comms or not all(isinstance(c, SyclCommunicator) for c in comms):
        raise TypeError(f"{fn}: comms={comms!r} must be a non-empty list of SyclCommunicator")
    team = comms[0].team
    if any(c.team is not team for c in comms):
        raise ValueError(f"{fn}: comms belong to different groups")
    ranks = [c.rank for c in comms]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{fn}: ranks {ranks} repeat")
    _s.barrier(team, ranks, timeout)


# The cost model's figures for the queues' shared memory. CPU OpenCL device: fitted by eye to
# benchmarks/results/cpu-sycl (about 0.25 ms a call of a few phases at 4 KiB, copies at a few GB/s with the
# 2 cores shared); GPU stacks: the MDFI figures of topologies/intel-max-1550x6.toml (unmeasured here).
_USM_FIGURES = {
    "cpu": (4.0, "estimate: the CPU OpenCL device of the 2-core CI VM (benchmarks/results/cpu-sycl)", 60.0,
            "estimate: enqueue and event wait of one phase through dpctl on that device"),
    "xpu": (152.0, "estimate: MDFI between the stacks of one Intel Max card (topologies/intel-max-1550x6.toml)",
            2.0, "estimate: MDFI latency (topologies/intel-max-1550x6.toml)"),
}


def topology(comms):
    """The cost model's ``Topology`` of these communicators and the placement of their ranks: one device per
    rank (kind ``xpu`` for GPU devices, ``cpu`` otherwise), the communicators' packages, and one USM link
    joining every device (all allocations of the one context are reachable from every device), with the
    estimated figures of ``_USM_FIGURES``."""
    from ..topology import Device, Link, Package, Placement, Topology, validate

    if not comms or any(not isinstance(c, SyclCommunicator) for c in comms) or len(comms) != comms[0].size or \
            any(c.team is not comms[0].team or c.rank != r for r, c in enumerate(comms)):
        raise ValueError(f"topology: comms={comms!r} must be the list communicators() returned (the whole group, "
                         f"in rank order)")
    dpctl = _s.dpctl_module()
    kind = "xpu" if comms[0].device.device_type == dpctl.device_type.gpu else "cpu"
    bw, bw_src, lat, lat_src = _USM_FIGURES[kind]
    ids = [f"q{r}" for r in range(len(comms))]
    pkgs = tuple(Package(id=f"p{i}", devices=tuple(ids[r] for r in p), name=f"queues {p}")
                 for i, p in enumerate(comms[0].packages))
    devs = tuple(Device(id=ids[r], package=f"p{i}", kind=kind, name=comms[r].device.name.strip(), injection_gbps=bw,
                        injection_source=bw_src) for i, p in enumerate(comms[0].packages) for r in p)
    links = (Link("usm", "usm", tuple(ids), bw, bw_src, lat, lat_src),)
    topo = validate(Topology(name="sycl-queues", description=f"{len(comms)} SYCL queue(s) of one context",
                             packages=pkgs, devices=devs, links=links), fn="topology")
    return topo, Placement(topo, tuple(ids))


def _register() -> dict:
    """Register every algorithm of ``_ALGOS`` (the op's public function as its implementation); the names."""
    impls = {"all_reduce": all_reduce, "all_gather": all_gather_into_tensor, "reduce_scatter": reduce_scatter_tensor,
             "all_to_all": all_to_all_single, "broadcast": broadcast}
    for op, names in _ALGOS.items():
        for name in names:
            registry.register(op, name, "sycl", impls[op], summary=f"xelink.sycl {op} {name} (one process, SYCL queues)")
    return registry.names("sycl")


ALGOS = _register()

"""An alpha-beta model of collective algorithms on a topology: predicted time and per-link traffic.

An algorithm is a *schedule*: a list of steps, each a set of transfers ``(src rank, dst rank, bytes)``
that run at the same time; a step starts when the previous one has finished (the steps of a real
implementation are separated by a barrier or flag wait). ``schedule`` builds it, ``predict`` prices it.

**Price of one step.** Each transfer from device a to device b takes the link ``topology.route(a, b)``
chooses, on the channel ``(link, a', b')`` (a', b' are a and b, or their packages or hosts, for links that
join packages or hosts). Transfers between ranks of the same device are local copies (priced only by a
calibration's copy bandwidth, see below). The transfers of a step load four kinds of resource:

- a link channel:  ``latency + bytes on the channel / bandwidth_gbps``;
- a device's injection limit (all it sends, over every link): ``latency + bytes sent / injection_gbps``;
- a device's ejection limit (all it receives):                  ``latency + bytes received / ejection``;
- a link's per-device cap (what one device sends over that link, to any number of peers):
  ``latency + bytes / per_device_gbps``,

where ``latency`` is that of the link (for a device: the slowest link it uses in the step). So a device
that sends to k peers at once shares its injection bandwidth among them, and a channel used by several
devices shares its bandwidth. The step takes as long as its busiest resource:

    T_step = max over resources r of (alpha_r + bytes_r / bw_r)

and the algorithm takes ``T = sum of T_step`` (no overlap between steps). GB/s are 1e9 bytes/s, latencies
microseconds. A step that moves no bytes costs nothing, so a size-0 collective or a world of one rank is
predicted to take 0 s.

**Software and local work (a ``Calibration``).** Links are not all a collective pays. Where the software
stack is slow next to the links (Python and MPI on CPU ranks: tens to hundreds of microseconds a step),
or where local memory is (a CPU copying and summing buffers), ``predict(..., calibration=c)`` adds what
the code does besides moving bytes:

- ``call_us`` once per call that communicates (entering the API, argument checks, the ranks
  meeting at the first step);
- ``step_us + message_us * m`` per step, where m is the largest number of messages one rank posts in
  the step (a send or receive each; in a step that *reads* peer memory, one per peer read);
- per rank, ``copy bytes / copy_gbps + reduced bytes / reduce_gbps`` of its device, for the copies and
  reductions the implementation makes (``acc = x.clone()``, ``acc += received``, the final copy back).
  Work done after a step's transfers (a ring reduce-scatter sums what it received) adds to the step;
  work that reads peer memory as it goes (the one-shot all-reduce on shared memory) overlaps the
  transfers: that step takes ``max(transfers, local work)``. Work outside any step (the first clone,
  the last copy) is its own step without transfers. The slowest rank sets each step's local time.

so with a calibration ``T_step = step_us + message_us * m + max(T_links, T_fused) + T_after`` and
``T = call_us + sum of T_step``. Without one (the default) every such term is zero, so the shipped GPU
descriptions predict exactly what the link model alone predicts. ``xelink bench probe`` measures a
calibration (and the link figures) on the running job; ``load_calibration`` reads one.

**Sizes.** ``nbytes`` follows nccl-tests: the buffer of each rank for all_reduce, broadcast and
all_to_all (which sends ``nbytes / n`` to each rank); the *output* of each rank for all_gather
(each rank contributes ``nbytes / n``); the *input* of each rank for reduce_scatter (each rank keeps
``nbytes / n``). Chunk i of a buffer split n ways has ``nbytes // n`` bytes, plus one for i < nbytes % n.

**Algorithms** (n ranks, P packages, rank order = placement order; see ``schedule`` for each):

======================  ===================================================================================
all_reduce ring         reduce-scatter ring then all-gather ring: 2(n-1) steps of one chunk per rank
all_reduce direct       one-shot: one step, every rank reads the whole buffer of every peer and sums as it
                        reads (peer memory); copy in before, copy out after
all_reduce two_shot     direct reduce-scatter (each rank reads its chunk from every peer), then direct all-gather
all_reduce hierarchical reduce-scatter inside each package, each chunk's package partials exchanged with the
                        ranks that hold the same bytes in the other packages, all-gather inside each package
all_gather ring         n-1 steps, each rank forwards one shard to the next
all_gather direct       one step, each rank writes its shard to every peer
all_gather topo         step 1: each shard goes to *one* rank of every remote package (the one with the
                        sender's local index, modulo that package's size); step 2: every rank sends what
                        it holds (its own shard and those it received) to the rest of its package
reduce_scatter ring     n-1 steps, each rank forwards one partial chunk to the next
reduce_scatter          one step, every rank sends each destination its block (the destination reduces)
  dest_split
reduce_scatter          chunk d is first reduced inside each package on the rank with d's local index
  hierarchical          (modulo package size), which then sends that package partial to d: every chunk
                        crosses the fabric once per remote package
all_to_all dest_split   one step, every block straight to its destination
broadcast direct        one step, the root writes the buffer to every rank
======================  ===================================================================================

The schedules and the local work follow ``xelink.collectives`` step for step. Every algorithm of the
collectives' registry (``xelink.collectives.registry``, every backend) names the schedule it runs, so
``best`` can choose among the algorithms a collective implements; ``dest_split`` is the one-step push
to each destination, as the Intel reference names it. ``best`` picks the fastest algorithm; it is what
``algo="auto"`` consults when no measured tuning table exists.
"""
from __future__ import annotations

import dataclasses
import math
import operator
import os
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from .config import integer
from .layout import CP_LAYOUTS, cp_pieces, topo_ring
from .topology import SOURCE_KINDS, Placement, Topology, place

__all__ = [
    "OPS",
    "ALGOS",
    "Transfer",
    "StepCost",
    "Prediction",
    "Calibration",
    "DeviceLocal",
    "schedule",
    "predict",
    "predict_all",
    "best",
    "DIST_GEMM_OPS",
    "DIST_GEMM_ALGOS",
    "GEMM_TFLOPS",
    "predict_dist_gemm",
    "ATTN_TFLOPS",
    "CP_ATTENTION_ALGOS",
    "predict_cp_attention",
    "cp_attention_table",
    "dist_gemm_table",
    "parse_size",
    "parse_shape",
    "table",
    "load_calibration",
    "loads_calibration",
    "dumps_calibration",
    "save_calibration",
]

# The schedules the model prices: every algorithm of ``xelink.collectives.registry`` names one of these
# (the registry's test checks it), and there is no schedule that no algorithm implements.
ALGOS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("ring", "direct", "two_shot", "hierarchical"),
    "all_gather": ("ring", "direct", "topo"),
    "reduce_scatter": ("ring", "dest_split", "hierarchical"),
    "all_to_all": ("dest_split",),
    "broadcast": ("direct",),
}
OPS = tuple(ALGOS)


@dataclasses.dataclass(frozen=True)
class Transfer:
    """``nbytes`` from rank ``src`` to rank ``dst`` within one step."""

    src: int
    dst: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class StepCost:
    """One step: its predicted time, the resource that set it, and the bytes it moved between devices."""

    time_s: float
    bottleneck: str
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What the model predicts for one (topology, placement, op, algo, size).

    Attributes:
        time_s: predicted time in seconds: the sum of the steps, plus a calibration's ``call_us``.
        steps: each step's time, bottleneck and bytes (with a calibration, local work outside any
            step of transfers shows as a step of 0 bytes).
        traffic: bytes per directed channel, ``"<link> <a>-><b>"`` (a, b: the endpoints the link joins).
        link_bytes: bytes per link (all its channels, both directions).
        bottleneck: the resource that set the most predicted time over all steps.
        overhead_s: software time (a calibration's call, step and message terms; 0 without one).
        latency_s: link and device latencies on the critical path (the alpha of each step's bottleneck).
        local_s: local copies and reductions on the critical path (0 without a calibration).
        calibration: the name of the calibration used, or None.
        compute_s: for a distributed GEMM (``predict_dist_gemm``), the slowest rank's GEMM time; the
            rest of ``time_s`` is communication the GEMM did not hide. 0 for a collective.
    """

    topology: str
    nranks: int
    op: str
    algo: str
    nbytes: int
    time_s: float
    steps: tuple[StepCost, ...]
    traffic: dict
    link_bytes: dict
    bottleneck: str
    overhead_s: float = 0.0
    latency_s: float = 0.0
    local_s: float = 0.0
    calibration: str | None = None
    compute_s: float = 0.0

    @property
    def algbw_gbps(self) -> float:
        """nccl-tests algorithm bandwidth, nbytes / time, in GB/s (0 when the time is 0)."""
        return self.nbytes / self.time_s / 1e9 if self.time_s > 0 else 0.0

    @property
    def bandwidth_fraction(self) -> float:
        """The share of ``time_s`` that grows with the bytes (1 - (overhead + latency) / time); 0 at 0 s."""
        if self.time_s <= 0:
            return 0.0
        return max(0.0, 1.0 - (self.overhead_s + self.latency_s) / self.time_s)


# ---------------------------------------------------------------------------------------------
# Calibration: the software and local-memory terms


@dataclasses.dataclass(frozen=True)
class DeviceLocal:
    """Local memory figures of one device: GB/s of a copy and of a reduction (``acc += x``).

    A reduction's bytes are those of the operand ``x``; None means free (not modelled).
    """

    copy_gbps: float | None = None
    reduce_gbps: float | None = None


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What a collective costs besides its links: software per call, step and message; local copies.

    Attributes:
        name: names the calibration in predictions and errors.
        call_us: once per call that communicates.
        step_us: once per step of transfers.
        message_us: per message the busiest rank posts in a step.
        local: the local figures every device has unless ``devices`` names it.
        devices: device id -> ``DeviceLocal`` for devices that differ.
        sources: figure -> where it comes from (``"call_us"``, ``"copy_gbps"``, ``"rank0.copy_gbps"``...),
            each starting with ``measured here``, ``datasheet``, ``paper`` or ``estimate``.
        topology: the name of the topology it was measured with ("" if none); informational.
        description: free text.

    ``Calibration()`` (all zero, nothing local) leaves every prediction as the link model makes it.
    """

    name: str = "none"
    call_us: float = 0.0
    step_us: float = 0.0
    message_us: float = 0.0
    local: DeviceLocal = DeviceLocal()
    devices: Mapping[str, DeviceLocal] = dataclasses.field(default_factory=dict)
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)
    topology: str = ""
    description: str = ""

    def device_local(self, device_id: str) -> DeviceLocal:
        """The local figures of ``device_id`` (its own entry, else the defaults)."""
        return self.devices.get(device_id, self.local)


_CAL_TOP_KEYS = {"name", "description", "topology", "call_us", "call_source", "step_us", "step_source",
                 "message_us", "message_source", "device_defaults", "devices"}
_CAL_DEVICE_KEYS = {"id", "copy_gbps", "copy_source", "reduce_gbps", "reduce_source"}


def _cal_fail(where: str, fn: str, msg: str, exc=ValueError):
    raise exc(f"{fn}: {where}: {msg}")


def _cal_number(data: Mapping, key: str, where: str, fn: str, what: str, *, zero_ok: bool):
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _cal_fail(where, fn, f"{what}{key}={value!r} must be a number", TypeError)
    ok = math.isfinite(value) and (value >= 0 if zero_ok else value > 0)
    if not ok:
        _cal_fail(where, fn, f"{what}{key}={value!r} must be a {'non-negative' if zero_ok else 'positive'}, "
                             f"finite number")
    source_key = key.rsplit("_", 1)[0] + "_source"
    source = data.get(source_key)
    if not isinstance(source, str) or not any(source == k or source.startswith(k + ":") for k in SOURCE_KINDS):
        _cal_fail(where, fn, f"{what}{source_key}={source!r} must be one of "
                             f"{', '.join(repr(k) for k in SOURCE_KINDS)}, optionally followed by ': detail'")
    return float(value), source


def _cal_local(entry: Mapping, where: str, fn: str, what: str, sources: dict, prefix: str,
               base: DeviceLocal) -> DeviceLocal:
    unknown = sorted(set(entry) - _CAL_DEVICE_KEYS)
    if unknown:
        _cal_fail(where, fn, f"unknown key {unknown[0]!r} in {what.strip() or 'an entry'} "
                             f"(known: {', '.join(sorted(_CAL_DEVICE_KEYS))})")
    got = {}
    for key in ("copy_gbps", "reduce_gbps"):
        if key in entry:
            got[key], sources[prefix + key] = _cal_number(entry, key, where, fn, what, zero_ok=False)
    return dataclasses.replace(base, **got)


def loads_calibration(text: str, path: str | None = None, fn: str = "loads_calibration") -> Calibration:
    """Parse a calibration from TOML text (the format ``dumps_calibration`` writes).

    Raises:
        ValueError: invalid TOML, unknown keys, negative or non-finite figures, a figure without a
            source of a known kind, a device listed twice; the message names the file.
        TypeError: a field of the wrong type.
    """
    from .topology import parse_toml

    where = path or "<string>"
    data = parse_toml(text, where, fn)
    unknown = sorted(set(data) - _CAL_TOP_KEYS)
    if unknown:
        _cal_fail(where, fn, f"unknown key {unknown[0]!r} in the file (known: {', '.join(sorted(_CAL_TOP_KEYS))})")
    for key in ("name", "description", "topology"):
        if key in data and not isinstance(data[key], str):
            _cal_fail(where, fn, f"{key}={data[key]!r} must be a string", TypeError)
    if not data.get("name"):
        _cal_fail(where, fn, "the file has no 'name'")
    sources: dict = {}
    terms = {}
    for key in ("call_us", "step_us", "message_us"):
        if key in data:
            terms[key], sources[key] = _cal_number(data, key, where, fn, "", zero_ok=True)
    defaults = data.get("device_defaults", {})
    if not isinstance(defaults, Mapping):
        _cal_fail(where, fn, "[device_defaults] must be a table", TypeError)
    local = _cal_local(defaults, where, fn, "[device_defaults] ", sources, "", DeviceLocal())
    devices: dict = {}
    entries = data.get("devices", [])
    if not isinstance(entries, list) or not all(isinstance(e, Mapping) for e in entries):
        _cal_fail(where, fn, "'devices' must be an array of tables ([[devices]])", TypeError)
    for i, entry in enumerate(entries):
        did = entry.get("id")
        if not isinstance(did, str) or not did:
            _cal_fail(where, fn, f"[[devices]] entry #{i} has no string 'id'")
        if did in devices:
            _cal_fail(where, fn, f"duplicate device id {did!r} in [[devices]]")
        devices[did] = _cal_local(entry, where, fn, f"device {did!r} ", sources, f"{did}.", local)
    return Calibration(name=data["name"], description=data.get("description", ""),
                       topology=data.get("topology", ""), local=local, devices=devices, sources=sources, **terms)


# What a backend's collectives cost in software when no measured calibration is active (``algo="auto"``'s
# model): a priced step is otherwise only link latency and bytes, which makes every extra step of a Python
# collective look free (on 4 CPU ranks the model then chose two_shot from 16 KiB, 1.6-3.7x slower there than
# direct: benchmarks/results/cpu-suite). Local copies stay unmodelled (no device figures).
SOFTWARE: dict[str, Calibration] = {
    "cpu": Calibration(
        name="estimate-cpu", call_us=20.8, step_us=2.6, message_us=2.3,
        sources={k: "estimate: `xelink bench links` probe on 2 MPI ranks of a 2-core CI host (ecc942b)"
                 for k in ("call_us", "step_us", "message_us")},
        description="software terms of xelink's CPU collectives, not oversubscribed"),
}
_active_calibration: list = [None]
_active_oversubscription: list = [1.0]


def oversubscribed(cal: Calibration, ratio: float) -> Calibration:
    """``cal``'s software terms on a host with ``ratio`` ranks per core (> 1): a step costs ``ratio`` times as
    much and a message ``ratio`` squared (a rank waits for its peers to be scheduled, and each message for both
    of its ends). Fitted to the probe: 4 ranks on 2 cores measured step 5.0 us and message 8.8 us where 2 ranks
    measured 2.6 and 2.3 (``SOFTWARE["cpu"]``), and with them ``algo="auto"`` keeps the one-shot all-reduce
    (one step) up to 256 KiB on 4 ranks and 1 MiB on 8, where it measured 2.4x and 5.7x faster than two_shot
    at 256 KiB (benchmarks/results/cpu-suite/README.md); a measured calibration of the oversubscribed job
    itself (``XELINK_CALIBRATION``) already holds these costs and is left as it is.

    Raises:
        TypeError: ``cal`` is not a ``Calibration``. ValueError: ``ratio`` is not a finite number > 0.
    """
    if not isinstance(cal, Calibration):
        raise TypeError(f"oversubscribed: cal={cal!r} is not a Calibration")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio) or ratio <= 0:
        raise ValueError(f"oversubscribed: ratio={ratio!r} must be a finite number > 0 (ranks per core)")
    if ratio <= 1:
        return cal
    return dataclasses.replace(cal, step_us=cal.step_us * ratio, message_us=cal.message_us * ratio * ratio,
                               description=f"{cal.description}; software terms at {ratio:g} ranks per core")


def active_oversubscription() -> float:
    """Ranks per core on the busiest host of the job (``xelink.init``; 1.0 before it or where every rank has a
    core): what ``algo="auto"`` on CPU ranks scales ``SOFTWARE``'s estimate to (``oversubscribed``)."""
    return _active_oversubscription[0]


def set_active_oversubscription(ratio: float) -> None:
    """Set ``active_oversubscription`` (``xelink.init``, reset by ``finalize``; tests)."""
    if not ratio >= 1.0:
        raise ValueError(f"set_active_oversubscription: ratio={ratio!r} must be >= 1 (ranks per core)")
    _active_oversubscription[0] = float(ratio)


def active_calibration() -> Calibration | None:
    """The measured calibration ``xelink.init`` loaded (``XELINK_CALIBRATION``), or None."""
    return _active_calibration[0]


def set_active_calibration(cal: Calibration | None) -> None:
    """Make ``cal`` the calibration ``algo="auto"`` prices with (``xelink.init``; tests)."""
    _active_calibration[0] = cal


def load_calibration(path: str | os.PathLike, topology: Topology | None = None) -> Calibration:
    """Read a calibration TOML file (``xelink bench probe --calibration PATH`` writes one); with ``topology``,
    a ``[[devices]]`` entry naming a device it does not have is a ValueError (a calibration of another machine)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"load_calibration: calibration file {os.fspath(path)!r} does not exist")
    cal = loads_calibration(p.read_text(encoding="utf-8"), path=str(p), fn="load_calibration")
    return cal if topology is None else _calibration("load_calibration", topology, cal)


def dumps_calibration(cal: Calibration) -> str:
    """The calibration as TOML text that ``loads_calibration`` reads back to an equal ``Calibration``."""
    from .topology import _toml_value

    if not isinstance(cal, Calibration):
        raise TypeError(f"dumps_calibration: cal={cal!r} is not a Calibration")
    lines = [f"name = {_toml_value(cal.name)}"]
    for key in ("description", "topology"):
        if getattr(cal, key):
            lines.append(f"{key} = {_toml_value(getattr(cal, key))}")
    for key in ("call_us", "step_us", "message_us"):
        if key in cal.sources:
            lines += [f"{key} = {_toml_value(float(getattr(cal, key)))}",
                      f"{key[:-3]}_source = {_toml_value(cal.sources[key])}"]

    def local_lines(loc: DeviceLocal, prefix: str, base: DeviceLocal | None) -> list[str]:
        out = []
        for key in ("copy_gbps", "reduce_gbps"):
            value = getattr(loc, key)
            if value is not None and (base is None or value != getattr(base, key) or prefix + key in cal.sources):
                out += [f"{key} = {_toml_value(float(value))}",
                        f"{key[:-5]}_source = {_toml_value(cal.sources.get(prefix + key, 'estimate'))}"]
        return out

    defaults = local_lines(cal.local, "", None)
    if defaults:
        lines += ["", "[device_defaults]", *defaults]
    for did, loc in cal.devices.items():
        lines += ["", "[[devices]]", f"id = {_toml_value(did)}", *local_lines(loc, f"{did}.", cal.local)]
    return "\n".join(lines) + "\n"


def save_calibration(cal: Calibration, path: str | os.PathLike) -> None:
    """Write ``dumps_calibration(cal)`` to ``path``."""
    Path(path).write_text(dumps_calibration(cal), encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Schedules: steps of transfers, with the local work the implementation does around them


@dataclasses.dataclass
class _Phase:
    """One step of the implementation: transfers, and per rank ``[copy bytes, reduced bytes]`` of local
    work done after them (``after``) or while they run, reading peer memory (``fused``, then ``pull``:
    only the reader posts a message per peer)."""

    transfers: list
    after: dict = dataclasses.field(default_factory=dict)
    fused: dict = dataclasses.field(default_factory=dict)
    pull: bool = False


def _chunks(nbytes: int, n: int) -> list[int]:
    q, r = divmod(nbytes, n)
    return [q + (1 if i < r else 0) for i in range(n)]


def _ring_steps(n: int, sizes: Sequence[int], offset: int) -> list[list[Transfer]]:
    """n-1 ring steps; in step s rank r sends chunk (r - s + offset) mod n to rank r+1."""
    return [[Transfer(r, (r + 1) % n, sizes[(r - s + offset) % n]) for r in range(n)] for s in range(n - 1)]


def _landing(group: Sequence[int], index: int) -> int:
    """The rank of ``group`` that receives for a sender (or destination) with local ``index``."""
    return group[index % len(group)]


def _groups(placement: Placement):
    pk = placement.packages()
    where = {}
    for p, g in enumerate(pk):
        for i, r in enumerate(g):
            where[r] = (p, i)
    return pk, where


def _work(copy: Mapping[int, int] | None = None, reduce: Mapping[int, int] | None = None) -> dict:
    """Per-rank ``[copy, reduce]`` bytes from two maps rank -> bytes."""
    out: dict = defaultdict(lambda: [0, 0])
    for r, b in (copy or {}).items():
        out[r][0] += b
    for r, b in (reduce or {}).items():
        out[r][1] += b
    return dict(out)


def _received(step: Iterable[Transfer]) -> dict:
    got: dict = defaultdict(int)
    for t in step:
        got[t.dst] += t.nbytes
    return dict(got)


def _local(copy: Mapping[int, int]) -> _Phase:
    """Local copies outside any step of transfers."""
    return _Phase([], after=_work(copy))


def _reducing(steps: Iterable[list[Transfer]]) -> list[_Phase]:
    """Steps after which every rank reduces what it received (a ring reduce-scatter)."""
    return [_Phase(s, after=_work(reduce=_received(s))) for s in steps]


def _all_reduce(algo, n, nbytes, placement):
    c = _chunks(nbytes, n)
    everyone = {r: nbytes for r in range(n)}
    if algo == "ring":
        return ([_local(everyone)] + _reducing(_ring_steps(n, c, -1))
                + [_Phase(s) for s in _ring_steps(n, c, 0)] + [_local(everyone)])
    if algo == "direct":
        # Copy into the shared buffer, read and sum every peer's (the first read is a copy), copy out.
        step = [Transfer(p, r, nbytes) for r in range(n) for p in range(n) if p != r]
        return [_local(everyone), _Phase(step, fused=_work(everyone, _received(step)), pull=True), _local(everyone)]
    if algo == "two_shot":
        first = [Transfer(p, r, c[r]) for r in range(n) for p in range(n) if p != r]
        # The reducer clones the first part, sums the others, and writes its chunk back.
        return [_Phase(first, after=_work({r: 2 * c[r] for r in range(n)}, _received(first))),
                _Phase([Transfer(r, p, c[r]) for r in range(n) for p in range(n) if p != r])]
    # hierarchical: reduce-scatter inside each package (member i of a package of k keeps chunk i of k),
    # then the holders of each byte in the other packages exchange their package partials (with uneven
    # packages a chunk overlaps several holders elsewhere), then an all-gather inside each package.
    span = _spans(placement, nbytes)
    pk, _ = _groups(placement)
    size = {r: hi - lo for r, (lo, hi) in span.items()}
    inside = [Transfer(m, r, size[r]) for g in pk for r in g for m in g if m != r]
    across = [Transfer(r, s, _overlap(span[r], span[s])) for g in pk for r in g for h in pk if h is not g
              for s in h if _overlap(span[r], span[s])]
    spread = [Transfer(r, m, size[r]) for g in pk for r in g for m in g if m != r]
    return [_Phase(inside, after=_work(size, _received(inside))),
            _Phase(across, after=_work({r: 2 * size[r] for r in range(n)}, _received(across))),
            _Phase(spread, after=_work(size))]


def _spans(placement: Placement, nbytes: int) -> dict:
    """rank -> (lo, hi): the chunk of the buffer a rank holds after a reduce-scatter inside its package."""
    out = {}
    for g in _groups(placement)[0]:
        c = _chunks(nbytes, len(g))
        for i, r in enumerate(g):
            out[r] = (sum(c[:i]), sum(c[:i + 1]))
    return out


def _overlap(a, b) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def _all_gather(algo, n, nbytes, placement):
    c = _chunks(nbytes, n)
    own = _local({r: c[r] for r in range(n)})  # a rank's own shard into the output
    if algo == "ring":
        return [own] + [_Phase(s) for s in _ring_steps(n, c, 0)]
    if algo == "direct":
        return [own, _Phase([Transfer(r, p, c[r]) for r in range(n) for p in range(n) if p != r])]
    pk, where = _groups(placement)
    # Step 1 crosses the fabric only; step 2 replicates inside each package everything a rank holds,
    # its own shard included (as xelink.collectives' topo all-gather does).
    first, held = [], {r: [r] for r in range(n)}
    for r in range(n):
        mine, li = where[r]
        for q, g in enumerate(pk):
            if q != mine:
                land = _landing(g, li)
                first.append(Transfer(r, land, c[r]))
                held[land].append(r)
    second = [Transfer(h, m, c[s]) for h in range(n) for m in pk[where[h][0]] if m != h for s in held[h]]
    return [own, _Phase(first), _Phase(second)]


def _reduce_scatter(algo, n, nbytes, placement):
    c = _chunks(nbytes, n)
    if algo == "ring":
        return ([_local({r: nbytes for r in range(n)})] + _reducing(_ring_steps(n, c, -1))
                + [_local({r: c[r] for r in range(n)})])
    if algo == "dest_split":
        step = [Transfer(p, r, c[r]) for r in range(n) for p in range(n) if p != r]
        return [_Phase(step, after=_work({r: 2 * c[r] for r in range(n)}, _received(step)))]
    pk, where = _groups(placement)
    first, second, clone = [], [], defaultdict(int)
    for d in range(n):
        _, li = where[d]
        for g in pk:
            reducer = _landing(g, li)
            clone[reducer] += c[d]  # the reducer starts from its own block of d
            first += [Transfer(m, reducer, c[d]) for m in g if m != reducer]
            if reducer != d:
                second.append(Transfer(reducer, d, c[d]))
    return [_Phase(first, after=_work(clone, _received(first))),
            _Phase(second, after=_work({r: 2 * c[r] for r in range(n)}, _received(second)))]


def _all_to_all(algo, n, nbytes, placement):
    c = _chunks(nbytes, n)
    own = _local({r: c[r] for r in range(n)})  # a rank's block for itself
    return [own, _Phase([Transfer(r, d, c[d]) for r in range(n) for d in range(n) if d != r])]


def _broadcast(algo, n, nbytes, placement):
    return [_Phase([Transfer(0, r, nbytes) for r in range(1, n)])]


_BUILDERS = {"all_reduce": _all_reduce, "all_gather": _all_gather, "reduce_scatter": _reduce_scatter,
             "all_to_all": _all_to_all, "broadcast": _broadcast}


def _check(fn: str, op, algo, nbytes) -> int:
    if op not in ALGOS:
        raise ValueError(f"{fn}: op={op!r} is not one of {', '.join(OPS)}")
    if algo not in ALGOS[op]:
        raise ValueError(f"{fn}: algo={algo!r} is not an algorithm of op={op!r} (choose from "
                         f"{', '.join(ALGOS[op])})")
    if isinstance(nbytes, bool):
        raise TypeError(f"{fn}: nbytes={nbytes!r} must be an int")
    try:
        nbytes = operator.index(nbytes)
    except TypeError:
        raise TypeError(f"{fn}: nbytes={nbytes!r} must be an int") from None
    if nbytes < 0:
        raise ValueError(f"{fn}: nbytes={nbytes} must be >= 0")
    return nbytes


def _placement(fn: str, topology, placement_or_nranks) -> Placement:
    if not isinstance(topology, Topology):
        raise TypeError(f"{fn}: topology={topology!r} is not a Topology (use topology.load())")
    if isinstance(placement_or_nranks, Placement):
        if placement_or_nranks.topology != topology:
            raise ValueError(f"{fn}: the placement is of topology {placement_or_nranks.topology.name!r}, "
                             f"not {topology.name!r}")
        return placement_or_nranks
    if isinstance(placement_or_nranks, bool) or not isinstance(placement_or_nranks, int):
        raise TypeError(f"{fn}: placement_or_nranks={placement_or_nranks!r} must be a Placement or an int")
    try:
        return place(topology, placement_or_nranks)
    except ValueError as exc:
        raise ValueError(f"{fn}: {exc}") from None


def _calibration(fn: str, topology: Topology, calibration) -> Calibration | None:
    if calibration is None:
        return None
    if not isinstance(calibration, Calibration):
        raise TypeError(f"{fn}: calibration={calibration!r} is not a Calibration (use load_calibration())")
    known = {d.id for d in topology.devices}
    stray = [d for d in calibration.devices if d not in known]
    if stray:
        raise ValueError(f"{fn}: calibration {calibration.name!r} describes device {stray[0]!r}, which topology "
                         f"{topology.name!r} does not have")
    return calibration


def _phases(placement: Placement, op: str, algo: str, nbytes: int) -> list[_Phase]:
    if placement.nranks == 1:
        return []
    phases = _BUILDERS[op](algo, placement.nranks, nbytes, placement)
    for ph in phases:
        ph.transfers = [t for t in ph.transfers if t.nbytes > 0]
    return phases


def schedule(placement: Placement, op: str, algo: str, nbytes: int) -> list[list[Transfer]]:
    """The steps of ``algo`` for ``op`` on ``placement`` (see the module docstring for each algorithm).

    Transfers of 0 bytes and steps without transfers are left out; one rank gives no steps.
    """
    nbytes = _check("schedule", op, algo, nbytes)
    if not isinstance(placement, Placement):
        raise TypeError(f"schedule: placement={placement!r} is not a Placement (use topology.place())")
    return [ph.transfers for ph in _phases(placement, op, algo, nbytes) if ph.transfers]


# ---------------------------------------------------------------------------------------------
# Pricing


def _price_step(topology: Topology, placement: Placement, step: Iterable[Transfer]):
    """(time, bottleneck, alpha of the bottleneck, bytes moved between devices, bytes per channel)."""
    chan: dict = defaultdict(int)
    sent: dict = defaultdict(int)
    recv: dict = defaultdict(int)
    capped: dict = defaultdict(int)
    lat_out: dict = defaultdict(float)
    lat_in: dict = defaultdict(float)
    moved = 0
    for t in step:
        a, b = placement.devices[t.src], placement.devices[t.dst]
        if a == b:
            continue  # ranks sharing a device: a local copy (see _price_phase)
        link, ea, eb = topology.route(a, b)
        chan[(link.name, ea, eb)] += t.nbytes
        sent[a] += t.nbytes
        recv[b] += t.nbytes
        if link.per_device_gbps is not None:
            capped[(link.name, a)] += t.nbytes
        lat_out[a] = max(lat_out[a], link.latency_us)
        lat_in[b] = max(lat_in[b], link.latency_us)
        moved += t.nbytes
    if not moved:
        return 0.0, "", 0.0, 0, {}
    # The first resource of the largest time names the step: channels before device limits, so a
    # tie between a link and the device that alone uses it is reported as the link.
    candidates = []
    for (name, ea, eb), nb in chan.items():
        link = topology.link(name)
        candidates.append((link.latency_us, nb, link.bandwidth_gbps, f"link {name} {ea}->{eb}"))
    for dev, nb in sent.items():
        candidates.append((lat_out[dev], nb, topology.device(dev).egress_gbps, f"injection of {dev}"))
    for dev, nb in recv.items():
        candidates.append((lat_in[dev], nb, topology.device(dev).ingress_gbps, f"ejection of {dev}"))
    for (name, dev), nb in capped.items():
        link = topology.link(name)
        candidates.append((link.latency_us, nb, link.per_device_gbps, f"{name} egress of {dev}"))
    worst, worst_t = None, -1.0
    for alpha, nb, bw, what in candidates:
        t = alpha * 1e-6 + nb / (bw * 1e9)
        if t > worst_t:
            worst, worst_t = (alpha * 1e-6, what), t
    return worst_t, worst[1], worst[0], moved, chan


def _local_time(placement: Placement, cal: Calibration | None, work: Mapping[int, list]) -> tuple[float, str]:
    """The slowest rank's local copies and reductions: (seconds, what)."""
    if cal is None:
        return 0.0, ""
    worst, what = 0.0, ""
    for r, (copy, red) in work.items():
        dev = placement.devices[r]
        loc = cal.device_local(dev)
        t = (copy / (loc.copy_gbps * 1e9) if copy and loc.copy_gbps else 0.0) + \
            (red / (loc.reduce_gbps * 1e9) if red and loc.reduce_gbps else 0.0)
        if t > worst:
            worst, what = t, f"local work of {dev}"
    return worst, what


def _messages(phase: _Phase) -> int:
    posted: dict = defaultdict(int)
    for t in phase.transfers:
        posted[t.dst] += 1
        if not phase.pull:
            posted[t.src] += 1
    return max(posted.values(), default=0)


def _price_phase(topology: Topology, placement: Placement, phase: _Phase, cal: Calibration | None):
    """(StepCost or None, overhead, latency, local seconds on the critical path, blame, channels)."""
    comm_t, what, alpha, moved, chan = _price_step(topology, placement, phase.transfers)
    fused = dict(phase.fused)
    if cal is not None:
        for t in phase.transfers:  # ranks sharing a device copy instead of using a link
            if placement.devices[t.src] == placement.devices[t.dst]:
                fused.setdefault(t.dst, [0, 0])
                fused[t.dst] = [fused[t.dst][0] + t.nbytes, fused[t.dst][1]]
    fused_t, fused_what = _local_time(placement, cal, fused)
    after_t, after_what = _local_time(placement, cal, phase.after)
    overhead = 0.0
    if cal is not None and phase.transfers:
        overhead = (cal.step_us + cal.message_us * _messages(phase)) * 1e-6
    blame: dict = defaultdict(float)
    latency, local = 0.0, after_t
    if fused_t > comm_t:
        blame[fused_what] += fused_t
        local += fused_t
        bottleneck = fused_what
    else:
        if what:
            blame[what] += comm_t
        latency = alpha
        bottleneck = what
    if after_t:
        blame[after_what] += after_t
        bottleneck = bottleneck or after_what
    if overhead:
        blame["software"] += overhead
    total = overhead + max(comm_t, fused_t) + after_t
    if total <= 0:
        return None, 0.0, 0.0, 0.0, {}, {}
    return StepCost(total, bottleneck, moved), overhead, latency, local, blame, chan


def predict(topology: Topology, placement_or_nranks, op: str, algo: str, nbytes: int,
            calibration: Calibration | None = None) -> Prediction:
    """Predict the time and per-link traffic of ``algo`` for ``op`` on ``topology``.

    Args:
        topology: a validated ``Topology``.
        placement_or_nranks: a ``Placement`` of that topology, or a rank count (``place(topology, n)``).
        op: one of ``OPS``; algo: one of ``ALGOS[op]``.
        nbytes: message size in bytes, as nccl-tests counts it (see the module docstring).
        calibration: software and local-memory terms (``load_calibration``); None: links only.

    Returns:
        A ``Prediction``: ``time_s = sum over steps of max over resources (alpha + bytes / bandwidth)``,
        plus the calibration's terms when one is given.

    Raises:
        ValueError: unknown op or algo, negative nbytes, more ranks than the topology can place, a
            calibration that names a device the topology lacks.
        TypeError: arguments of the wrong type.
    """
    nbytes = _check("predict", op, algo, nbytes)
    placement = _placement("predict", topology, placement_or_nranks)
    cal = _calibration("predict", topology, calibration)
    priced = _price_phases(topology, placement, _phases(placement, op, algo, nbytes), cal)
    return priced.prediction(topology, placement, op, algo, nbytes, cal)


@dataclasses.dataclass
class _Priced:
    """A list of phases priced one after the other: what ``Prediction`` reports, and each phase's time."""

    times: list
    steps: list
    traffic: dict
    link_bytes: dict
    blame: dict
    overhead: float = 0.0
    latency: float = 0.0
    local: float = 0.0
    call: float = 0.0  # the calibration's call_us, if the phases communicate

    @property
    def total(self) -> float:
        return self.call + sum(self.times)

    def prediction(self, topology, placement, op, algo, nbytes, cal, time_s=None, compute_s=0.0,
                   extra_blame=None) -> Prediction:
        blame = dict(self.blame)
        for k, v in (extra_blame or {}).items():
            blame[k] = blame.get(k, 0.0) + v
        return Prediction(topology=topology.name, nranks=placement.nranks, op=op, algo=algo, nbytes=nbytes,
                          time_s=self.total if time_s is None else time_s, steps=tuple(self.steps),
                          traffic=dict(self.traffic), link_bytes=dict(self.link_bytes),
                          bottleneck=max(blame, key=blame.get) if blame else "", overhead_s=self.overhead,
                          latency_s=self.latency, local_s=self.local, calibration=None if cal is None else cal.name,
                          compute_s=compute_s)


def _price_phases(topology: Topology, placement: Placement, phases: Iterable[_Phase],
                  cal: Calibration | None) -> _Priced:
    """Price ``phases`` one after the other (``times[i]``: phase i's time, 0 for one that costs nothing)."""
    out = _Priced([], [], defaultdict(int), defaultdict(int), defaultdict(float))
    communicates = False
    for phase in phases:
        cost, o, lat, loc, who, chan = _price_phase(topology, placement, phase, cal)
        out.times.append(0.0 if cost is None else cost.time_s)
        if cost is None:
            continue
        communicates = communicates or bool(phase.transfers)
        out.steps.append(cost)
        out.overhead, out.latency, out.local = out.overhead + o, out.latency + lat, out.local + loc
        for k, v in who.items():
            out.blame[k] += v
        for (name, ea, eb), nb in chan.items():
            out.traffic[f"{name} {ea}->{eb}"] += nb
            out.link_bytes[name] += nb
    if cal is not None and communicates and cal.call_us:
        out.call = cal.call_us * 1e-6
        out.overhead += out.call
        out.blame["software"] += out.call
    return out


def predict_all(topology: Topology, placement_or_nranks, op: str, nbytes: int,
                algos: Sequence[str] | None = None, calibration: Calibration | None = None) -> dict[str, Prediction]:
    """``predict`` for every algorithm of ``op`` (or those in ``algos``), in ``ALGOS[op]`` order."""
    if op not in ALGOS:
        raise ValueError(f"predict_all: op={op!r} is not one of {', '.join(OPS)}")
    if algos is None:
        algos = ALGOS[op]
    elif isinstance(algos, str) or not algos:
        raise ValueError(f"predict_all: algos={algos!r} must be a non-empty list of algorithm names")
    placement = _placement("predict_all", topology, placement_or_nranks)
    return {a: predict(topology, placement, op, a, nbytes, calibration) for a in algos}


def best(topology: Topology, nranks, op: str, nbytes: int, algos: Sequence[str] | None = None,
         calibration: Calibration | None = None) -> str:
    """The algorithm the model predicts fastest for ``op`` at ``nbytes`` (ties: the earlier in ``ALGOS[op]``).

    ``nranks`` may also be a ``Placement``. This is what ``algo="auto"`` consults when no measured
    tuning table covers the case.
    """
    preds = predict_all(topology, nranks, op, nbytes, algos, calibration)
    return min(preds, key=lambda a: preds[a].time_s)


# ---------------------------------------------------------------------------------------------
# Distributed GEMM: a collective and the GEMM it feeds, with or without overlap

DIST_GEMM_ALGOS: dict[str, tuple[str, ...]] = {
    "all_gather_matmul": ("sequential", "pipelined", "topo", "fused"),
    "matmul_reduce_scatter": ("sequential", "pipelined", "topo", "fused"),
    "matmul_all_reduce": ("sequential", "pipelined", "topo", "fused"),
}
DIST_GEMM_OPS = tuple(DIST_GEMM_ALGOS)

# Dense GEMM rate of one device (TFLOP/s, 2*M*N*K flops) by device kind, when ``gemm_tflops`` is not
# given: neither the topology files nor a calibration carry one yet.
GEMM_TFLOPS: dict[str, float] = {"cuda": 766.0, "xpu": 197.5, "cpu": 0.05}
GEMM_TFLOPS_SOURCES: dict[str, str] = {
    "cuda": "measured here: bf16 torch.matmul (cuBLAS) 8192^3 on one H200, 766 TFLOP/s (ANCHORS.md)",
    "xpu": "paper: the oneDNN bf16 4096^3 baseline of one Intel Max stack, 197.5 TFLOP/s (SyclKittens §C.2)",
    "cpu": "estimate: float32 torch.matmul of one CPU rank sharing a few cores, 50 GFLOP/s",
}


def _dist_check(fn: str, op, algo, shape, dtype_bytes, gemm_tflops, collective_algo) -> tuple:
    if op not in DIST_GEMM_ALGOS:
        raise ValueError(f"{fn}: op={op!r} is not one of {', '.join(DIST_GEMM_OPS)}")
    if algo not in DIST_GEMM_ALGOS[op]:
        raise ValueError(f"{fn}: algo={algo!r} is not an algorithm of op={op!r} (choose from "
                         f"{', '.join(DIST_GEMM_ALGOS[op])})")
    dims = []
    for name, v in zip("MNK", shape):
        dims.append(integer(fn, name, v, 1))
    if isinstance(dtype_bytes, bool) or not isinstance(dtype_bytes, int) or dtype_bytes < 1:
        raise ValueError(f"{fn}: dtype_bytes={dtype_bytes!r} must be a positive int")
    if gemm_tflops is not None and (isinstance(gemm_tflops, bool) or not isinstance(gemm_tflops, (int, float))
                                    or not math.isfinite(gemm_tflops) or gemm_tflops <= 0):
        raise ValueError(f"{fn}: gemm_tflops={gemm_tflops!r} must be a positive, finite number")
    if collective_algo is not None and algo != "sequential":
        raise ValueError(f"{fn}: collective_algo={collective_algo!r} applies to algo='sequential' only "
                         f"(pipelined and topo fix their own order)")
    return tuple(dims)


def _target(npk: int, p: int, j: int, i: int) -> int:
    """The remote package that the rank with local index ``i`` of package ``p`` serves in round ``j``
    (1 <= j < npk): every remote package once over the rounds, and the ranks of one package serve
    different packages in the same round, so that they do not share a package-to-package channel."""
    return (p + 1 + (j - 1 + i) % (npk - 1)) % npk


def _gather_rounds(placement: Placement, algo: str, shard: int) -> list[tuple[_Phase, dict]]:
    """The transfer rounds of a pipelined all-gather of one ``shard`` per rank: (phase, rank -> shards
    delivered to it by that phase).

    ``pipelined``: the ring, one shard per rank per step. ``topo``: round 0 sends each rank's shard to
    the rest of its package and across to one remote package (to its rank with the sender's local
    index, as ``all_gather topo``); round j copies inside each package what landed in round j-1 and
    crosses to the next remote package (``_target``); the last round copies the last landings inside
    the package. XeLink and MDFI work in the same round.
    """
    n = placement.nranks
    if algo == "pipelined":
        steps = _ring_steps(n, [shard] * n, 0)
    else:
        pk, where = _groups(placement)
        npk = len(pk)
        cross = [[Transfer(r, _landing(pk[_target(npk, where[r][0], j, where[r][1])], where[r][1]), shard)
                  for r in range(n)] for j in range(1, npk)]
        steps = [[Transfer(r, m, shard) for r in range(n) for m in pk[where[r][0]] if m != r]
                 + (cross[0] if cross else [])]
        for j, landed in enumerate(cross):
            spread = [Transfer(t.dst, m, shard) for t in landed for m in pk[where[t.dst][0]] if m != t.dst]
            steps.append(spread + (cross[j + 1] if j + 1 < len(cross) else []))
    return [(_Phase(s), _count(t.dst for t in s)) for s in steps]


def _scatter_rounds(placement: Placement, algo: str, block: int) -> list[tuple[_Phase, dict]]:
    """The rounds of a pipelined reduce-scatter of one ``block`` per destination: (phase, rank -> blocks
    it must have computed before the phase starts). Each receiver sums what it receives.

    ``pipelined``: the ring reduce-scatter; step s sends the (s+1)-th block computed. ``topo``: in round
    j the rank with local index i of each package sums inside the package the blocks of the remote
    package it serves (``_target``) whose destination has its local index (as ``reduce_scatter
    hierarchical``), and sends the partial of round j-1 across to its destination; the last round
    sends the own package's blocks straight to their owners. A rank computes the blocks in the order
    the rounds need them, its own last.
    """
    n = placement.nranks
    if algo == "pipelined":
        return [(_Phase(s, after=_work(reduce=_received(s))), {r: i + 1 for r in range(n)})
                for i, s in enumerate(_ring_steps(n, [block] * n, -1))]
    pk, where = _groups(placement)
    npk = len(pk)
    inside, cross, need = [], [], []
    done = {r: 0 for r in range(n)}
    for j in range(1, npk):
        ins, crs = [], []
        for p, g in enumerate(pk):
            for i, reducer in enumerate(g):
                for d in pk[_target(npk, p, j, i)]:
                    if _landing(g, where[d][1]) == reducer:
                        ins += [Transfer(m, reducer, block) for m in g if m != reducer]
                        crs.append(Transfer(reducer, d, block))
                        for m in g:
                            done[m] += 1
        inside.append(ins)
        cross.append(crs)
        need.append(dict(done))
    inside.append([Transfer(m, d, block) for g in pk for d in g for m in g if m != d])
    need.append({r: n - 1 for r in range(n)})
    steps = [ins + (cross[j - 1] if j else []) for j, ins in enumerate(inside)]
    return [(_Phase(s, after=_work(reduce=_received(s))), nd) for s, nd in zip(steps, need)]


def _count(ranks: Iterable[int]) -> dict:
    out: dict = defaultdict(int)
    for r in ranks:
        out[r] += 1
    return dict(out)


def predict_dist_gemm(topology: Topology, placement_or_nranks, op: str, algo: str, M: int, N: int, K: int,
                      dtype_bytes: int = 2, calibration: Calibration | None = None,
                      gemm_tflops: float | None = None, collective_algo: str | None = None) -> Prediction:
    """Predict a distributed GEMM: its collective's transfers, the GEMM, and how much of one hides the other.

    Shapes (c = a @ b, ``[M, K] @ [K, N]``, ``n`` ranks; M must be divisible by n):
      - ``all_gather_matmul``: every rank holds ``M/n`` rows of a; the gather moves ``M*K`` elements
        (output bytes per rank, as ``predict`` counts an all-gather) and every rank computes all of c.
      - ``matmul_reduce_scatter``: every rank computes its ``[M, N]`` partial and keeps ``M/n`` rows of
        the sum (``M*N`` elements in, per rank).
      - ``matmul_all_reduce``: the same GEMM, and the sum of the ``[M, N]`` partials on every rank.

    The GEMM runs at ``gemm_tflops`` (default ``GEMM_TFLOPS[device kind]``), divided among the ranks that
    share a device, and at the same rate on any block of rows (small blocks are not penalised). Chunks
    are one rank's shard (``M/n`` rows); the collective's phases are priced as ``predict`` prices them
    (links, and a calibration's software and local terms), and the GEMM is assumed not to slow the
    transfers down (no contention for memory or compute units).

    Algorithms:
      - ``sequential``: the collective (``collective_algo``, default the one ``best`` picks), then the
        GEMM (``matmul_*``: the GEMM, then the collective): ``T = T_collective + T_gemm``.
      - ``pipelined`` (ring order) and ``topo`` (topology-aware order: the package, then one crossing
        per remote package and the copy inside it): a max-plus pipeline over chunks. For
        ``all_gather_matmul`` the rounds run back to back and the GEMM of chunk i starts when it has
        arrived and the GEMM of chunk i-1 is done (the own shard first, at time 0). For
        ``matmul_reduce_scatter`` the GEMM computes the blocks in the order they are sent and a round
        starts when the previous one is done and its blocks are computed; the own block is computed
        last. ``matmul_all_reduce`` is that reduce-scatter followed by an all-gather of the result (ring
        for ``pipelined``, ``topo`` for ``topo``), which has nothing left to hide behind.
      - ``fused`` (``all_gather_matmul``): one GEMM kernel whose tiles start as their shard lands; the
        model has no per-launch cost, so it is the pipeline above over the rounds of ``topo`` where a
        package holds several ranks, else of ``pipelined`` (the order ``xelink.dist`` reads in).
        ``matmul_reduce_scatter``: one GEMM kernel whose tiles go to their owner as they finish, in
        ``pipelined``'s order (the next rank first, the own block last: what ``xelink.dist`` runs on any
        topology), priced as that pipeline; ``matmul_all_reduce``: that, then the ring all-gather.

    Returns:
        A ``Prediction``: ``time_s``, ``compute_s`` (the slowest rank's whole GEMM), the collective's
        steps and traffic; ``nbytes`` is the collective's size. Bottleneck ``"GEMM"`` when the GEMM
        takes more time than the communication left exposed.

    Raises:
        ValueError: unknown op or algo, dimensions below 1 or M not divisible by the rank count, bad
            ``dtype_bytes`` / ``gemm_tflops``, ``collective_algo`` with an algo other than sequential or
            not an algorithm of the collective, a placement the topology cannot make.
        TypeError: arguments of the wrong type.
    """
    fn = "predict_dist_gemm"
    M, N, K = _dist_check(fn, op, algo, (M, N, K), dtype_bytes, gemm_tflops, collective_algo)
    placement = _placement(fn, topology, placement_or_nranks)
    cal = _calibration(fn, topology, calibration)
    n = placement.nranks
    if M % n:
        raise ValueError(f"{fn}: M={M} is not divisible by the {n} rank(s)")
    share = _count(placement.devices)
    gemm = {r: 2.0 * M * N * K / ((gemm_tflops or GEMM_TFLOPS[placement.device(r).kind]) * 1e12
                                  / share[placement.devices[r]]) for r in range(n)}
    compute = max(gemm.values())
    coll = "all_gather" if op == "all_gather_matmul" else "reduce_scatter" if op == "matmul_reduce_scatter" \
        else "all_reduce"
    nbytes = (M * K if coll == "all_gather" else M * N) * dtype_bytes
    if algo == "sequential" or n == 1:
        calgo = collective_algo or best(topology, placement, coll, nbytes, calibration=cal)
        if calgo not in ALGOS[coll]:
            raise ValueError(f"{fn}: collective_algo={calgo!r} is not an algorithm of {coll} (choose from "
                             f"{', '.join(ALGOS[coll])})")
        priced = _price_phases(topology, placement, _phases(placement, coll, calgo, nbytes), cal)
        total = priced.total + compute
        return priced.prediction(topology, placement, op, algo, nbytes, cal, total, compute,
                                 {"GEMM": compute})
    chunk = {r: g / n for r, g in gemm.items()}  # the GEMM of one rank's rows
    if coll == "all_gather":
        # fused: one GEMM kernel whose tiles start as their shard lands, priced as the chunks of the
        # schedule it reads in (topo's where a package holds several ranks, as xelink.dist.device does)
        sched = algo if algo != "fused" else \
            "topo" if len(placement.packages()) > 1 and max(map(len, placement.packages())) > 1 else "pipelined"
        rounds = _gather_rounds(placement, sched, nbytes // n)
        priced = _price_phases(topology, placement, [ph for ph, _ in rounds], cal)
        arrive = {r: [priced.call] for r in range(n)}  # the own shard, once the call has started
        end = priced.call
        for t, (_, got) in zip(priced.times, rounds):
            end += t
            for r, k in got.items():
                arrive[r] += [end] * k
        total = 0.0
        for r, times in arrive.items():
            f = 0.0
            for a in times:
                f = max(f, a) + chunk[r]
            total = max(total, f)
    else:
        # fused: the tiles go out in pipelined's owner order, whatever the topology (xelink.dist.device)
        rounds = _scatter_rounds(placement, "pipelined" if algo == "fused" else algo, nbytes // n)
        priced = _price_phases(topology, placement, [ph for ph, _ in rounds], cal)
        end = priced.call
        for t, (_, need) in zip(priced.times, rounds):
            end = max(end, max(k * chunk[r] for r, k in need.items())) + t
        total = max(end, compute)
        if coll == "all_reduce":
            ag = _price_phases(topology, placement,
                               _phases(placement, "all_gather", "topo" if algo == "topo" else "ring", nbytes),
                               cal)
            total += ag.total
            for k in ("steps", "times"):
                getattr(priced, k).extend(getattr(ag, k))
            for k in ("traffic", "link_bytes", "blame"):
                for key, v in getattr(ag, k).items():
                    getattr(priced, k)[key] += v
            priced.overhead, priced.latency, priced.local = (priced.overhead + ag.overhead,
                                                             priced.latency + ag.latency, priced.local + ag.local)
    # Blame: the GEMM, and the communication it left exposed, split as the collective's blame is.
    exposed = max(0.0, total - compute)
    comm = sum(priced.blame.values())
    blame = {k: v * exposed / comm for k, v in priced.blame.items()} if comm > 0 else {}
    blame["GEMM"] = compute
    priced.blame = defaultdict(float, blame)
    return priced.prediction(topology, placement, op, algo, nbytes, cal, total, compute)


# Attention rate of one device (TFLOP/s, 4*D flops per visible (query, key) pair) by device kind, when
# ``attn_tflops`` is not given.
ATTN_TFLOPS: dict[str, float] = {"cuda": 623.0, "xpu": 118.5, "cpu": 0.02}
ATTN_TFLOPS_SOURCES: dict[str, str] = {
    "cuda": "measured here: xelink flash_attention impl='cuda', bf16 B=1 H=32 S=8192 HD=128 non-causal, one H200, "
            "623 TFLOP/s (benchmarks/results/h200-issue20/bench_attention.log)",
    "xpu": "estimate: 0.6 of the GEMM rate of one Intel Max stack (GEMM_TFLOPS['xpu']); no measured attention rate",
    "cpu": "estimate: float32 reference attention of one CPU rank sharing a few cores, 20 GFLOP/s",
}
CP_ATTENTION_ALGOS = ("ring", "all_gather")


def _visible(qs: int, qe: int, ks: int, ke: int, causal: bool) -> int:
    """(query, key) pairs of queries ``[qs, qe)`` and keys ``[ks, ke)`` that attend (causal: key <= query)."""
    nq, nk = max(0, qe - qs), max(0, ke - ks)
    if not causal or not nq or not nk:
        return nq * nk
    # Query q sees clamp(q + 1 - ks, 0, nk) keys; sum over x = q + 1 in [qs + 1, qe].
    lo, hi = qs + 1, qe
    total = 0
    a, b = max(lo, ks + 1), min(hi, ke - 1)  # the rising part: x - ks
    if a <= b:
        total += (a - ks + b - ks) * (b - a + 1) // 2
    a = max(lo, ke)  # the flat part: all nk keys
    if a <= hi:
        total += nk * (hi - a + 1)
    return total


def predict_cp_attention(topology: Topology, placement_or_nranks, algo: str, *, seq_len: int, batch: int = 1,
                         heads: int = 32, kv_heads: int | None = None, head_dim: int = 128, causal: bool = False,
                         layout: str = "zigzag", dtype_bytes: int = 2, calibration: Calibration | None = None,
                         attn_tflops: float | None = None) -> Prediction:
    """Predict ``xelink.cp_attention`` of one sequence of ``seq_len`` positions split over the ranks.

    Work: each rank's queries against every rank's keys, counted exactly for the layout (``cp_pieces``) and
    the causal mask (visible pairs, 4 * head_dim flops each, at ``attn_tflops`` or ``ATTN_TFLOPS`` of the
    device kind, divided among ranks that share a device). Traffic: every rank's K and V (``kv_heads``).

      - ``ring`` (the ranks in ``topo_ring`` order, packages contiguous): n steps; at step s every rank
        attends to the block it holds while passing it on to the next rank (no transfer after the last
        step). A block is passed on as soon as it lands, so the s-th block reaches a rank after s
        transfers (each priced as one step of all ranks' transfers); a rank attends to it once it has
        landed and the previous block is done.
      - ``all_gather``: every rank's KV, padded to the longest local length, gathered (the algorithm
        ``best`` picks) while each rank attends to its own block; then the other blocks.

    The merges of partial results and the local copies are not priced (their bytes are a fraction of the
    attention's); the attention is assumed not to slow the transfers down.

    Returns:
        A ``Prediction`` (``op`` "cp_attention"; ``nbytes``: the KV bytes of the whole sequence;
        ``compute_s``: the slowest rank's attention; bottleneck "attention" when it exceeds the exposed
        communication).

    Raises:
        ValueError: an unknown algo or layout, sizes below 1, heads not a multiple of kv_heads, a bad rate
            or dtype size, a placement the topology cannot make.
    """
    fn = "predict_cp_attention"

    if algo not in CP_ATTENTION_ALGOS:
        raise ValueError(f"{fn}: algo={algo!r} is not one of {', '.join(CP_ATTENTION_ALGOS)}")
    if layout not in CP_LAYOUTS:
        raise ValueError(f"{fn}: layout={layout!r} is not one of {', '.join(CP_LAYOUTS)}")
    kv_heads = heads if kv_heads is None else kv_heads
    for name, v in (("seq_len", seq_len), ("batch", batch), ("heads", heads), ("kv_heads", kv_heads),
                    ("head_dim", head_dim), ("dtype_bytes", dtype_bytes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{fn}: {name}={v!r} must be an int >= 1")
    if heads % kv_heads:
        raise ValueError(f"{fn}: heads={heads} is not a multiple of kv_heads={kv_heads}")
    if attn_tflops is not None and not (isinstance(attn_tflops, (int, float)) and attn_tflops > 0):
        raise ValueError(f"{fn}: attn_tflops={attn_tflops!r} must be > 0")
    placement = _placement(fn, topology, placement_or_nranks)
    cal = _calibration(fn, topology, calibration)
    n = placement.nranks
    pieces = [cp_pieces(seq_len, n, layout, r) for r in range(n)]
    share = _count(placement.devices)
    rate = {r: (attn_tflops or ATTN_TFLOPS[placement.device(r).kind]) * 1e12 / share[placement.devices[r]]
            for r in range(n)}

    def attend(r: int, owner: int) -> float:
        pairs = sum(_visible(qs, qs + ql, ks, ks + kl, causal) for qs, ql in pieces[r] for ks, kl in pieces[owner])
        return 4.0 * batch * heads * head_dim * pairs / rate[r]

    per_pos = 2 * batch * kv_heads * head_dim * dtype_bytes  # K and V bytes of one position
    kv = {r: per_pos * sum(length for _, length in pieces[r]) for r in range(n)}
    compute = max(sum(attend(r, o) for o in range(n)) for r in range(n))
    if algo == "ring":
        ring = topo_ring(placement.packages())
        where = {r: i for i, r in enumerate(ring)}
        held = [{r: ring[(where[r] - s) % n] for r in range(n)} for s in range(n)]  # whose block r has at step s
        phases = [_Phase([Transfer(r, ring[(where[r] + 1) % n], kv[held[s][r]]) for r in range(n)])
                  for s in range(n - 1)]
        priced = _price_phases(topology, placement, phases, cal)
        # A block moves on as soon as it lands (the sender holds it from then), so step s's block reaches
        # every rank after the first s transfers; a rank starts a step once the block is there and its
        # previous step is done.
        total = 0.0
        for r in range(n):
            landed = done = priced.call
            for s in range(n):
                if s:
                    landed += priced.times[s - 1]
                done = max(done, landed) + attend(r, held[s][r])
            total = max(total, done)
    else:
        nbytes = per_pos * max(sum(length for _, length in p) for p in pieces) * n
        galgo = best(topology, placement, "all_gather", nbytes, calibration=cal)
        priced = _price_phases(topology, placement, _phases(placement, "all_gather", galgo, nbytes), cal)
        total = max(max(priced.total, attend(r, r)) + sum(attend(r, o) for o in range(n) if o != r)
                    for r in range(n))
    exposed = max(0.0, total - compute)
    comm = sum(priced.blame.values())
    blame = {k: v * exposed / comm for k, v in priced.blame.items()} if comm > 0 else {}
    blame["attention"] = compute
    priced.blame = defaultdict(float, blame)
    return priced.prediction(topology, placement, "cp_attention", algo, per_pos * seq_len, cal, total, compute)


# ---------------------------------------------------------------------------------------------
# Reporting

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """``"24K"``, ``"96MiB"``, ``"1G"``, ``"4096"`` -> bytes (binary units: K = 1024)."""
    s = str(text).strip().upper()
    digits = s.rstrip("KMGIB")
    unit = s[len(digits):]
    if not digits.isdigit() or unit not in _UNITS:
        raise ValueError(f"parse_size: {text!r} is not a size such as 4096, 24K, 96MiB or 1G")
    return int(digits) * _UNITS[unit]


def _fmt_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _fmt_time(t: float) -> str:
    if t >= 1.0:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.4g} ms"
    return f"{t * 1e6:.4g} us"


_SIZE_MEANING = {"all_reduce": "buffer bytes per rank", "broadcast": "buffer bytes per rank",
                 "all_to_all": "buffer bytes per rank", "all_gather": "output bytes per rank",
                 "reduce_scatter": "input bytes per rank"}


def table(topology: Topology, placement_or_nranks, op: str, sizes: Sequence[int],
          algos: Sequence[str] | None = None, calibration: Calibration | None = None) -> str:
    """Predicted time of every algorithm at every size, with the ratio ring time / algorithm time.

    A ratio above 1 means the model predicts the algorithm faster than the ring (for an op without a
    ring, than its first algorithm).
    """
    placement = _placement("table", topology, placement_or_nranks)
    if op not in ALGOS:
        raise ValueError(f"table: op={op!r} is not one of {', '.join(OPS)}")
    algos = list(ALGOS[op] if algos is None else algos)
    ref = "ring" if "ring" in ALGOS[op] else ALGOS[op][0]
    npk = len(placement.packages())
    lines = [f"{op} on {topology.name}: {placement.nranks} rank(s) in {npk} package(s); size = "
             f"{_SIZE_MEANING[op]}; ratio = {ref} time / time (> 1: faster than {ref})"
             + (f"; calibration {calibration.name}" if calibration is not None else "")]
    rows = [["size"] + [f"{a}" for a in algos] + ["best"]]
    for n in sizes:
        preds = predict_all(topology, placement, op, n, algos, calibration)
        base = predict(topology, placement, op, ref, n, calibration).time_s
        row = [_fmt_size(n)]
        for a in algos:
            t = preds[a].time_s
            ratio = f"{base / t:.2f}x" if t > 0 else "-"
            row.append(f"{_fmt_time(t)} {ratio}")
        row.append(min(preds, key=lambda a: preds[a].time_s))
        rows.append(row)
    return "\n".join(lines + _aligned(rows))


def _aligned(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]


def parse_shape(text: str) -> tuple[int, int, int]:
    """``"8192"`` (a cube) or ``"16384x8192x4096"`` (M x N x K) -> (M, N, K)."""
    parts = str(text).lower().split("x")
    if len(parts) not in (1, 3) or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"parse_shape: {text!r} is not a shape such as 8192 or 16384x8192x4096 (M x N x K)")
    dims = [int(p) for p in parts]
    return tuple(dims * 3 if len(dims) == 1 else dims)


def cp_attention_table(topology: Topology, placement_or_nranks, seq_lens: Sequence[int], *, heads: int = 32,
                       kv_heads: int | None = None, head_dim: int = 128, causal: bool = False,
                       layout: str = "zigzag", dtype_bytes: int = 2, calibration: Calibration | None = None,
                       attn_tflops: float | None = None) -> str:
    """Predicted time of both context-parallel attention algorithms per sequence length (one sequence), with
    the share of attention-alone speed (the slowest rank's attention / the op's time: 100% when the
    transfers are hidden)."""
    placement = _placement("cp_attention_table", topology, placement_or_nranks)
    kinds = sorted({placement.device(r).kind for r in range(placement.nranks)})
    rate = f"{attn_tflops:g}" if attn_tflops else "/".join(f"{ATTN_TFLOPS[k]:g}" for k in kinds)
    lines = [f"cp_attention on {topology.name}: {placement.nranks} rank(s) in {len(placement.packages())} "
             f"package(s); {heads} heads ({kv_heads or heads} KV), head dim {head_dim}, "
             f"{'causal' if causal else 'non-causal'}, {layout}, {dtype_bytes}-byte elements, attention at {rate} "
             f"TFLOP/s a device; % = attention alone / time"
             + (f"; calibration {calibration.name}" if calibration is not None else "")]
    rows = [["positions", "attention alone", *CP_ATTENTION_ALGOS, "best"]]
    for S in seq_lens:
        preds = {a: predict_cp_attention(topology, placement, a, seq_len=S, heads=heads, kv_heads=kv_heads,
                                         head_dim=head_dim, causal=causal, layout=layout, dtype_bytes=dtype_bytes,
                                         calibration=calibration, attn_tflops=attn_tflops)
                 for a in CP_ATTENTION_ALGOS}
        alone = preds["ring"].compute_s
        rows.append([str(S), _fmt_time(alone)]
                    + [f"{_fmt_time(p.time_s)} {100 * alone / p.time_s:.0f}%" for p in preds.values()]
                    + [min(preds, key=lambda a: preds[a].time_s)])
    return "\n".join(lines + _aligned(rows))


def dist_gemm_table(topology: Topology, placement_or_nranks, op: str, shapes: Sequence[tuple[int, int, int]],
                    dtype_bytes: int = 2, calibration: Calibration | None = None,
                    gemm_tflops: float | None = None) -> str:
    """Predicted time of every algorithm of a distributed GEMM op per (M, N, K), with the share of
    GEMM-alone speed (the slowest rank's GEMM time / the op's time: 100% when the collective is hidden)."""
    placement = _placement("dist_gemm_table", topology, placement_or_nranks)
    if op not in DIST_GEMM_ALGOS:
        raise ValueError(f"dist_gemm_table: op={op!r} is not one of {', '.join(DIST_GEMM_OPS)}")
    algos = DIST_GEMM_ALGOS[op]
    kinds = sorted({placement.device(r).kind for r in range(placement.nranks)})
    rate = f"{gemm_tflops:g}" if gemm_tflops else "/".join(f"{GEMM_TFLOPS[k]:g}" for k in kinds)
    lines = [f"{op} on {topology.name}: {placement.nranks} rank(s) in {len(placement.packages())} package(s); "
             f"shape M x N x K, {dtype_bytes}-byte elements, GEMM at {rate} TFLOP/s a device; "
             f"% = GEMM alone / time" + (f"; calibration {calibration.name}" if calibration is not None else "")]
    rows = [["shape", "GEMM alone", *algos, "best"]]
    for M, N, K in shapes:
        preds = {a: predict_dist_gemm(topology, placement, op, a, M, N, K, dtype_bytes, calibration, gemm_tflops)
                 for a in algos}
        gemm = preds[algos[0]].compute_s
        rows.append([f"{M}x{N}x{K}", _fmt_time(gemm)]
                    + [f"{_fmt_time(p.time_s)} {100 * gemm / p.time_s:.0f}%" for p in preds.values()]
                    + [min(preds, key=lambda a: preds[a].time_s)])
    return "\n".join(lines + _aligned(rows))

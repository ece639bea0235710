"""An alpha-beta model of collective algorithms on a topology: predicted time and per-link traffic.

An algorithm is a *schedule*: a list of steps, each a set of transfers ``(src rank, dst rank, bytes)``
that run at the same time; a step starts when the previous one has finished (the steps of a real
implementation are separated by a barrier or flag wait). ``schedule`` builds it, ``predict`` prices it.

**Price of one step.** Each transfer from device a to device b takes the link ``topology.route(a, b)``
chooses, on the channel ``(link, a', b')`` (a', b' are a and b, or their packages or hosts, for links that
join packages or hosts). Transfers between ranks of the same device are local copies and cost nothing
here. The transfers of a step load four kinds of resource:

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
microseconds. Reductions are assumed free (the model is about moving bytes), and a step that moves no
bytes costs nothing, so a size-0 collective or a world of one rank is predicted to take 0 s.

**Sizes.** ``nbytes`` follows nccl-tests: the buffer of each rank for all_reduce, broadcast and
all_to_all (which sends ``nbytes / n`` to each rank); the *output* of each rank for all_gather
(each rank contributes ``nbytes / n``); the *input* of each rank for reduce_scatter (each rank keeps
``nbytes / n``). Chunk i of a buffer split n ways has ``nbytes // n`` bytes, plus one for i < nbytes % n.

**Algorithms** (n ranks, P packages, rank order = placement order; see ``schedule`` for each):

======================  ===================================================================================
all_reduce ring         reduce-scatter ring then all-gather ring: 2(n-1) steps of one chunk per rank
all_reduce direct       one-shot: one step, every rank reads the whole buffer of every peer
all_reduce two_shot     direct reduce-scatter (each rank reads its chunk from every peer), then direct all-gather
all_reduce hierarchical reduce to each package's first rank, ring all-reduce among those leaders, broadcast back
all_gather ring         n-1 steps, each rank forwards one shard to the next
all_gather direct       one step, each rank writes its shard to every peer
all_gather topo         each shard goes to the rest of its package and to *one* rank of every remote package
                        (the one with the sender's local index, modulo that package's size), then each
                        landing rank copies what it received to the rest of its package
reduce_scatter ring     n-1 steps, each rank forwards one partial chunk to the next
reduce_scatter          one step, every rank sends each destination its block (the destination reduces)
  dest_split
reduce_scatter          chunk d is first reduced inside each package on the rank with d's local index
  hierarchical          (modulo package size), which then sends that package partial to d: every chunk
                        crosses the fabric once per remote package
all_to_all ring         n-1 steps; in step k rank r sends its block for rank r+k directly (pairwise exchange)
all_to_all dest_split   one step, every block straight to its destination
all_to_all hierarchical blocks for a remote rank d go first to the package member with d's local index,
                        which forwards them all at once: cross-package traffic only between equal indices
broadcast ring          pipelined chain from rank 0 in n chunks: 2n-2 steps of one chunk per hop
broadcast direct        one step, the root writes the buffer to every rank
broadcast two_shot      the root scatters chunks, then every rank writes its chunk to every other
broadcast topo          the root writes to its package and to one rank of every remote package, which
                        then write to their packages
======================  ===================================================================================

The names are those of ``xelink.collectives`` (``algo=``), so ``best`` can choose among the algorithms a
collective implements; ``dest_split`` is the one-step push to each destination, as the Intel reference
names it. ``best`` picks the fastest algorithm; it is what ``algo="auto"`` consults when no measured
tuning table exists.
"""
from __future__ import annotations

import dataclasses
import operator
from collections import defaultdict
from typing import Iterable, Sequence

from .topology import Placement, Topology, place

__all__ = [
    "OPS",
    "ALGOS",
    "Transfer",
    "StepCost",
    "Prediction",
    "schedule",
    "predict",
    "predict_all",
    "best",
    "parse_size",
    "table",
]

ALGOS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("ring", "direct", "two_shot", "hierarchical"),
    "all_gather": ("ring", "direct", "topo"),
    "reduce_scatter": ("ring", "dest_split", "hierarchical"),
    "all_to_all": ("ring", "dest_split", "hierarchical"),
    "broadcast": ("ring", "direct", "two_shot", "topo"),
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
        time_s: predicted time in seconds (sum of the steps).
        steps: each step's time, bottleneck and bytes.
        traffic: bytes per directed channel, ``"<link> <a>-><b>"`` (a, b: the endpoints the link joins).
        link_bytes: bytes per link (all its channels, both directions).
        bottleneck: the resource that set the most predicted time over all steps.
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

    @property
    def algbw_gbps(self) -> float:
        """nccl-tests algorithm bandwidth, nbytes / time, in GB/s (0 when the time is 0)."""
        return self.nbytes / self.time_s / 1e9 if self.time_s > 0 else 0.0


# ---------------------------------------------------------------------------------------------
# Schedules


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


def _all_reduce(algo, n, nbytes, placement):
    c = _chunks(nbytes, n)
    if algo == "ring":
        return _ring_steps(n, c, -1) + _ring_steps(n, c, 0)
    if algo == "direct":
        return [[Transfer(p, r, nbytes) for r in range(n) for p in range(n) if p != r]]
    if algo == "two_shot":
        return [[Transfer(p, r, c[r]) for r in range(n) for p in range(n) if p != r],
                [Transfer(r, p, c[r]) for r in range(n) for p in range(n) if p != r]]
    pk, _ = _groups(placement)
    leaders = [g[0] for g in pk]
    cross = _chunks(nbytes, len(leaders))
    steps = [[Transfer(m, g[0], nbytes) for g in pk for m in g[1:]]]
    for ring in (_ring_steps(len(leaders), cross, -1), _ring_steps(len(leaders), cross, 0)):
        steps += [[Transfer(leaders[t.src], leaders[t.dst], t.nbytes) for t in step] for step in ring]
    steps.append([Transfer(g[0], m, nbytes) for g in pk for m in g[1:]])
    return steps


def _all_gather(algo, n, nbytes, placement):
    c = _chunks(nbytes, n)
    if algo == "ring":
        return _ring_steps(n, c, 0)
    if algo == "direct":
        return [[Transfer(r, p, c[r]) for r in range(n) for p in range(n) if p != r]]
    pk, where = _groups(placement)
    first, second = [], []
    for r in range(n):
        mine, li = where[r]
        first += [Transfer(r, m, c[r]) for m in pk[mine] if m != r]
        for q, g in enumerate(pk):
            if q == mine:
                continue
            land = _landing(g, li)
            first.append(Transfer(r, land, c[r]))
            second += [Transfer(land, m, c[r]) for m in g if m != land]
    return [first, second]


def _reduce_scatter(algo, n, nbytes, placement):
    c = _chunks(nbytes, n)
    if algo == "ring":
        return _ring_steps(n, c, -1)
    if algo == "dest_split":
        return [[Transfer(p, r, c[r]) for r in range(n) for p in range(n) if p != r]]
    pk, where = _groups(placement)
    first, second = [], []
    for d in range(n):
        _, li = where[d]
        for g in pk:
            reducer = _landing(g, li)
            first += [Transfer(m, reducer, c[d]) for m in g if m != reducer]
            if reducer != d:
                second.append(Transfer(reducer, d, c[d]))
    return [first, second]


def _all_to_all(algo, n, nbytes, placement):
    c = _chunks(nbytes, n)
    if algo == "ring":
        return [[Transfer(r, (r + k) % n, c[(r + k) % n]) for r in range(n)] for k in range(1, n)]
    if algo == "dest_split":
        return [[Transfer(r, d, c[d]) for r in range(n) for d in range(n) if d != r]]
    pk, where = _groups(placement)
    first, second = [], []
    for d in range(n):
        dp, li = where[d]
        for q, g in enumerate(pk):
            if q == dp:
                first += [Transfer(m, d, c[d]) for m in g if m != d]
                continue
            relay = _landing(g, li)
            first += [Transfer(m, relay, c[d]) for m in g if m != relay]
            second.append(Transfer(relay, d, len(g) * c[d]))
    return [first, second]


def _broadcast(algo, n, nbytes, placement):
    c = _chunks(nbytes, n)
    if algo == "direct":
        return [[Transfer(0, r, nbytes) for r in range(1, n)]]
    if algo == "ring":
        return [[Transfer(h, h + 1, c[t - h]) for h in range(n - 1) if 0 <= t - h < n] for t in range(2 * n - 2)]
    if algo == "two_shot":
        return [[Transfer(0, r, c[r]) for r in range(1, n)],
                [Transfer(r, p, c[r]) for r in range(1, n) for p in range(1, n) if p != r]]
    pk, where = _groups(placement)
    mine, li = where[0]
    first, second = [Transfer(0, m, nbytes) for m in pk[mine] if m != 0], []
    for q, g in enumerate(pk):
        if q != mine:
            land = _landing(g, li)
            first.append(Transfer(0, land, nbytes))
            second += [Transfer(land, m, nbytes) for m in g if m != land]
    return [first, second]


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


def schedule(placement: Placement, op: str, algo: str, nbytes: int) -> list[list[Transfer]]:
    """The steps of ``algo`` for ``op`` on ``placement`` (see the module docstring for each algorithm).

    Transfers of 0 bytes and steps without transfers are left out; one rank gives no steps.
    """
    nbytes = _check("schedule", op, algo, nbytes)
    if not isinstance(placement, Placement):
        raise TypeError(f"schedule: placement={placement!r} is not a Placement (use topology.place())")
    n = placement.nranks
    if n == 1:
        return []
    steps = _BUILDERS[op](algo, n, nbytes, placement)
    steps = [[t for t in step if t.nbytes > 0] for step in steps]
    return [s for s in steps if s]


# ---------------------------------------------------------------------------------------------
# Pricing


def _price_step(topology: Topology, placement: Placement, step: Iterable[Transfer]):
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
            continue  # ranks sharing a device: a local copy, outside this model
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
        return 0.0, "", 0, {}
    # The first resource of the largest time names the step: channels before device limits, so a
    # tie between a link and the device that alone uses it is reported as the link.
    candidates = []
    for (name, ea, eb), nb in chan.items():
        link = topology.link(name)
        candidates.append((link.latency_us * 1e-6 + nb / (link.bandwidth_gbps * 1e9), f"link {name} {ea}->{eb}"))
    for dev, nb in sent.items():
        d = topology.device(dev)
        candidates.append((lat_out[dev] * 1e-6 + nb / (d.egress_gbps * 1e9), f"injection of {dev}"))
    for dev, nb in recv.items():
        d = topology.device(dev)
        candidates.append((lat_in[dev] * 1e-6 + nb / (d.ingress_gbps * 1e9), f"ejection of {dev}"))
    for (name, dev), nb in capped.items():
        link = topology.link(name)
        candidates.append((link.latency_us * 1e-6 + nb / (link.per_device_gbps * 1e9), f"{name} egress of {dev}"))
    worst = candidates[0]
    for c in candidates[1:]:
        if c[0] > worst[0]:
            worst = c
    return worst[0], worst[1], moved, chan


def predict(topology: Topology, placement_or_nranks, op: str, algo: str, nbytes: int) -> Prediction:
    """Predict the time and per-link traffic of ``algo`` for ``op`` on ``topology``.

    Args:
        topology: a validated ``Topology``.
        placement_or_nranks: a ``Placement`` of that topology, or a rank count (``place(topology, n)``).
        op: one of ``OPS``; algo: one of ``ALGOS[op]``.
        nbytes: message size in bytes, as nccl-tests counts it (see the module docstring).

    Returns:
        A ``Prediction``: ``time_s = sum over steps of max over resources (alpha + bytes / bandwidth)``.

    Raises:
        ValueError: unknown op or algo, negative nbytes, more ranks than the topology can place.
        TypeError: arguments of the wrong type.
    """
    nbytes = _check("predict", op, algo, nbytes)
    placement = _placement("predict", topology, placement_or_nranks)
    total = 0.0
    steps = []
    traffic: dict = defaultdict(int)
    link_bytes: dict = defaultdict(int)
    blame: dict = defaultdict(float)
    for step in schedule(placement, op, algo, nbytes):
        t, what, moved, chan = _price_step(topology, placement, step)
        total += t
        steps.append(StepCost(t, what, moved))
        blame[what] += t
        for (name, ea, eb), nb in chan.items():
            traffic[f"{name} {ea}->{eb}"] += nb
            link_bytes[name] += nb
    bottleneck = max(blame, key=blame.get) if blame else ""
    return Prediction(topology=topology.name, nranks=placement.nranks, op=op, algo=algo, nbytes=nbytes,
                      time_s=total, steps=tuple(steps), traffic=dict(traffic), link_bytes=dict(link_bytes),
                      bottleneck=bottleneck)


def predict_all(topology: Topology, placement_or_nranks, op: str, nbytes: int,
                algos: Sequence[str] | None = None) -> dict[str, Prediction]:
    """``predict`` for every algorithm of ``op`` (or those in ``algos``), in ``ALGOS[op]`` order."""
    if op not in ALGOS:
        raise ValueError(f"predict_all: op={op!r} is not one of {', '.join(OPS)}")
    if algos is None:
        algos = ALGOS[op]
    elif isinstance(algos, str) or not algos:
        raise ValueError(f"predict_all: algos={algos!r} must be a non-empty list of algorithm names")
    placement = _placement("predict_all", topology, placement_or_nranks)
    return {a: predict(topology, placement, op, a, nbytes) for a in algos}


def best(topology: Topology, nranks, op: str, nbytes: int, algos: Sequence[str] | None = None) -> str:
    """The algorithm the model predicts fastest for ``op`` at ``nbytes`` (ties: the earlier in ``ALGOS[op]``).

    ``nranks`` may also be a ``Placement``. This is what ``algo="auto"`` consults when no measured
    tuning table covers the case.
    """
    preds = predict_all(topology, nranks, op, nbytes, algos)
    return min(preds, key=lambda a: preds[a].time_s)


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
          algos: Sequence[str] | None = None) -> str:
    """Predicted time of every algorithm at every size, with the ratio ring time / algorithm time.

    A ratio above 1 means the model predicts the algorithm faster than the ring.
    """
    placement = _placement("table", topology, placement_or_nranks)
    if op not in ALGOS:
        raise ValueError(f"table: op={op!r} is not one of {', '.join(OPS)}")
    algos = list(ALGOS[op] if algos is None else algos)
    npk = len(placement.packages())
    lines = [f"{op} on {topology.name}: {placement.nranks} rank(s) in {npk} package(s); size = "
             f"{_SIZE_MEANING[op]}; ratio = ring time / time (> 1: faster than ring)"]
    rows = [["size"] + [f"{a}" for a in algos] + ["best"]]
    for n in sizes:
        preds = predict_all(topology, placement, op, n, algos)
        ring = predict(topology, placement, op, "ring", n).time_s
        row = [_fmt_size(n)]
        for a in algos:
            t = preds[a].time_s
            ratio = f"{ring / t:.2f}x" if t > 0 else "-"
            row.append(f"{_fmt_time(t)} {ratio}")
        row.append(min(preds, key=lambda a: preds[a].time_s))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        lines.append("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)))
    return "\n".join(lines)

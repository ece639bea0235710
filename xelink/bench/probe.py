"""Probe the running job: link latency and bandwidth, software overhead per step, local copy/reduce speed.

Run under a launcher: ``mpiexec -n 4 xelink bench probe --topology-out t.toml --calibration-out c.toml``.
Everything goes through xelink's own transport, with the step primitive every collective is built of
(post the receives and sends of a step, wait for all), on tensors of the communicator's device:

1. **Links**: for each link of the topology that joins two ranks of the job, a ping-pong between the
   first such pair (the other ranks wait) at a few sizes; one way = round trip / 2, fitted as
   ``alpha + bytes / beta``. alpha and beta become the link's ``latency_us`` and ``bandwidth_gbps``.
2. **Injection under load**: every rank at once sends to its right neighbour and receives from its
   left (a ring step) at a few sizes; the fitted beta is each device's ``injection_gbps``: what a rank
   moves when every rank moves bytes, as in a collective (on CPU ranks the cores are shared).
3. **Software**: skeleton collective calls of K steps on 8 floats (clone the buffer, per step send a
   chunk and sum each chunk received, copy back), every rank active, in three patterns: pairs
   ping-ponging (1 message per rank per step), a ring (2) and all peers (2(n-1)). The time of a call
   of K steps is fitted as ``intercept + K * per_step``; what a step costs beyond the link latency the
   model already charges is fitted as ``step_us + message_us * messages``; the mean intercept plus the
   cost of entering the public API (a collective on a one-rank communicator) is ``call_us``.
4. **Local work**: every rank at once times ``b.copy_(a)`` and ``b.add_(a)`` (float32) at a few sizes;
   the fitted betas are the device's ``copy_gbps`` and ``reduce_gbps``.

On CUDA ranks (one GPU each, one host) the same four measurements use xelink's own peer memory
(``xelink.symm``: CUDA IPC, no NCCL) on device memory, timed with CUDA events:

1. links: rank a pulls from rank b's buffer (``xelink.empty``, IPC-mapped) with the copy engine
   (``cuMemcpyAsync`` over NVLink/PCIe); each copy is one way, the other ranks wait. NCCL send/recv
   ping-pongs between the same pairs are co-measured as the baseline (``ProbeResult.baseline_pairs``);
2. injection: every rank at once pulls from its right neighbour;
3. software: chains of K GPU barriers (``xelink.device_barrier``: every rank signals every peer through
   peer memory, the step every GPU algorithm ends with), one pattern, n-1 messages per step; the API
   cost is a CUDA all-reduce on a one-rank group;
4. local work: ``b.copy_(a)`` and ``b.add_(a)`` on the GPU, past the L2 cache (up to 256 MiB).

The result is a calibrated topology (the job's topology, every measured figure with the source
``measured here: by `xelink bench probe` on <date>, <host>; ...``) and a ``cost.Calibration``; with both,
``cost.predict`` models what a collective costs on this job. Times are medians of co-measured samples
(max over ranks where the ranks work together); a software chain's is its least sample (a latency).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import statistics

import numpy as np
import torch

from .. import cost
from ..topology import Placement, Topology, validate
from ..collectives.cpu.base import step
from .harness import at_least, co_measure, one_gpu_per_rank, rank_max, time_cuda_events, time_fn

__all__ = ["Fit", "ProbeResult", "QUICK", "fit_alpha_beta", "probe", "calibrated", "calibrated_topology",
           "all_pairs", "pair_variants", "pair_results", "measure_pairs", "job_placement", "GPU", "GPU_QUICK",
           "defaults", "is_cuda", "nccl_move", "cpu_snapshot", "other_cpu", "format_result", "add_arguments", "run_probe", "report",
           "main"]

KiB, MiB = 1 << 10, 1 << 20
# Defaults: full, and quick (what tests and smoke runs use).
# The sizes reach past the last-level cache (16 MiB buffers), where bandwidth-bound collectives live.
PINGPONG_SIZES = (8, 64 * KiB, MiB, 4 * MiB, 16 * MiB)
EXCHANGE_SIZES = (256 * KiB, MiB, 4 * MiB, 16 * MiB)
LOCAL_SIZES = (256 * KiB, MiB, 4 * MiB, 16 * MiB)
CHAIN_LENGTHS = (1, 4, 16)
QUICK = {"pingpong_sizes": (8, 256 * KiB), "exchange_sizes": (64 * KiB, 512 * KiB),
         "local_sizes": (256 * KiB, MiB), "chain_lengths": (1, 6), "iters": 3, "rounds": 2}
# CUDA ranks: sizes past the 50-60 MB L2 of a datacenter GPU, where bandwidth-bound collectives live.
GPU = {"pingpong_sizes": (8, 64 * KiB, MiB, 16 * MiB, 128 * MiB), "exchange_sizes": (MiB, 16 * MiB, 128 * MiB),
       "local_sizes": (4 * MiB, 64 * MiB, 256 * MiB)}
GPU_QUICK = {**QUICK, "pingpong_sizes": (8, MiB, 32 * MiB), "exchange_sizes": (MiB, 32 * MiB),
             "local_sizes": (4 * MiB, 128 * MiB)}
_TAG = (1 << 14) - 1  # a user-range tag no collective uses; the probe runs between collectives
_PINGPONG, _PULL = "xelink:pingpong", "xelink:copy_engine"
_HOW = {_PINGPONG: "ping-pong rank {a} <-> rank {b}, one way = round trip / 2",
        _PULL: "rank {a} pulls from rank {b}'s memory with the copy engine (CUDA IPC), one way per copy"}


@dataclasses.dataclass(frozen=True)
class Fit:
    """``seconds(nbytes) = alpha_us * 1e-6 + nbytes / (gbps * 1e9)``, from ``points`` (bytes, seconds)."""

    alpha_us: float
    gbps: float
    points: tuple

    def seconds(self, nbytes: int) -> float:
        return self.alpha_us * 1e-6 + nbytes / (self.gbps * 1e9)


def fit_alpha_beta(points) -> Fit:
    """Least squares: ``seconds = alpha + bytes / beta`` through (bytes, seconds) points.

    The error is absolute, so the largest sizes set beta: the bandwidth a bandwidth-bound collective
    meets, beyond the caches. alpha comes out rough (the probe takes latency from its smallest message
    instead); a negative alpha is refitted as 0 (a line through the origin), and a beta that is not
    positive (noise) is set by the largest point alone.
    """
    pts = [(float(b), float(t)) for b, t in points]
    if not pts or any(t <= 0 for _, t in pts):
        raise ValueError(f"fit_alpha_beta: points={points!r} need positive times")
    s = np.array([b for b, _ in pts])
    t = np.array([t for _, t in pts])
    a, b = 0.0, -1.0
    if len(set(s)) >= 2:
        (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(s), s], axis=1), t, rcond=None)
    if a < 0 or b <= 0:
        a, b = 0.0, float(np.dot(s, t) / np.dot(s, s)) if np.any(s) else -1.0
    if b <= 0:
        i = int(np.argmax(s))
        a, b = 0.0, (t[i] / s[i] if s[i] else 1e-12)
    return Fit(alpha_us=float(a) * 1e6, gbps=1.0 / float(b) / 1e9, points=tuple(pts))


@dataclasses.dataclass
class ProbeResult:
    """What ``probe`` measured (the same on every rank).

    Attributes:
        nranks, hosts, device, date: the job.
        links: link name -> ``{"pair": [a, b], "fit": Fit, "latency_us": one way at the smallest size}``.
        injection: ``Fit`` of a ring step with every rank sending (per-rank bandwidth under load), or None.
        software: ``{"patterns": {name: {...}}, "call_us", "step_us", "message_us", "api_us"}``.
        local: per rank, ``{"copy": Fit, "reduce": Fit}``.
        other_cpu: the share of the host's CPU time other processes took while the probe ran.
        pairs: every pair measured (``pair_results``): the first pair of each link, or every pair of
            ranks on different devices with ``every_pair``.
        method: how the pairs were measured: ``xelink:pingpong`` (the transport step, one way = round
            trip / 2) or ``xelink:copy_engine`` (CUDA: a one-way pull through peer memory).
        baseline_pairs: CUDA with one GPU per rank: NCCL send/recv ping-pong between the same pairs
            (``pair_results``); empty where ranks share a GPU (NCCL refuses them).
    """

    nranks: int
    hosts: list
    device: str
    date: str
    links: dict
    injection: Fit | None
    software: dict
    local: list
    other_cpu: float | None = None
    pairs: list = dataclasses.field(default_factory=list)
    method: str = "xelink:pingpong"
    baseline_pairs: list = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def stamp(self) -> str:
        where = ", ".join(dict.fromkeys(self.hosts))
        return f"measured here: by `xelink bench probe` on {self.date}, {where}, {self.nranks} rank(s)"


# -- timing helpers -------------------------------------------------------------------------------

def cpu_snapshot():
    """(host jiffies, host idle jiffies, this process's jiffies) from Linux /proc; None elsewhere."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            host = [int(v) for v in f.readline().split()[1:]]
        with open("/proc/self/stat", encoding="ascii") as f:
            mine = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError):
        return None
    return sum(host), host[3] + host[4], int(mine[11]) + int(mine[12])  # idle + iowait; utime + stime


def other_cpu(comm, before, after) -> float | None:
    """The share of the host's CPU time between two ``cpu_snapshot``s that no rank of ``comm`` used.

    Measures outside load (other jobs on a shared machine). None across hosts or without /proc.
    Collective: every rank of ``comm`` must call this.
    """
    got = None if before is None or after is None else tuple(a - b for a, b in zip(after, before))
    every = comm.allgather_object(got)
    if None in every or len(set(comm.hosts)) > 1:
        return None
    total, idle, _ = every[0]  # the host's figures as rank 0 saw them, so every rank returns the same
    return max(0.0, (total - idle - sum(g[2] for g in every)) / total) if total > 0 else None


def is_cuda(comm) -> bool:
    """Whether ``comm``'s ranks drive CUDA devices (the probe then measures device memory, see above)."""
    return getattr(comm.device, "type", "cpu") == "cuda"


def defaults(comm, quick: bool) -> dict:
    """The probe's sizes and samples for ``comm``'s device kind: GPU or CPU figures, quick or full."""
    if is_cuda(comm):
        return dict(GPU_QUICK if quick else GPU)
    return dict(QUICK) if quick else {}


def _timing_of(device):
    """One block's timing: CUDA events on CUDA (device time, no host round trip per call), else the host clock."""
    kind = getattr(device, "type", "cpu")
    if kind == "cuda":
        return functools.partial(time_cuda_events, warmup=0)
    sync = torch.xpu.synchronize if kind == "xpu" else None
    return functools.partial(time_fn, warmup=0, sync=sync)


def _timed_samples(comm, variants: dict, *, iters: int, rounds: int, together: bool = True) -> dict:
    """name -> samples (seconds per unit) of each ``(fn, units per call)`` variant, all co-measured.

    Interleaving every variant round by round spreads a burst of outside load over all of them, so
    the figures fitted together (sizes of one fit, patterns of the software fit) see the same machine.
    ``together``: each sample is the max over ranks (work the ranks do together); else this rank's own.
    """
    timing = _timing_of(comm.device)
    samples = co_measure({k: fn for k, (fn, _) in variants.items()}, warmup=1, iters=iters, rounds=rounds,
                         barrier=comm.barrier, reduce_max=rank_max(comm) if together else None, timing=timing)
    return {k: [t / units for t in samples[k]] for k, (_, units) in variants.items()}


def _timed(comm, variants: dict, *, iters: int, rounds: int, together: bool = True) -> dict:
    """name -> median seconds per unit of each variant (``_timed_samples``)."""
    got = _timed_samples(comm, variants, iters=iters, rounds=rounds, together=together)
    return {k: statistics.median(v) for k, v in got.items()}


def _bytes(nbytes: int, device) -> torch.Tensor:
    # Never zeros: untouched zeroed pages all map the kernel's one zero page, which is always in cache,
    # so a send from them measures a bandwidth no real buffer has.
    return (torch.arange(max(nbytes, 1), dtype=torch.int64, device=device) % 251).to(torch.uint8)


def _step(comm, sends, recvs, deadline):
    step(comm, sends, recvs, _TAG, deadline, "probe")


def _reps(nbytes: int) -> int:
    """Repetitions per timed call: enough bytes (about 4 MiB) that the clock's resolution does not matter."""
    return max(1, min(16, (4 * MiB) // max(nbytes, 1)))


# -- what is timed ----------------------------------------------------------------------------------

def _link_pairs(topology: Topology, placement: Placement) -> dict:
    """Link name -> the first pair of ranks (on different devices) whose bytes cross it."""
    pairs: dict = {}
    n = placement.nranks
    for a in range(n):
        for b in range(a + 1, n):
            da, db = placement.devices[a], placement.devices[b]
            if da != db:
                link, _, _ = topology.route(da, db)
                pairs.setdefault(link.name, (a, b))
    return pairs


def _pingpong(comm, a: int, b: int, nbytes: int, move):
    """(one call: round trips between ranks a and b, the others idle; one-way trips per call).

    ``move(sends, recvs)`` is one step of (peer, tensor) lists: xelink's transport step by default,
    or another mover (NCCL send/recv for device memory, ``links.py``).
    """
    buf, reps = _bytes(nbytes, comm.device), _reps(nbytes)

    def trip():
        for _ in range(reps):
            if comm.rank == a:
                move([(b, buf)], [])
                move([], [(b, buf)])
            elif comm.rank == b:
                move([], [(a, buf)])
                move([(a, buf)], [])

    return trip, 2 * reps


def all_pairs(placement: Placement) -> list:
    """Every pair of ranks (a < b) on different devices, in order."""
    n = placement.nranks
    return [(a, b) for a in range(n) for b in range(a + 1, n) if placement.devices[a] != placement.devices[b]]


def pair_variants(comm, pairs, sizes, move, prefix: str = "pingpong") -> dict:
    """``_timed`` variants of a ping-pong between each pair at each size (keys ``<prefix>|a-b|size``).

    ``move`` is a step (``move(sends, recvs)``) ping-ponged between the pair, or a ``_PeerPull`` (CUDA:
    rank a pulls from rank b, one way per copy).
    """
    make = move.variant if isinstance(move, _PeerPull) else (lambda a, b, s: _pingpong(comm, a, b, s, move))
    return {f"{prefix}|{a}-{b}|{s}": make(a, b, s) for a, b in pairs for s in sizes}


def pair_results(samples: dict, pairs, sizes, prefix: str = "pingpong") -> list:
    """Per pair, from ``_timed_samples`` of ``pair_variants``: the alpha-beta fit, the one-way latency and
    the one-way samples (seconds) per size, as ``{"pair", "fit", "latency_us", "one_way_s"}``."""
    out = []
    for a, b in pairs:
        per_size = [(s, samples[f"{prefix}|{a}-{b}|{s}"]) for s in sizes]
        fit = fit_alpha_beta([(s, statistics.median(t)) for s, t in per_size])
        small, small_t = min(per_size)
        # Latency is the one-way time of the smallest message, as ping-pong benchmarks report it; the fit's
        # alpha also carries the handshakes of large messages and would charge them to every step.
        latency = statistics.median(small_t) * 1e6 - small / (fit.gbps * 1e3)
        out.append({"pair": [a, b], "fit": fit, "latency_us": max(latency, 0.01),
                    "one_way_s": [[s, list(t)] for s, t in per_size]})
    return out


def measure_pairs(comm, pairs, sizes, *, iters: int, rounds: int, move=None) -> list:
    """Ping-pong every pair of ``pairs`` at every size, all interleaved; ``pair_results`` on every rank.

    ``move``: the step that moves bytes (default: xelink's transport step on ``comm``).
    Collective: every rank of ``comm`` must call this with the same arguments.
    """
    if move is None:
        deadline = comm.deadline()
        move = lambda sends, recvs: _step(comm, sends, recvs, deadline)  # noqa: E731
    samples = _timed_samples(comm, pair_variants(comm, pairs, sizes, move), iters=iters, rounds=rounds)
    return pair_results(samples, pairs, sizes)


def _exchange(comm, nbytes: int, deadline):
    """(one call: ring steps, every rank sending right and receiving from the left; steps per call)."""
    n, r = comm.size, comm.rank
    src, dst, reps = _bytes(nbytes, comm.device), _bytes(nbytes, comm.device), _reps(nbytes)

    def ring():
        for _ in range(reps):
            _step(comm, [((r + 1) % n, src)], [((r - 1) % n, dst)], deadline)

    return ring, reps


def _patterns(n: int, r: int) -> dict:
    """name -> (messages per rank per step, [(sends, recvs) per step of the pattern's cycle] of rank r)."""
    right, left = (r + 1) % n, (r - 1) % n
    partner = r ^ 1
    if partner < n:
        first = ([partner], []) if r % 2 == 0 else ([], [partner])
        pingpong = [first, (first[1], first[0])]
    else:
        pingpong = [([], []), ([], [])]  # the odd rank out waits
    out = {"pingpong": (1, pingpong), "ring": (2, [([right], [left])])}
    if n >= 3:
        peers = [p for p in range(n) if p != r]
        out["all"] = (2 * (n - 1), [(peers, peers)])
    return out


def _chain(comm, cycle, k: int, deadline):
    """(one call: the skeleton of a collective of k steps on 8 floats; 1).

    Like a collective's code: clone the buffer and make a receive buffer, then per step send a chunk
    (a view), receive chunks and sum each into the accumulator, and copy the result back. The bytes
    are too few to matter; what is left is the software of a collective call and of its steps.
    """
    buf = torch.ones(8, device=comm.device)
    peers = sorted({p for sends, recvs in cycle for p in (*sends, *recvs)})

    def call():
        acc = buf.clone()
        inbox = {p: torch.empty(2, device=comm.device) for p in peers}
        for i in range(k):
            sends, recvs = cycle[i % len(cycle)]
            _step(comm, [(p, acc[i % 4 * 2:i % 4 * 2 + 2]) for p in sends], [(p, inbox[p]) for p in recvs], deadline)
            for p in recvs:
                acc[i % 4 * 2:i % 4 * 2 + 2].add_(inbox[p])
        buf.copy_(acc)

    return call, 1


def _local_op(comm, name: str, nbytes: int):
    a = torch.ones(nbytes // 4, device=comm.device)
    b = torch.ones(nbytes // 4, device=comm.device)
    op, reps = (b.copy_ if name == "copy" else b.add_), _reps(nbytes)

    def work():
        for _ in range(reps):
            op(a)

    return work, reps


# -- CUDA ranks: xelink's peer memory ------------------------------------------------------------------

class _PeerPull:
    """Copy-engine pulls through xelink's CUDA IPC mapping of every rank's buffer (``xelink.empty``).

    Collective to make (it maps the buffers). ``pull(p, nbytes)`` enqueues one copy of ``nbytes`` from
    rank p's buffer into a local one on the current stream: one way over the link, nothing else.
    """

    def __init__(self, comm, nbytes: int):
        from .. import symm

        self.comm, self.copy = comm, symm.copy_engine
        self.src = symm.empty(max(nbytes, 1), dtype=torch.uint8, group=comm)
        self.src.copy_(_bytes(max(nbytes, 1), comm.device))
        self.dst = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=comm.device)
        self.addresses = symm.peer_addresses(self.src, comm)
        torch.cuda.synchronize()

    def pull(self, p: int, nbytes: int) -> None:
        self.copy(self.dst.data_ptr(), self.addresses[p], nbytes, torch.cuda.current_stream().cuda_stream)

    def variant(self, a: int, b: int, nbytes: int):
        """(one call: rank a pulls ``nbytes`` from rank b, repeated; the others idle; one-way copies per call)."""
        reps = _reps(nbytes)

        def call():
            if self.comm.rank == a:
                for _ in range(reps):
                    self.pull(b, nbytes)

        return call, reps

    def exchange(self, nbytes: int):
        """(one call: every rank at once pulls from its right neighbour, repeated; copies per call)."""
        right, reps = (self.comm.rank + 1) % self.comm.size, _reps(nbytes)

        def call():
            for _ in range(reps):
                self.pull(right, nbytes)

        return call, reps


def nccl_move(comm):
    """A probe step (``move(sends, recvs)``) that moves CUDA tensors with NCCL send/recv (the baseline)."""
    import torch.distributed as dist

    pg = comm.process_group()
    # The first NCCL call of a group must include every rank (torch's rule for point-to-point).
    dist.all_reduce(torch.zeros(1, device=comm.device), group=pg)

    def move(sends, recvs):
        for peer, buf in sends:
            dist.send(buf, peer, group=pg)
        for peer, buf in recvs:
            dist.recv(buf, peer, group=pg)

    return move


def _gpu_patterns(n: int, r: int) -> dict:
    """``_patterns`` of CUDA ranks: one, the GPU barrier (every rank signals every peer: n-1 messages)."""
    peers = [p for p in range(n) if p != r]
    return {"barrier": (max(n - 1, 1), [(peers, peers)])}


def _barriers(comm, k: int):
    """(one call: k GPU barriers back to back, the step that ends every GPU algorithm; 1)."""
    from ..collectives import gpu

    def call():
        for _ in range(k):
            gpu.barrier(comm)

    return call, 1


# -- the analysis -----------------------------------------------------------------------------------

def _pattern_latency(topology: Topology, placement: Placement, name: str, patterns=None) -> float:
    """The link latency (us) the model already charges for one step of a pattern with tiny messages."""
    n = placement.nranks
    worst = 0.0
    for r in range(n):
        _, cycle = (patterns or _patterns)(n, r)[name]
        for sends, _ in cycle:
            for p in sends:
                if placement.devices[p] != placement.devices[r]:
                    worst = max(worst, topology.route(placement.devices[r], placement.devices[p])[0].latency_us)
    return worst


def _software(times: dict, lengths, topology: Topology, placement: Placement, api_us: float,
              pattern_fn=None) -> dict:
    """Per pattern: per-step time and per-call intercept; then step_us + message_us * messages >= 0."""
    patterns = {}
    for name, (messages, _) in (pattern_fn or _patterns)(placement.nranks, 0).items():
        seconds = [times[f"chain|{name}|{k}"] for k in lengths]
        slope, icpt = np.polyfit(np.array(lengths, dtype=float), np.array(seconds), 1)
        link_us = _pattern_latency(topology, placement, name, pattern_fn)
        patterns[name] = {"messages": messages, "lengths": list(lengths), "seconds": seconds,
                          "per_step_us": float(slope) * 1e6, "intercept_us": float(icpt) * 1e6,
                          "link_latency_us": link_us, "beyond_link_us": float(slope) * 1e6 - link_us}
    m = np.array([p["messages"] for p in patterns.values()], dtype=float)
    y = np.array([p["beyond_link_us"] for p in patterns.values()])
    step_us, message_us = float(np.mean(y)), 0.0
    if len(set(m)) >= 2:
        (step_us, message_us), *_ = np.linalg.lstsq(np.stack([np.ones_like(m), m], axis=1), y, rcond=None)
        if message_us < 0:
            step_us, message_us = float(np.mean(y)), 0.0
        elif step_us < 0:
            step_us, message_us = 0.0, float(np.sum(m * y) / np.sum(m * m))
    intercept = float(np.mean([p["intercept_us"] for p in patterns.values()]))
    return {"patterns": patterns, "step_us": max(float(step_us), 0.0), "message_us": max(float(message_us), 0.0),
            "api_us": api_us, "intercept_us": intercept, "call_us": max(intercept, 0.0) + api_us}


# -- the probe ------------------------------------------------------------------------------------

def probe(comm, *, pingpong_sizes=PINGPONG_SIZES, exchange_sizes=EXCHANGE_SIZES, local_sizes=LOCAL_SIZES,
          chain_lengths=CHAIN_LENGTHS, iters: int = 5, rounds: int = 5, topology: Topology | None = None,
          placement: Placement | None = None, every_pair: bool = False) -> ProbeResult:
    """Measure links, injection under load, software overhead and local work on ``comm``'s ranks.

    Args:
        comm: the communicator (its ranks are the job being probed); its ``topology`` and
            ``world_placement`` name the devices and links unless ``topology``/``placement`` are given.
        pingpong_sizes, exchange_sizes, local_sizes: bytes per message / buffer of each measurement.
        chain_lengths: steps per timed call in the software chains (at least two lengths).
        iters, rounds: timed calls per round, rounds (``co_measure``; every measurement interleaved).
        every_pair: ping-pong every pair of ranks on different devices (the link matrix of ``xelink
            bench links``), not just the first pair per link; each link's figures come from its first pair.

    Returns:
        A ``ProbeResult``, identical on every rank.

    Collective: every rank of ``comm`` must call this with the same arguments.
    """
    if len(set(chain_lengths)) < 2:
        raise ValueError(f"probe: chain_lengths={chain_lengths!r} needs at least two different lengths")
    topology, placement = job_placement(comm, topology, placement)
    start = cpu_snapshot()
    deadline = comm.deadline()
    pairs = _link_pairs(topology, placement)
    measured = all_pairs(placement) if every_pair else sorted(set(pairs.values()))
    cuda = is_cuda(comm) and comm.size > 1
    nccl = cuda and one_gpu_per_rank(comm)  # NCCL refuses two ranks of one GPU (XELINK_RANKS_PER_DEVICE)
    if cuda:
        # Device memory through xelink's own peer memory; NCCL's send/recv between the same pairs beside it.
        mover = _PeerPull(comm, max((*pingpong_sizes, *exchange_sizes)))
        variants = pair_variants(comm, measured, pingpong_sizes, mover)
        if nccl:
            variants.update(pair_variants(comm, measured, pingpong_sizes, nccl_move(comm), prefix="nccl"))
    else:
        variants = pair_variants(comm, measured, pingpong_sizes, lambda sends, recvs: _step(comm, sends, recvs, deadline))
    pattern_fn = _gpu_patterns if cuda else _patterns
    with_chains = True
    solo = comm.split(comm.rank) if comm.size > 1 else None
    try:
        if solo is not None:
            from .. import collectives

            for s in exchange_sizes:
                variants[f"exchange|{s}"] = mover.exchange(s) if cuda else _exchange(comm, s, deadline)
            if cuda:
                from ..collectives import gpu

                with_chains = gpu.kernel_module().available()  # the GPU barrier is a Triton kernel
            for name, (_, cycle) in pattern_fn(comm.size, comm.rank).items():
                for k in chain_lengths if with_chains else ():
                    variants[f"chain|{name}|{k}"] = _barriers(comm, k) if cuda else _chain(comm, cycle, k, deadline)
            # A public collective that communicates nothing: the cost of entering the API.
            x = torch.ones(8, device=comm.device)
            api_algo = "direct" if cuda else "ring"
            try:
                collectives.all_reduce(x, group=solo, algo=api_algo)
            except ValueError:
                x = torch.ones(8)  # collectives of this build take host tensors only
            variants["api"] = (lambda: collectives.all_reduce(x, group=solo, algo=api_algo), 1)
        samples = _timed_samples(comm, variants, iters=iters, rounds=rounds) if variants else {}
    finally:
        if solo is not None:
            solo.free()
    # Medians, but a chain's least time: its slope (the time of one step) is a latency, which noise only
    # lengthens; a median of a few samples on a busy host can make the long chain look faster than the short.
    times = {k: (min if k.startswith("chain|") else statistics.median)(v) for k, v in samples.items()}
    measured_pairs = measured
    by_pair = {tuple(p["pair"]): p for p in pair_results(samples, measured, pingpong_sizes)}
    links = {name: {"pair": [a, b], "fit": by_pair[a, b]["fit"], "latency_us": by_pair[a, b]["latency_us"]}
             for name, (a, b) in pairs.items()}
    injection = software = None
    if comm.size > 1:
        injection = fit_alpha_beta([(s, times[f"exchange|{s}"]) for s in exchange_sizes])
        measured = calibrated_topology(topology, placement, links, None, "measured here: by this probe",
                                       _PULL if cuda else _PINGPONG)
        if with_chains:
            software = _software(times, chain_lengths, measured, placement, times["api"] * 1e6, pattern_fn)
    own = _timed(comm, {f"{op}|{s}": _local_op(comm, op, s) for op in ("copy", "reduce") for s in local_sizes},
                 iters=iters, rounds=rounds, together=False)
    mine = {op: fit_alpha_beta([(s, own[f"{op}|{s}"]) for s in local_sizes]) for op in ("copy", "reduce")}
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return ProbeResult(nranks=comm.size, hosts=list(comm.hosts), device=str(comm.device), date=date, links=links,
                       injection=injection, software=software or {}, local=comm.allgather_object(mine),
                       other_cpu=other_cpu(comm, start, cpu_snapshot()), pairs=list(by_pair.values()),
                       method=_PULL if cuda else _PINGPONG,
                       baseline_pairs=pair_results(samples, measured_pairs, pingpong_sizes, "nccl") if nccl else [])


def job_placement(comm, topology=None, placement=None):
    """(topology, placement of ``comm``'s ranks): the given ones, else the world's, else one package per host."""
    if topology is None:
        topology = comm.topology
    if placement is None:
        wp = comm.world_placement
        if wp is None or topology is None:
            from ..topology import build_cpu_topology, place

            topology = topology or build_cpu_topology(comm.hosts)
            placement = place(topology, comm.size)
        else:
            placement = Placement(topology, tuple(wp.devices[w] for w in comm.world_ranks))
    return topology, placement


def calibrated_topology(topology: Topology, placement: Placement, links: dict, injection: Fit | None,
                        stamp: str, method: str = _PINGPONG) -> Topology:
    """``topology`` with the measured link and injection figures (and ``stamp``-ed sources) put in.

    ``method``: how the links were measured (``ProbeResult.method``), named in each source.
    """
    new_links = []
    for link in topology.links:
        got = links.get(link.name)
        if got is None:
            new_links.append(link)
            continue
        fit, (a, b) = got["fit"], got["pair"]
        how = f"{stamp}; " + _HOW[method].format(a=a, b=b)
        small = int(min(s for s, _ in fit.points))
        new_links.append(dataclasses.replace(
            link, latency_us=got["latency_us"], bandwidth_gbps=fit.gbps,
            latency_source=f"{how}, at {small} B (less {small} B / bandwidth)",
            bandwidth_source=f"{how}, beta of alpha + bytes/beta over {len(fit.points)} sizes"))
    used = set(placement.devices)
    devices = []
    for d in topology.devices:
        if injection is None or d.id not in used:
            devices.append(d)
            continue
        devices.append(dataclasses.replace(
            d, injection_gbps=injection.gbps, ejection_gbps=None, ejection_source=None,
            injection_source=f"{stamp}; every rank {'pulls from' if method == _PULL else 'sends to'} its right "
                             f"neighbour at once (a ring step), "
                             f"beta of alpha + bytes/beta over {len(injection.points)} sizes"))
    name = topology.name if topology.name.endswith("-probed") else f"{topology.name}-probed"
    desc = f"{topology.description}; figures of the ranks' links and devices {stamp.split(': ', 1)[-1]}"
    return validate(dataclasses.replace(topology, name=name, description=desc, links=tuple(new_links),
                                        devices=tuple(devices), path=None, _index={}), fn="probe")


def calibrated(result: ProbeResult, topology: Topology, placement: Placement) -> tuple[Topology, cost.Calibration]:
    """The calibrated topology and the ``cost.Calibration`` a probe result describes."""
    stamp = result.stamp
    topo = calibrated_topology(topology, placement, result.links, result.injection, stamp, result.method)
    sources, terms = {}, {}
    sw = result.software
    if sw:
        chains = f"skeleton calls of {'/'.join(map(str, next(iter(sw['patterns'].values()))['lengths']))} steps on 8 floats"
        terms = {"call_us": sw["call_us"], "step_us": sw["step_us"], "message_us": sw["message_us"]}
        sources = {
            "call_us": f"{stamp}; mean intercept of the {chains} ({sw['intercept_us']:.1f} us) + a public "
                       f"collective on a one-rank group ({sw['api_us']:.1f} us)",
            "step_us": f"{stamp}; per step beyond the link latency, fitted as step + message x messages "
                       f"over the patterns {', '.join(sw['patterns'])} ({chains})",
            "message_us": f"{stamp}; the same fit, per message the busiest rank posts in a step",
        }
    per_device: dict = {}
    for r, loc in enumerate(result.local):
        dev = placement.devices[r]
        copy, red = loc["copy"].gbps, loc["reduce"].gbps
        old = per_device.get(dev)
        per_device[dev] = cost.DeviceLocal(copy, red) if old is None else \
            cost.DeviceLocal(min(copy, old.copy_gbps), min(red, old.reduce_gbps))
    how = f"{stamp}; every rank at once, float32 on {result.device}, beta of alpha + bytes/beta"
    median = cost.DeviceLocal(statistics.median(d.copy_gbps for d in per_device.values()),
                              statistics.median(d.reduce_gbps for d in per_device.values()))
    sources["copy_gbps"] = f"{how} of b.copy_(a), median over devices"
    sources["reduce_gbps"] = f"{how} of b.add_(a), median over devices"
    for dev in per_device:
        sources[f"{dev}.copy_gbps"] = f"{how} of b.copy_(a)"
        sources[f"{dev}.reduce_gbps"] = f"{how} of b.add_(a)"
    cal = cost.Calibration(name=topo.name, topology=topo.name, local=median, devices=per_device, sources=sources,
                           description=f"software and local-memory terms of {result.nranks} rank(s) on "
                                       f"{', '.join(dict.fromkeys(result.hosts))}", **terms)
    return topo, cal


# -- reporting ------------------------------------------------------------------------------------

def format_result(result: ProbeResult) -> str:
    """A readable summary of a probe."""
    other = "" if result.other_cpu is None else f"; other processes took {result.other_cpu:.0%} of the CPU meanwhile"
    lines = [f"probe of {result.nranks} rank(s) on {', '.join(dict.fromkeys(result.hosts))}, device "
             f"{result.device}, {result.date}{other}"]
    for name, got in result.links.items():
        f = got["fit"]
        how = _HOW.get(result.method, result.method).format(a=got["pair"][0], b=got["pair"][1])
        lines.append(f"  link {name} ({how}): latency {got['latency_us']:.1f} us, bandwidth {f.gbps:.2f} GB/s one way")
    for got in result.baseline_pairs:
        lines.append(f"  baseline NCCL send/recv ping-pong rank {got['pair'][0]} <-> {got['pair'][1]}: latency "
                     f"{got['latency_us']:.1f} us, bandwidth {got['fit'].gbps:.2f} GB/s one way")
    if result.injection is not None:
        lines.append(f"  injection under load (every rank in a ring step at once): {result.injection.gbps:.2f} GB/s "
                     f"per rank")
    sw = result.software
    if sw:
        for name, p in sw["patterns"].items():
            lines.append(f"  steps '{name}' ({p['messages']} message(s) per rank): {p['per_step_us']:.1f} us per "
                         f"step ({p['beyond_link_us']:.1f} beyond the link latency), {p['intercept_us']:.1f} us "
                         f"per call")
        lines.append(f"  software: call {sw['call_us']:.1f} us (API {sw['api_us']:.1f} us), step {sw['step_us']:.1f} "
                     f"us, message {sw['message_us']:.1f} us")
    copies = [loc["copy"].gbps for loc in result.local]
    reduces = [loc["reduce"].gbps for loc in result.local]
    lines.append(f"  local (every rank at once): copy {min(copies):.2f}-{max(copies):.2f} GB/s, reduce "
                 f"{min(reduces):.2f}-{max(reduces):.2f} GB/s per rank")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The probe's options (shared with ``xelink bench model-check``)."""
    p.add_argument("--quick", action="store_true", help="fewer sizes and samples (a smoke test, seconds)")
    p.add_argument("--iters", type=at_least(1), default=None, help="timed calls per round (default 5; quick 3)")
    p.add_argument("--rounds", type=at_least(1), default=None,
                   help="rounds, every measurement interleaved (default 5; quick 2)")
    p.add_argument("--topology-out", metavar="PATH", help="write the calibrated topology (TOML) here")
    p.add_argument("--calibration-out", metavar="PATH", help="write the calibration (TOML) here")


def run_probe(comm, args) -> ProbeResult:
    """``probe`` with the options of ``add_arguments`` (GPU sizes on CUDA ranks). Collective."""
    opts = defaults(comm, args.quick)
    if args.iters is not None:
        opts["iters"] = args.iters
    if args.rounds is not None:
        opts["rounds"] = args.rounds
    return probe(comm, **opts)


def report(result: ProbeResult, topology: Topology, calibration: cost.Calibration, args,
           json_path: str | None = None) -> None:
    """Print the probe and write what ``add_arguments``' options (and ``json_path``) ask for. Rank 0 only."""
    from ..topology import save

    print(format_result(result))
    if args.topology_out:
        save(topology, args.topology_out)
        print(f"calibrated topology written to {args.topology_out}")
    if args.calibration_out:
        cost.save_calibration(calibration, args.calibration_out)
        print(f"calibration written to {args.calibration_out}")
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(result.to_dict(), f, indent=1)
        print(f"probe measurements written to {json_path}")


def main(argv=None) -> int:
    import xelink

    p = argparse.ArgumentParser(prog="xelink bench probe", description=__doc__.splitlines()[0])
    add_arguments(p)
    p.add_argument("--json", metavar="PATH", help="write every measurement (JSON) here")
    args = p.parse_args(argv)
    world = xelink.init()
    result = run_probe(world, args)
    topology, placement = job_placement(world, None, None)
    topo, cal = calibrated(result, topology, placement)
    if world.rank == 0:
        report(result, topo, cal, args, args.json)
    xelink.finalize()
    return 0


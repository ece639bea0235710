"""GPU algorithms composed on the package layout (``Communicator.packages``): the hierarchical all-reduce
and the topology-aware all-gather, for packages of any sizes.

Equal packages run the flat peer-memory algorithms on the package sub-communicators
(``Communicator.package_groups``): the cross group of local index i holds one rank of every package.

Uneven packages (3 ranks as ``[[0, 1], [2]]``, 5 as ``[[0, 1, 2], [3, 4]]``) have no such cross groups, so
they run on the communicator's own peer memory (``xelink.symm``): a symmetric staging buffer of the
communicator (``xelink.symm.empty``), reads of the peers' copies by the copy engines (``symm.get``), torch
ops for the reductions, and device barriers (``symm.barrier``, with the communicator's deadline) between
the steps, everything on the current stream: no host synchronization, and after a warm-up call (which
allocates or grows the staging buffer, a collective call refused during capture) a call can be captured
in a CUDA graph and replayed. The all-gather sends each shard across to ``cross_target`` (the member with
the sender's local index, wrapping in a smaller package), the all-reduce each package partial to the
ranks whose spans overlap it, as the CPU schedules do: every byte enters every other package once.

Reuse of the staging buffer: between two barriers a rank writes only the parts of its copy that no peer
reads between those barriers, and every call ends with a barrier after its last read of peer memory, so
no rank starts the next call (and overwrites its copy) while a peer still reads it. The buffer is the same
for every call, so a replayed graph is a new call. Buffers the staging buffer outgrew stay allocated while
the communicator lives (captured graphs hold their addresses: rule 6 of ``xelink.symm.cuda``).
"""
from __future__ import annotations

import torch

from ... import symm
from ...errors import XelinkError
from ..cpu.all_gather import cross_target
from ..cpu.all_reduce import spans
from ..cpu.base import combine, work_dtype
from . import peer
from .launch import done, pieces, round16

__all__ = ["hierarchical_all_reduce", "topo_all_gather", "gather_sources", "STAGE_MIN"]

STAGE_MIN = 1 << 20  # bytes: the smallest staging buffer (a call that needs more grows it, in powers of two)


def _equal(packages) -> bool:
    return len({len(p) for p in packages}) == 1


def hierarchical_all_reduce(comm, x, op, async_op, timeout):
    """Reduce inside each package, all-reduce across packages, spread back inside each package.

    Equal packages (k ranks each): the schedule of the CPU ``hierarchical``
    (``xelink.collectives.cpu.all_reduce``): reduce-scatter in the package, each rank's 1/k share
    all-reduced with the ranks of the same local index (the one-shot all-reduce of the cross group),
    all-gather in the package. Uneven packages: ``_hierarchical_uneven``.
    """
    if not _equal(comm.packages):
        _hierarchical_uneven(comm, x, op, timeout)
        return done(comm, "all_reduce", async_op)
    pkg, cross = comm.package_groups(timeout)
    inner = "sum" if op == "avg" else op
    flat = x.view(-1)
    k = pkg.size
    per = -(-flat.numel() // k)
    padded = torch.empty(per * k, dtype=x.dtype, device=x.device)
    padded[: flat.numel()].copy_(flat)
    if per * k > flat.numel():
        padded[flat.numel():].fill_(1 if op == "prod" else 0)
    part = torch.empty(per, dtype=x.dtype, device=x.device)
    if k > 1:
        peer.reduce_scatter_tensor(pkg, part, padded, inner, False, timeout)
    else:
        part.copy_(padded)
    if cross.size > 1:
        peer.all_reduce(cross, part, inner, False, timeout, algo="direct")
    if op == "avg":
        part.div_(comm.size)
    if k > 1:
        peer.all_gather_into_tensor(pkg, padded, part, False, timeout, algo="direct")
    else:
        padded.copy_(part)
    flat.copy_(padded[: flat.numel()])
    return done(comm, "all_reduce", async_op)


def topo_all_gather(comm, out, inp, async_op, timeout):
    """Gather across packages, then inside each package: each shard crosses once per remote package.

    Equal packages: an all-gather in the cross group (the ranks of my local index), then one in my
    package. Uneven packages: ``_topo_uneven``.
    """
    if not _equal(comm.packages):
        _topo_uneven(comm, out, inp, timeout)
        return done(comm, "all_gather_into_tensor", async_op)
    pkg, cross = comm.package_groups(timeout)
    packages = comm.packages
    n = inp.numel()
    mine = torch.empty(cross.size * n, dtype=inp.dtype, device=inp.device)
    if cross.size > 1:
        peer.all_gather_into_tensor(cross, mine, inp.view(-1), False, timeout, algo="direct")
    else:
        mine.copy_(inp.view(-1))
    full = torch.empty(comm.size * n, dtype=inp.dtype, device=inp.device)
    if pkg.size > 1:
        peer.all_gather_into_tensor(pkg, full, mine, False, timeout, algo="direct")
    else:
        full.copy_(mine)
    # full is ordered [local index i][package p]; output wants rank order.
    view = full.view(pkg.size, cross.size, n)
    o = out.view(-1)
    for p, members in enumerate(packages):
        for i, r in enumerate(members):
            o[r * n:(r + 1) * n].copy_(view[i, p])
    return done(comm, "all_gather_into_tensor", async_op)


# -- uneven packages -------------------------------------------------------------------------------

def gather_sources(packages, rank: int) -> tuple[set, dict]:
    """The topology-aware all-gather's reads of ``rank``, as plain data (the same on every rank).

    Returns ``(across, inside)``: ``across``, the shards ``rank`` takes across the fabric from their owners
    (those of other packages whose ``cross_target`` in ``rank``'s package is ``rank``); ``inside[s]``, for
    every shard s, the rank of ``rank``'s package that holds s after the cross step (``rank`` itself for
    its own shard and for those it took across), from which ``rank`` copies s into its output.
    """
    where = {r: (p, i) for p, members in enumerate(packages) for i, r in enumerate(members)}
    me_p = where[rank][0]
    inside = {s: s if p == me_p else cross_target(packages, i, me_p) for s, (p, i) in where.items()}
    across = {s for s, h in inside.items() if h == rank and where[s][0] != me_p}
    return across, inside


class _Stage:
    """The communicator's symmetric staging buffer of the uneven paths (its resource ``"cuda.compose"``):
    uint8 memory from ``xelink.symm.empty``. Every rank asks for the same sizes in the same calls, so the
    ranks grow it together (a collective call); what it outgrew stays referenced (see the module docstring)."""

    def __init__(self):
        self.buf: torch.Tensor | None = None
        self.retired: list[torch.Tensor] = []

    def get(self, comm, nbytes: int, cap: int, fn: str, like: torch.Tensor) -> torch.Tensor:
        if self.buf is not None and self.buf.numel() >= nbytes:
            return self.buf
        if like.is_cuda and torch.cuda.is_current_stream_capturing():
            raise XelinkError(f"{fn}: the topology-aware path on {comm.name}'s uneven packages needs a staging buffer "
                              f"of {nbytes} B (has {0 if self.buf is None else self.buf.numel()}); growing it cannot "
                              "happen during CUDA graph capture: run the same call once before capturing it")
        size = 1 << (max(nbytes, STAGE_MIN) - 1).bit_length()
        size = max(nbytes, min(size, cap))
        if self.buf is not None:
            self.retired.append(self.buf)
        self.buf = symm.empty(size, dtype=torch.uint8, group=comm)
        return self.buf


def _stage(comm, nbytes: int, cap: int, fn: str, like: torch.Tensor) -> torch.Tensor:
    return comm.resource("cuda.compose", _Stage).get(comm, nbytes, cap, fn, like)


def _cap(comm, fn: str) -> int:
    """Bytes of staging a call may use at most (``XELINK_GPU_SCRATCH``, as the team's scratch slots): larger
    calls run in pieces."""
    return symm.team_of(comm, fn).slot_max


def _pull(comm, src: torch.Tensor, rank: int) -> torch.Tensor:
    """A local copy of ``rank``'s copy of ``src`` (a view of the staging buffer), by the copy engines."""
    got = torch.empty_like(src)
    symm.get(got, src, rank, group=comm, engine="copy")
    return got


def _topo_uneven(comm, out, inp, timeout):
    """The topology-aware all-gather on uneven packages (``gather_sources``), per piece of the shards:

    1. each rank copies its shard (the piece of it) into its slot of its staging buffer; barrier;
    2. across: each rank pulls, from their owners' staging buffers into its own, the shards it is the
       ``cross_target`` of (each shard crosses once per remote package, the receivers spread over the
       package's members); barrier;
    3. inside: each rank copies every shard into its output from the member of its package that holds
       it (itself included); barrier (nobody reads a staging buffer any more).
    """
    fn = "all_gather_into_tensor"
    w, me = comm.size, comm.rank
    x, y = inp.view(-1), out.view(-1)
    n, es = x.numel(), x.element_size()
    across, inside = gather_sources(comm.packages, me)
    per = max(1, _cap(comm, fn) // (w * es))
    stage = _stage(comm, w * min(n, per) * es, _cap(comm, fn), fn, x)
    order = [(me + t) % w for t in range(w)]  # from this rank on, so that the ranks start on different peers
    for s0, m in pieces(n, per):
        g = stage[: w * m * es].view(x.dtype)
        slot = lambda s: g[s * m:(s + 1) * m]  # noqa: E731 - shard s of this piece
        slot(me).copy_(x[s0:s0 + m])
        symm.barrier(comm, timeout=timeout)
        for s in order:
            if s in across:
                symm.get(slot(s), slot(s), s, group=comm, engine="copy")
        symm.barrier(comm, timeout=timeout)
        for s in order:
            dst, h = y[s * n + s0:s * n + s0 + m], inside[s]
            if h == me:
                dst.copy_(slot(s))
            else:
                symm.get(dst, slot(s), h, group=comm, engine="copy")
        symm.barrier(comm, timeout=timeout)


def _hierarchical_uneven(comm, x, op, timeout):
    """The hierarchical all-reduce on uneven packages, per piece of the buffer: the schedule of the CPU
    ``hierarchical`` (``xelink.collectives.cpu.all_reduce``), which the cost model prices.

    Member i of a package of k ranks holds span i of the piece cut k ways (``spans``). Staging: ``a`` (the
    input, later the result; x's dtype) and ``r`` (the package partials; float32 for half types).

    1. each rank copies its input into ``a``; barrier;
    2. inside: each rank reduces its span over its package's ``a`` (members in package order) into
       ``r``; barrier;
    3. across: each rank reads the other packages' partials of its span from the ranks whose spans
       overlap it (every element's partial enters every other package once), combines the packages'
       partials in package order (so every holder of an element computes the same bits) and writes the
       result into ``a``; barrier;
    4. inside: each rank copies every span from its holder in the package (itself included) into x;
       barrier (nobody reads a staging buffer any more).
    """
    fn = "all_reduce"
    packages, me = comm.packages, comm.rank
    me_p, _ = comm.package_index(me)
    members = packages[me_p]
    inner = "sum" if op == "avg" else op
    wd = work_dtype(x.dtype)
    flat = x.view(-1)
    count, es, ws = flat.numel(), x.element_size(), wd.itemsize
    cap = _cap(comm, fn)
    per = max(1, (cap - 16) // (es + ws))
    first = min(count, per)
    at = round16(first * es)  # r starts 16-byte aligned
    stage = _stage(comm, at + first * ws, cap, fn, x)
    for s0, m in pieces(count, per):
        a, r = stage[: m * es].view(x.dtype), stage[at:at + m * ws].view(wd)
        span = spans(packages, m)
        lo, hi = span[me]
        a.copy_(flat[s0:s0 + m])
        symm.barrier(comm, timeout=timeout)
        if hi > lo:
            for k, q in enumerate(members):
                part = a[lo:hi] if q == me else _pull(comm, a[lo:hi], q)
                if k == 0:
                    r[lo:hi].copy_(part)
                else:
                    combine(r[lo:hi], part, inner)
        symm.barrier(comm, timeout=timeout)
        if hi > lo:
            total = torch.empty(hi - lo, dtype=wd, device=x.device)
            for p, others in enumerate(packages):
                if p == me_p:
                    part = r[lo:hi]
                else:
                    part = torch.empty(hi - lo, dtype=wd, device=x.device)
                    for q in others:
                        u, v = max(lo, span[q][0]), min(hi, span[q][1])
                        if u < v:
                            symm.get(part[u - lo:v - lo], r[u:v], q, group=comm, engine="copy")
                if p == 0:
                    total.copy_(part)
                else:
                    combine(total, part, inner)
            if op == "avg":
                total.div_(comm.size)
            a[lo:hi].copy_(total)
        symm.barrier(comm, timeout=timeout)
        for q in members:
            u, v = span[q]
            if u == v:
                continue
            if q == me:
                flat[s0 + u:s0 + v].copy_(a[u:v])
            else:
                symm.get(flat[s0 + u:s0 + v], a[u:v], q, group=comm, engine="copy")
        symm.barrier(comm, timeout=timeout)

"""The distributed GEMM schedules on CUDA tensors, on the public peer-memory layer (``xelink.symm``), the
public collectives and ``xelink.kernels.gemm`` (``torch.matmul`` for float32/float64, which it lacks).

``all_gather_matmul``, pipelined and topo: this rank's shard is copied into its slot of a symmetric staging
buffer ``stage [n, *shard]`` on the current stream, which then signals (``symm.signal``, slot ``READY``)
every rank that reads it from here. A side stream waits for the current one, then for each shard of the
plan (``schedule.direct_plan``: shard r+s from its owner at step s; ``schedule.topo_plan``: the package's
shards from their owners, each remote shard across once and then from the member that fetched it) waits
for the holder's signal, pulls the shard into its own slot with the copy engines (``symm.get``,
``engine="copy"``), records an event, signals the holder that its memory was read (slot ``FREE``) and
signals the ranks it forwards the shard to. The current stream runs the GEMM of the own shard at once and
of each other shard after its event, into the shard's row block of the output (``gemm(out=block)``).
The side stream finally consumes a ``FREE`` signal for every read of this rank's memory, and the current
stream waits for it: when the call's work is done, nobody reads the staging buffer any more, so the next
call may overwrite it. No host synchronisation anywhere.

``matmul_reduce_scatter``: the partial of destination j is computed on the current stream into a local
buffer and pushed by the copy engines into slot r of j's symmetric inbox ``[n, *block]`` on the side
stream (then ``RS_READY``), while the next partial is computed; the own partial is computed into the own
slot last; after every ``RS_READY`` the slots are summed (float32 for half types) into the result, and
``RS_FREE`` tells each writer its slot was consumed. ``topo`` only orders the destinations (other
packages first, then the package) and does not sum inside the package before crossing as the CPU path
does: on one host's peer memory that saves no measured time yet, and it would add a second handshake.
``matmul_all_reduce``: row chunks, each GEMM on the current stream and its all-reduce
(``xelink.all_reduce``; ``topo``: the hierarchical algorithm on equal packages of several ranks, else
``auto``) on the side stream after an event.

``all_gather_matmul``, fused (issue 22): the same staging, semaphores and copy-engine reads, but the
GEMM is one persistent kernel over the whole gathered matrix (``xelink.kernels.gated_gemm``) whose tiles
wait for the flag of the shard their rows belong to; after each read lands, the side stream sets that
shard's flag (a 4-byte copy-engine copy, so no multiprocessor is needed while the GEMM holds them: the
kernel leaves one free for the semaphore kernels of the side stream). The own shard's flag is set on the
current stream after it is staged, tiles go out in the plan's order (own shard first), and the current
stream zeroes the flags after the GEMMs, so the next call (or graph replay) starts from zero. A late wait
marks the team's error word (the next call raises ``xelink.TimeoutError``). It needs half-precision
inputs and gathered rows in stage order (2-D, 3-D along dim 0, or along dim 1 with batch 1).

``matmul_reduce_scatter``, fused: ``xelink.kernels.scatter_gemm`` computes this rank's ``a @ b`` in one
persistent kernel, owner by owner from the next rank on, each tile stored into its owner's receive buffer
(slot [parity, this rank]) through peer memory and counted on the owner's chunk counter; then
``scatter_reduce`` waits for every rank's tiles of each chunk and sums them in rank order (float32,
rounded once: the same bits every run). Both kernels on the current stream; the epochs live on the device
and the two slots alternate, so no host reset, no handshake per call, and graph replays are new calls (the
kernel module's docstring says why a slot is never overwritten before its owner read it). The buffer, the
counters and the epochs are per (group, output block layout, N, dtype): the first call of such a shape
makes them (collective). ``matmul_all_reduce``, fused: that reduce-scatter of the rows, then
``all_gather_into_tensor``.

What it allocates: per (group, shape, dtype) one symmetric staging buffer (``xelink.symm.empty``, a
collective call made by the first call of that shape and kept as a resource of the group until it is
freed; the reuse rule is the ``FREE`` handshake above), one side stream per group; per call the output
(unless ``out=``), the local partials of the reduce-scatter, the sum, and ``return_gathered``'s copy,
all from torch's caching allocator (temporaries from the graph's private pool under capture, so replays
reuse them).

CUDA graphs: the first call of a shape sets up peer memory and the staging buffer and compiles the
semaphore kernels, which capture refuses, so run each shape once before capturing it (as for every
``xelink.symm`` user). Semaphore slots ``READY``..``RS_FREE`` of the group's team belong to these ops.
Eager calls that repeat a call's tensors replay a graph of the schedule (``graphs``: the host time of a
call is then one graph launch); the output is allocated before the schedule, outside any graph pool.
"""
from __future__ import annotations

import math

import torch

from .. import symm
from ..errors import XelinkError
from ..collectives import all_gather_into_tensor, all_reduce, reduce_scatter_tensor
from . import graphs, schedule
from .host import gathered
from ..kernels import gemm
from ..kernels import gated_gemm
from ..kernels import reduce_programs, scatter_gemm, scatter_geometry, scatter_reduce

__all__ = ["READY", "FREE", "RS_READY", "RS_FREE", "AR_CHUNKS", "side_stream", "stage_buffer", "unmet",
           "fused_unmet", "fused_scatter_unmet", "fused_all_reduce_unmet", "all_gather_matmul", "matmul_reduce_scatter",
           "matmul_all_reduce"]

READY, FREE, RS_READY, RS_FREE = 8, 9, 10, 11
AR_CHUNKS = 4
_HALF = (torch.float16, torch.bfloat16)


def unmet(comm, algo: str) -> str | None:
    """Why ``algo`` cannot run on CUDA tensors of ``comm`` (None: it can)."""
    if algo in ("pipelined", "topo", "fused") and not symm.available(comm):
        return (f"algo={algo!r} on CUDA tensors needs peer memory between the ranks (one host, at most "
                f"{symm.MAX_WORLD} ranks); use 'sequential'")
    return None


class _Side:
    """The group's side stream of these ops (a resource of the group)."""

    def __init__(self, device):
        self.stream = torch.cuda.Stream(device)


def side_stream(comm, device) -> torch.cuda.Stream:
    """The group's side stream on ``device``, shared by the distributed GEMM and context-parallel attention
    (their calls on one group are ordered on the caller's stream anyway)."""
    return comm.resource(("xelink.dist", "side", str(device)), lambda: _Side(device)).stream


def stage_buffer(comm, kind: str, shape: tuple, dtype) -> torch.Tensor:
    """The group's symmetric buffer for (kind, shape, dtype): made by the first call (collective), reused."""
    key = ("xelink.dist", kind, shape, str(dtype))
    found = comm.resource(key)
    if found is None:
        if torch.cuda.is_current_stream_capturing():
            raise XelinkError(f"{kind} buffer of shape {shape} ({dtype}) on {comm.name}: the first call of a shape "
                              f"allocates symmetric memory, which a CUDA graph capture cannot; run it once before "
                              f"capturing")
        found = comm.attach(key, symm.empty(shape, dtype=dtype, group=comm))
    return found


def _mm_into(x: torch.Tensor, w: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst = x @ w`` without a copy where it can: ``gemm`` into ``dst`` (a row block) for half types."""
    if dst.numel() == 0:
        return
    if x.shape[-1] == 0:
        dst.zero_()
        return
    if dst.dtype in _HALF and dst.stride(-1) == 1:
        if dst.dim() == 2:
            gemm(x, w, out=dst)
            return
        x2 = x.reshape(-1, x.shape[-1])
        try:
            d2 = dst.view(-1, dst.shape[-1])
        except RuntimeError:  # [B, s, N] block of a sequence-gathered output: one GEMM per batch row
            d2 = None
        if d2 is not None:
            gemm(x2, w, out=d2)
            return
        for i in range(dst.shape[0]):
            gemm(x[i], w, out=dst[i])
        return
    if dst.is_contiguous():
        torch.matmul(x, w, out=dst)
    else:
        dst.copy_(torch.matmul(x, w))


def _fwd(reads, me: int) -> dict:
    """shard -> the ranks that obtain it from this rank, in plan order."""
    out = {q: [] for q in range(len(reads))}
    for x in range(len(reads)):
        for q, src in reads[x]:
            if src == me:
                out[q].append(x)
    return out


class _Gather:
    """This rank's part of one (group, shard shape, dtype, algo, device) gather schedule, worked out by
    the first call and kept as a resource of the group: the staging buffer and a view of each slot, the
    ranks signalled once the own shard is staged, the shards read in order with their holder and the
    ranks each is forwarded to, the ``FREE`` signals to consume (one per read of this rank's memory), an
    event per read shard (re-recorded by every call: a stream waits for an event's latest record when the
    wait is enqueued, so reuse is safe) and the side stream."""

    def __init__(self, comm, shard: tuple, dtype, algo: str, dev):
        n, r = comm.size, comm.rank
        self.stage = stage_buffer(comm, "gather", (n,) + shard, dtype)
        self.slots = [self.stage[q] for q in range(n)]
        packages = comm.packages
        topo = algo == "topo" or (algo == "fused" and len(packages) > 1 and max(map(len, packages)) > 1)
        reads = schedule.topo_plan(packages) if topo else schedule.direct_plan(n)
        fwd = _fwd(reads, r)
        self.mine = fwd[r]
        self.reads = [(q, src, fwd[q], torch.cuda.Event()) for q, src in reads[r]]
        self.frees = [x for x in range(n) for _ in schedule.serves(reads, r, x)]
        self.side = side_stream(comm, dev)
        if algo == "fused":
            # flags [n] then the constant one: the side stream copies the one onto a shard's flag once it
            # landed; the current stream copies the zeros (the last n words) back after the GEMMs.
            self.words = torch.zeros(2 * n + 1, dtype=torch.int32, device=dev)
            self.words[n] = 1
            self.flags = self.words[:n]
            base = self.words.data_ptr()
            self.flag_at, self.one, self.zeros = [base + 4 * q for q in range(n)], base + 4 * n, base + 4 * (n + 1)
            self.order = [r] + [q for q, _ in reads[r]]
            self.team = symm.team_of(comm)


# Test hook: shard -> clock cycles the side stream sleeps before reading it (fused and pipelined), so
# that tests can hold one chunk back and check that no tile reads it early.
DELAY_CYCLES: dict = {}


def fused_unmet(a, dim) -> str | None:
    """Why ``algo="fused"`` cannot take this all-gather (None: it can)."""
    if a.dtype not in _HALF:
        return f"algo='fused' needs float16 or bfloat16 (a kernel GEMM), got {a.dtype}; use 'pipelined'"
    if any(s != 1 for s in a.shape[:dim]):
        return (f"algo='fused' needs the gathered rows in shard order (2-D, gather_dim=0, or batch 1), got shape "
                f"{tuple(a.shape)} with gather_dim={dim}; use 'pipelined'")
    return None


def _stage_and_read(comm, g, a, main, landed) -> None:
    """Stage the own shard on ``main`` and signal its readers; on the side stream, read every shard of
    the plan (``landed(q, event)`` right after shard q is in its slot), then free and forward it."""
    slots, side = g.slots, g.side
    slots[comm.rank].copy_(a)
    for x in g.mine:
        symm.signal(x, READY, group=comm, stream=main)
    side.wait_stream(main)  # the previous call's GEMMs are done with the slots (and its flags are zero)
    for q, src, to, event in g.reads:
        symm.wait(src, READY, group=comm, stream=side)
        if q in DELAY_CYCLES:
            with torch.cuda.stream(side):
                torch.cuda._sleep(DELAY_CYCLES[q])
        symm.get(slots[q], slots[q], src, group=comm, engine="copy", stream=side)
        landed(q, event)
        symm.signal(src, FREE, group=comm, stream=side)
        for x in to:
            symm.signal(x, READY, group=comm, stream=side)


def _release(comm, g, main) -> None:
    """Consume a ``FREE`` for every read of this rank's slot, and make ``main`` wait for the side stream."""
    for x in g.frees:
        symm.wait(x, FREE, group=comm, stream=g.side)
    main.wait_stream(g.side)


def _fused_gather(comm, g, a, weights, cs, main):
    n = comm.size
    rows = a.numel() // a.shape[-1]
    a2 = g.stage.view(n * rows, a.shape[-1])
    raw_side = g.side.cuda_stream
    _stage_and_read(comm, g, a, main, lambda q, _: symm.copy_engine(g.flag_at[q], g.one, 4, raw_side))
    symm.copy_engine(g.flag_at[comm.rank], g.one, 4, main.cuda_stream)  # the own shard: staged on main
    deadline = g.team.timeout_ns()
    for w, c in zip(weights, cs):
        c2 = c.view(n * rows, w.shape[1]) if c.is_contiguous() else None
        got = gated_gemm(a2, w, g.flags, chunk_rows=rows, order=g.order, out=c2, error=g.team.error,
                         timeout_ns=deadline)
        if c2 is None:
            c.copy_(got.view(c.shape))
    symm.copy_engine(g.flag_at[0], g.zeros, 4 * n, main.cuda_stream)
    _release(comm, g, main)


def _gather_schedule(comm, g, a, weights, cs, dim):
    """The pipelined/topo schedule: stage and read on the side stream, each shard's GEMM after its read."""
    main = torch.cuda.current_stream(a.device)
    slots, r = g.slots, comm.rank
    _stage_and_read(comm, g, a, main, lambda q, landed: landed.record(g.side))
    rows = a.shape[dim]
    for w, c in zip(weights, cs):
        _mm_into(slots[r], w, c.narrow(dim, r * rows, rows))
    for q, _, _, landed in g.reads:
        main.wait_event(landed)
        for w, c in zip(weights, cs):
            _mm_into(slots[q], w, c.narrow(dim, q * rows, rows))
    _release(comm, g, main)


def all_gather_matmul(comm, a, weights, dim, outs, algo, return_gathered):
    n, dev = comm.size, a.device
    shard = tuple(a.shape)
    full = list(shard)
    full[dim] *= n
    cs = [o if o is not None else a.new_empty(tuple(full[:-1]) + (w.shape[1],)) for w, o in zip(weights, outs)]
    if algo == "sequential":
        buf = a.new_empty((n,) + shard)
        all_gather_into_tensor(buf, a.contiguous(), group=comm)
        a_full = gathered(buf, dim)
        for w, c in zip(weights, cs):
            _mm_into(a_full, w, c)
        return (a_full if return_gathered else None), cs
    g = comm.resource(("xelink.dist", "gather-plan", shard, a.dtype, algo, dev),
                      lambda: _Gather(comm, shard, a.dtype, algo, dev))
    key = ("all_gather_matmul", algo, dim, a.dtype) + graphs.key_of(a, *weights, *cs)
    if algo == "fused":
        body = lambda: _fused_gather(comm, g, a, weights, cs, torch.cuda.current_stream(dev))  # noqa: E731
    else:
        body = lambda: _gather_schedule(comm, g, a, weights, cs, dim)  # noqa: E731
    graphs.run(comm, dev, "all_gather_matmul", key, body, hooked=bool(DELAY_CYCLES))
    return (gathered(g.stage, dim).clone() if return_gathered else None), cs


def _order(comm, algo: str) -> list[int]:
    """Destinations of the reduce-scatter partials, the own block last."""
    n, r = comm.size, comm.rank
    if algo != "topo":
        return [(r + s) % n for s in range(1, n)]
    packages = comm.packages
    p, i = schedule.package_index(packages, r)
    mine = packages[p]
    remote = [j for t in range(1, len(packages)) for j in packages[(p + t) % len(packages)]]
    return remote + [mine[(i + s) % len(mine)] for s in range(1, len(mine))]


class _Scatter:
    """This rank's part of one (group, block shape, dtype, algo, device) reduce-scatter schedule, kept as
    :class:`_Gather` is: the inbox, the view of this rank's slot in it, the destinations in order with an
    event each, the peers and the side stream."""

    def __init__(self, comm, shape: tuple, dtype, algo: str, dev):
        r = comm.rank
        self.inbox = stage_buffer(comm, "reduce", (comm.size,) + shape, dtype)
        self.mine = self.inbox[r]
        self.order = [(j, torch.cuda.Event()) for j in _order(comm, algo)]
        self.peers = [q for q in range(comm.size) if q != r]
        self.side = side_stream(comm, dev)


def fused_scatter_unmet(a) -> str | None:
    """Why ``algo="fused"`` cannot take this GEMM + reduce-scatter (None: it can)."""
    if a.dtype not in _HALF:
        return f"algo='fused' needs float16 or bfloat16 (a kernel GEMM), got {a.dtype}; use 'pipelined'"
    return None


def fused_all_reduce_unmet(a, n: int) -> str | None:
    """Why ``algo="fused"`` cannot take this GEMM + all-reduce (None: it can)."""
    why = fused_scatter_unmet(a)
    if why is None and math.prod(a.shape[:-1]) % n:
        why = (f"algo='fused' reduce-scatters the rows and gathers them back, so it needs the rows "
               f"(prod of a.shape[:-1] = {math.prod(a.shape[:-1])}) divisible by the group size {n}; use 'pipelined'")
    return why


def _scatter_layout(shape: tuple, dim: int, n: int) -> tuple[int, int, int, int]:
    """(blocks, block_rows, block_stride, batch_stride) of ``a`` viewed as ``[rows, K]``: a 2-D input or
    a scatter along dim 0 is one row block per owner; a scatter along the sequence of ``[B, S, K]`` is
    B sub-blocks of S/n rows per owner, S rows apart."""
    rows = math.prod(shape[:-1])
    if dim == 0:
        return 1, rows // n, rows // n, 0
    s = shape[1] // n
    return shape[0], s, s, shape[1]


class _FusedScatter:
    """The fused reduce-scatter's state for one (group, block layout, N, dtype, device), kept as a resource
    of the group: this rank's receive buffer ``[2, n, rows, N]`` and chunk counters (symmetric memory),
    every rank's views of both, and the local epochs of the reduction (``xelink.kernels.scatter_gemm``'s
    docstring: why two slots and the epochs make reuse and graph replays safe without a host reset).
    Keyed by what fixes the chunk geometry, not by K, so calls of one output shape share the buffer and
    its epochs."""

    def __init__(self, comm, blocks: int, block_rows: int, n_cols: int, dtype, dev):
        if torch.cuda.is_current_stream_capturing():
            raise XelinkError(f"matmul_reduce_scatter (fused) on {comm.name}: the first call of a shape allocates "
                              f"symmetric memory, which a CUDA graph capture cannot; run it once before capturing")
        n = comm.size
        geo = scatter_geometry(n, blocks, block_rows, n_cols)
        self.inbox = symm.empty((2, n, blocks * block_rows, n_cols), dtype=dtype, group=comm)
        self.counters = symm.empty((n * geo.chunks,), dtype=torch.int32, group=comm)
        self.counters.zero_()
        self.seen = torch.zeros(reduce_programs(dev), dtype=torch.int32, device=dev)
        self.inboxes = [symm.peer_tensor(self.inbox, q, group=comm) for q in range(n)]
        self.counter_views = [symm.peer_tensor(self.counters, q, group=comm) for q in range(n)]
        self.team = symm.team_of(comm)
        torch.cuda.synchronize(dev)  # every rank's counters are zero before any peer adds to them
        comm.barrier()


def _fused_scatter(comm, a, w, dim, op, res) -> None:
    """The fused GEMM + reduce-scatter of ``a @ w`` into ``res`` (this rank's block)."""
    n, r = comm.size, comm.rank
    K, N = a.shape[-1], w.shape[1]
    blocks, block_rows, block_stride, batch_stride = _scatter_layout(tuple(a.shape), dim, n)
    rows = blocks * block_rows
    if rows == 0 or N == 0:
        return
    st = comm.resource(("xelink.dist", "fused-scatter", blocks, block_rows, N, a.dtype, a.device),
                       lambda: _FusedScatter(comm, blocks, block_rows, N, a.dtype, a.device))
    st.team.check("matmul_reduce_scatter")  # a deadline that expired in an earlier call raises here
    a2 = a.reshape(-1, K)
    scatter_gemm(a2, w, st.inboxes, st.counter_views, st.seen, rank=r, blocks=blocks, block_rows=block_rows,
                 block_stride=block_stride, batch_stride=batch_stride)
    try:
        r2 = res.view(rows, N)
    except RuntimeError:  # an out whose rows are not one strided run: reduce into a temporary
        r2 = None
    got = scatter_reduce(st.inbox, st.counters, st.seen, r2 if r2 is not None else a.new_empty((rows, N)),
                         error=st.team.error, blocks=blocks, block_rows=block_rows, avg=op == "avg",
                         timeout_ns=st.team.timeout_ns())
    if r2 is None:
        res.copy_(got.view(res.shape))


def _scatter_schedule(comm, g, a, w, dim, op, res) -> None:
    """The pipelined/topo reduce-scatter: each destination's partial pushed on the side stream while the
    next one is computed, the own partial last, then the sum of the inbox into ``res``."""
    n, r = comm.size, comm.rank
    blk = a.shape[dim] // n
    main, side = torch.cuda.current_stream(a.device), g.side
    parts = a.new_empty((n,) + tuple(res.shape))
    side.wait_stream(main)
    for j, done in g.order:
        part = parts[j]
        _mm_into(a.narrow(dim, j * blk, blk), w, part)
        done.record(main)
        side.wait_event(done)
        symm.put(g.mine, part, j, group=comm, engine="copy", stream=side)
        symm.signal(j, RS_READY, group=comm, stream=side)
    _mm_into(a.narrow(dim, r * blk, blk), w, g.mine)
    for q in g.peers:
        symm.wait(q, RS_READY, group=comm, stream=main)
    acc = g.inbox.sum(0, dtype=torch.float32 if a.dtype in _HALF else a.dtype)
    if op == "avg":
        acc.div_(n)
    for q in g.peers:
        symm.signal(q, RS_FREE, group=comm, stream=main)
        symm.wait(q, RS_FREE, group=comm, stream=side)
    main.wait_stream(side)
    res.copy_(acc)


def matmul_reduce_scatter(comm, a, w, dim, op, out, algo):
    n, dev = comm.size, a.device
    blk = a.shape[dim] // n
    shape = list(a.shape[:-1]) + [w.shape[1]]
    shape[dim] = blk
    shape = tuple(shape)
    if algo == "sequential":
        p = a.new_empty(tuple(a.shape[:-1]) + (w.shape[1],))
        _mm_into(a, w, p)
        blocks = p if dim == 0 else p.unflatten(dim, (n, blk)).movedim(dim, 0).contiguous()
        res = out if out is not None and out.is_contiguous() else a.new_empty(shape)
        reduce_scatter_tensor(res, blocks, op=op, group=comm)
        return res if out is None or res is out else out.copy_(res)
    res = out if out is not None else a.new_empty(shape)
    key = ("matmul_reduce_scatter", algo, dim, op, a.dtype) + graphs.key_of(a, w, res)
    if algo == "fused":
        body = lambda: _fused_scatter(comm, a, w, dim, op, res)  # noqa: E731
    else:
        g = comm.resource(("xelink.dist", "scatter-plan", shape, a.dtype, algo, dev),
                          lambda: _Scatter(comm, shape, a.dtype, algo, dev))
        body = lambda: _scatter_schedule(comm, g, a, w, dim, op, res)  # noqa: E731
    graphs.run(comm, dev, "matmul_reduce_scatter", key, body)
    return res


def _all_reduce_schedule(comm, a, w, c, out, algo) -> None:
    """``c = a @ w`` summed over the ranks (then copied into ``out`` if that is another tensor)."""
    dev = a.device
    rows = math.prod(a.shape[:-1])
    a2, c2 = a.reshape(rows, a.shape[-1]), c.view(rows, w.shape[1])
    if algo == "fused":
        # The fused reduce-scatter of the rows, then xelink's all-gather of the blocks back into c.
        mine = a.new_empty((rows // comm.size, w.shape[1]))
        _fused_scatter(comm, a2, w, 0, "sum", mine)
        all_gather_into_tensor(c2, mine, group=comm)
    else:
        packages = comm.packages
        # The GPU hierarchical all-reduce runs on equal packages; packages of one rank have nothing to gain.
        even = len(packages) > 1 and len({len(p) for p in packages}) == 1 and len(packages[0]) > 1
        name = "hierarchical" if algo == "topo" and even else "auto"
        main, side = torch.cuda.current_stream(dev), side_stream(comm, dev)
        chunks = max(1, min(AR_CHUNKS, rows))
        base, extra = divmod(rows, chunks)
        lo = 0
        for k in range(chunks):
            hi = lo + base + (1 if k < extra else 0)
            if hi > lo:
                _mm_into(a2[lo:hi], w, c2[lo:hi])
                done = torch.cuda.Event()
                done.record(main)
                side.wait_event(done)
                with torch.cuda.stream(side):
                    all_reduce(c2[lo:hi], group=comm, algo=name)
            lo = hi
        main.wait_stream(side)
    if out is not None and c is not out:
        out.copy_(c)


def matmul_all_reduce(comm, a, w, out, algo):
    dev = a.device
    shape = tuple(a.shape[:-1]) + (w.shape[1],)
    c = out if out is not None and out.is_contiguous() else torch.empty(shape, dtype=a.dtype, device=dev)
    if algo == "sequential":
        _mm_into(a, w, c)
        all_reduce(c, group=comm)
        return c if out is None or c is out else out.copy_(c)
    key = ("matmul_all_reduce", algo, a.dtype) + graphs.key_of(a, w, c, *([] if out is None else [out]))
    graphs.run(comm, dev, "matmul_all_reduce", key, lambda: _all_reduce_schedule(comm, a, w, c, out, algo))
    return c if out is None else out

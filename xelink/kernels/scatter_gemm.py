"""``scatter_gemm`` and ``scatter_reduce``: the fused GEMM + reduce-scatter's two kernels (issue 22).

``scatter_gemm`` is one persistent GEMM over this rank's ``a @ b`` whose output rows belong to the ranks:
owner ``j`` gets ``blocks`` sub-blocks of ``block_rows`` rows each (sub-block ``u`` of owner ``j`` is rows
``j * block_stride + u * batch_stride`` onwards: a 2-D row block, or a 3-D input's sequence block of each
batch row). Each finished tile is stored straight into owner ``j``'s receive buffer ``inboxes[j]``
(``[2, world, blocks * block_rows, N]``, peer memory) at slot ``[parity, rank]``, and then this rank
release-adds one to owner ``j``'s counter ``counters[j][rank * chunks + chunk]`` (system scope, after a
block barrier, so every thread's stores to the peer come first). A chunk is ``BLOCK_M`` rows of one
sub-block, all its column tiles. Tiles go out owner by owner starting with ``rank + 1``, the own block
last, so the ranks do not all write to one owner at once and the own rows (no link to cross) finish last.

``scatter_reduce`` is the owner's side: a program per group of rows waits (acquire, with a deadline) until
every rank's counter of the chunk reached this call's target, then sums the ``world`` partials of slot
``parity`` in rank order 0..world-1 in float32 (deterministic: the same bits on every run) and writes
``out`` (times ``scale`` for an average), rounded once.

Epochs and parity (why nothing needs a host reset, and why graph replays are new calls): the reducer's
programs each count the calls they finished in ``seen[pid]`` (local, int32; all equal between calls);
call ``e`` (0-based) waits for ``(e + 1) * tiles_per_chunk`` (wrap-safe) on counters that only grow, and
reads slot ``e & 1``; the producer reads ``seen[0] & 1`` at its start, which its own stream ordered after
the previous reduction. Two slots suffice: rank ``s`` writes call ``e + 2`` into owner ``j``'s slot
``e & 1`` only after its reduction of call ``e + 1`` saw ``j``'s tiles of call ``e + 1``, which ``j``
computed after its own reduction of call ``e`` (stream order), so the slot was read. This needs every
rank to send every owner at least one tile a call (a non-empty problem, the same on every rank) and the
two kernels of every call on one stream in order. Counters and ``seen`` start at zero (the caller zeroes
the counters and waits for every rank before the first call).

Deadlines: a late wait marks the error word (``error[0] = 1``, ``error[1 + source] = 1``) and reads the
rows anyway (garbage); ``xelink.symm``'s error word makes the next call raise ``xelink.TimeoutError``.

Two producers: ``impl="cuda"`` (sm90: TMA loads, ``gemm``'s tiles) and ``impl="triton"`` (portable block
pointers, covered by the Intel compile check). Both store through plain pointers: the owners' buffers are
peer memory, passed as ``I0..I7`` (one argument each, so Triton specializes each on 16-byte alignment).
"""
from __future__ import annotations

import dataclasses

import torch

from ..symm.device import notify, pick
from .common import (Paths, cdiv, check_impl, check_same_device, check_tensor, forward_only, interpreting, path_key,
                     require_triton, sm_count, tl, triton)
from .gated_gemm import _check_operands
from .gemm import _gemm_config, _orientation, _tma_applies, _tma_view
from .launcher import Descriptor, Slot, launch_keyed, launch_plan

__all__ = ["SCATTER_GEMM_IMPLS", "ScatterGeometry", "scatter_geometry", "scatter_gemm", "scatter_reduce",
           "reduce_programs", "reference_scatter_reduce"]

SCATTER_GEMM_IMPLS = ("auto", "triton", "cuda")
_MAX_WORLD = 8
_REDUCE_ROWS = 32     # rows of one reduction item (a chunk of BLOCK_M rows is BLOCK_M / 32 items)
_REDUCE_COLS = 256
_NEVER = 1 << 62


if triton is not None:  # the jitted helpers of gemm and gated_gemm exist only where Triton does
    from .gated_gemm import _await_count
    from .gemm import _block_tile, _grouped_tile, _store_tile, _tma_tile

    @triton.jit
    def _owner_tile(tile, per_owner, mt, num_n, RANK: tl.constexpr, WORLD: tl.constexpr, GROUP_M: tl.constexpr):
        """(owner, sub-block, m-tile in it, n-tile) of ``tile``: owners from RANK + 1 on, the own one last."""
        step = tile // per_owner
        owner = (RANK + 1 + step) % WORLD
        lm_all, pid_n = _grouped_tile(tile % per_owner, per_owner // num_n, num_n, GROUP_M)
        return owner, lm_all // mt, lm_all % mt, pid_n

    @triton.jit
    def _deliver(acc, owner, u, lm, off_n, parity, I0, I1, I2, I3, I4, I5, I6, I7, C0, C1, C2, C3, C4, C5, C6, C7,
                 N, block_rows, chunks, mt, BLOCKS: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Store the tile into ``owner``'s slot [parity, RANK], then count it on the owner's chunk counter."""
        rows = BLOCKS * block_rows
        slot = ((parity * WORLD + RANK) * rows + u * block_rows).to(tl.int64) * N
        for p in tl.static_range(WORLD):
            if p == owner:  # one branch per rank: each peer pointer keeps its own alignment specialization
                _store_tile(pick(p, I0, I1, I2, I3, I4, I5, I6, I7) + slot, acc, block_rows, N, N, 1, lm * BLOCK_M,
                            off_n, BLOCK_M, BLOCK_N)
                notify(pick(p, C0, C1, C2, C3, C4, C5, C6, C7) + RANK * chunks + u * mt + lm)

    @triton.jit
    def _scatter_gemm_kernel(a_ptr, b_ptr, I0, I1, I2, I3, I4, I5, I6, I7, C0, C1, C2, C3, C4, C5, C6, C7, SEEN,
                             M, N, K, stride_am, stride_ak, stride_bk, stride_bn, block_rows, block_stride, batch_stride,
                             RANK: tl.constexpr, WORLD: tl.constexpr, BLOCKS: tl.constexpr,
                             A_ROW_MAJOR: tl.constexpr, B_ROW_MAJOR: tl.constexpr, EVEN: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
        parity = tl.load(SEEN) & 1
        mt = tl.cdiv(block_rows, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        per_owner = BLOCKS * mt * num_n
        for tile in range(tl.program_id(0), WORLD * per_owner, NUM_PROGRAMS):
            owner, u, lm, pid_n = _owner_tile(tile, per_owner, mt, num_n, RANK, WORLD, GROUP_M)
            off_m = owner * block_stride + u * batch_stride + lm * BLOCK_M
            off_n = pid_n * BLOCK_N
            acc = _block_tile(a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, off_m, off_n,
                              A_ROW_MAJOR, B_ROW_MAJOR, EVEN, BLOCK_M, BLOCK_N, BLOCK_K)
            _deliver(acc, owner, u, lm, off_n, parity, I0, I1, I2, I3, I4, I5, I6, I7, C0, C1, C2, C3, C4, C5, C6, C7,
                     N, block_rows, BLOCKS * mt, mt, BLOCKS, RANK, WORLD, BLOCK_M, BLOCK_N)

    @triton.jit
    def _scatter_gemm_tma_kernel(a_desc, b_desc, I0, I1, I2, I3, I4, I5, I6, I7, C0, C1, C2, C3, C4, C5, C6, C7, SEEN,
                                 N, K, block_rows, block_stride, batch_stride,
                                 RANK: tl.constexpr, WORLD: tl.constexpr, BLOCKS: tl.constexpr,
                                 A_ROW_MAJOR: tl.constexpr, B_ROW_MAJOR: tl.constexpr,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
        parity = tl.load(SEEN) & 1
        mt = tl.cdiv(block_rows, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        per_owner = BLOCKS * mt * num_n
        for tile in tl.range(tl.program_id(0), WORLD * per_owner, NUM_PROGRAMS):
            owner, u, lm, pid_n = _owner_tile(tile, per_owner, mt, num_n, RANK, WORLD, GROUP_M)
            # A tile past its sub-block's last row reads the next rows (or TMA's zeros past M): never stored.
            off_m = owner * block_stride + u * batch_stride + lm * BLOCK_M
            off_n = pid_n * BLOCK_N
            acc = _tma_tile(a_desc, b_desc, off_m, off_n, K, A_ROW_MAJOR, B_ROW_MAJOR, BLOCK_M, BLOCK_N, BLOCK_K)
            _deliver(acc, owner, u, lm, off_n, parity, I0, I1, I2, I3, I4, I5, I6, I7, C0, C1, C2, C3, C4, C5, C6, C7,
                     N, block_rows, BLOCKS * mt, mt, BLOCKS, RANK, WORLD, BLOCK_M, BLOCK_N)

    @triton.jit
    def _scatter_reduce_kernel(IN, CNT, SEEN, ERR, out_ptr, N, block_rows, stride_om, stride_on, tiles_per_chunk,
                               timeout_ns, scale, WORLD: tl.constexpr, BLOCKS: tl.constexpr, CHUNK_ROWS: tl.constexpr,
                               ROWS: tl.constexpr, BLOCK_N: tl.constexpr, AVG: tl.constexpr,
                               NUM_PROGRAMS: tl.constexpr, TIMER: tl.constexpr):
        pid = tl.program_id(0)
        e = tl.load(SEEN + pid)
        parity = e & 1
        target = (e + 1) * tiles_per_chunk
        mt = tl.cdiv(block_rows, CHUNK_ROWS)
        chunks = BLOCKS * mt
        split = CHUNK_ROWS // ROWS
        slot_rows = BLOCKS * block_rows
        for item in range(pid, chunks * split, NUM_PROGRAMS):
            chunk = item // split
            for who in range(WORLD):
                _await_count(CNT + who * chunks + chunk, target, ERR, who, timeout_ns, TIMER)
            tl.debug_barrier()  # the waits' acquires happen before every thread's loads below
            u = chunk // mt
            local = (chunk % mt) * CHUNK_ROWS + (item % split) * ROWS + tl.arange(0, ROWS)
            row = u * block_rows + local
            live = local < block_rows
            for n0 in range(0, N, BLOCK_N):
                cols = n0 + tl.arange(0, BLOCK_N)
                m = live[:, None] & (cols[None, :] < N)
                acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
                for src in tl.static_range(WORLD):  # rank order: the same sum on every run
                    at = ((parity * WORLD + src) * slot_rows + row).to(tl.int64) * N
                    acc += tl.load(IN + at[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
                if AVG:
                    acc = acc * scale
                dst = out_ptr + row.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
                tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=m)
        tl.store(SEEN + pid, e + 1)


@dataclasses.dataclass(frozen=True)
class ScatterGeometry:
    """How the two kernels cut one problem (the same on every rank and for every call of a buffer):
    ``chunk_rows`` (the GEMM's BLOCK_M), ``tiles_per_chunk`` (column tiles), ``chunks`` per owner."""

    chunk_rows: int
    tiles_per_chunk: int
    chunks: int
    config: dict


def scatter_geometry(world: int, blocks: int, block_rows: int, n_cols: int) -> ScatterGeometry:
    """The geometry of a problem of ``world`` owners, each ``blocks`` sub-blocks of ``block_rows`` rows,
    ``n_cols`` columns: a function of these alone (not of K or the strides), so a buffer's counters keep
    one meaning across calls."""
    cfg = _gemm_config(world * blocks * block_rows, n_cols, 1)
    return ScatterGeometry(cfg["BLOCK_M"], cdiv(n_cols, cfg["BLOCK_N"]), blocks * cdiv(block_rows, cfg["BLOCK_M"]),
                           cfg)


def reference_scatter_reduce(partials, op: str = "sum") -> torch.Tensor:
    """What the fused reduce-scatter computes for one owner: ``partials`` ``[world, rows, N]`` (each rank's
    rows of this owner, rounded to their dtype) summed in rank order in float32, rounded once."""
    acc = torch.zeros(partials.shape[1:], dtype=torch.float32, device=partials.device)
    for p in partials:
        acc += p.float()
    if op == "avg":
        acc *= 1.0 / partials.shape[0]
    return acc.to(partials.dtype)


def _int(fn, name, v, lo=0):
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{fn}: {name}={v!r} must be an int >= {lo}")
    return v


def _check_buffers(fn, inboxes, counters, world, rows, n_cols, dtype, chunks):
    for j, (ib, ct) in enumerate(zip(inboxes, counters)):
        check_tensor(fn, f"inboxes[{j}]", ib)
        check_tensor(fn, f"counters[{j}]", ct)
        if tuple(ib.shape) != (2, world, rows, n_cols) or ib.dtype != dtype or not ib.is_contiguous():
            raise ValueError(f"{fn}: inboxes[{j}] must be a contiguous {dtype} [2, {world}, {rows}, {n_cols}] "
                             f"tensor, got {ib.dtype} {tuple(ib.shape)}")
        if ct.dtype != torch.int32 or ct.numel() < world * chunks or not ct.is_contiguous():
            raise ValueError(f"{fn}: counters[{j}] must be contiguous int32 with at least {world * chunks} entries "
                             f"(world x chunks), got {ct.dtype} with {ct.numel()}")


def _check_seen(fn, seen, programs):
    check_tensor(fn, "seen", seen)
    if seen.dtype != torch.int32 or seen.numel() < programs or not seen.is_contiguous():
        raise ValueError(f"{fn}: seen must be contiguous int32 with at least {programs} entries (one per reduction "
                         f"program), got {seen.dtype} with {seen.numel()}")


def reduce_programs(device: torch.device) -> int:
    """The reduction kernel's programs (and so ``seen``'s length): the multiprocessors."""
    return sm_count(device) if device.type == "cuda" else 4


class _Produce:
    __slots__ = ("fn", "grid", "views", "ints", "kwargs", "slot")

    def __init__(self, a, b, world, rank, blocks, block_rows, block_stride, batch_stride, impl, programs, geo):
        (M, K), N = a.shape, b.shape[1]
        cfg = geo.config
        bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
        tiles = world * blocks * cdiv(block_rows, bm) * cdiv(N, bn)
        if programs is None:
            programs = sm_count(a.device) if a.is_cuda else 4
        programs = max(1, min(programs, tiles))
        self.grid = (programs,)
        a_row, b_row = _orientation(a), _orientation(b)
        common = dict(RANK=rank, WORLD=world, BLOCKS=blocks, NUM_PROGRAMS=programs, **cfg)
        if impl == "cuda":
            self.fn = _scatter_gemm_tma_kernel
            self.views = (_tma_view(a) + ((bm, bk) if a_row else (bk, bm),),
                          _tma_view(b) + ((bk, bn) if b_row else (bn, bk),))
            self.ints = (N, K, block_rows, block_stride, batch_stride)
            self.kwargs = dict(A_ROW_MAJOR=bool(a_row), B_ROW_MAJOR=bool(b_row), **common)
        else:
            self.fn, self.views = _scatter_gemm_kernel, None
            self.ints = (M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), block_rows, block_stride,
                         batch_stride)
            even = block_rows % bm == 0 and N % bn == 0 and K % bk == 0
            self.kwargs = dict(A_ROW_MAJOR=a_row is not False, B_ROW_MAJOR=b_row is not False, EVEN=even, **common)
        self.slot = Slot(self.fn)

    def __call__(self, a, b, inboxes, counters, seen):
        # The addresses are all that may differ from call to call (the peers' count is the plan's).
        key = (a.data_ptr(), b.data_ptr(), seen.data_ptr(), *[t.data_ptr() for t in inboxes],
               *[t.data_ptr() for t in counters])
        launch_keyed(self.slot, key, self.grid, lambda: self._args(a, b, inboxes, counters, seen), self.kwargs)

    def _args(self, a, b, inboxes, counters, seen) -> tuple:
        pad = (None,) * (_MAX_WORLD - len(inboxes))
        if self.views is None:
            head = (a, b)
        else:
            head = (Descriptor(a, *self.views[0]), Descriptor(b, *self.views[1]))
        return (*head, *inboxes, *pad, *counters, *pad, seen, *self.ints)


_PRODUCE = Paths()


def scatter_gemm(a: torch.Tensor, b: torch.Tensor, inboxes, counters, seen: torch.Tensor, *, rank: int,
                 blocks: int = 1, block_rows: int, block_stride: int, batch_stride: int = 0, impl: str = "auto",
                 programs: int | None = None) -> None:
    """Compute this rank's ``a @ b`` tile by tile into the owners' buffers (module docstring).

    Args:
        a: ``[M, K]`` bf16/fp16 (row- or column-major); owner ``j``'s sub-block ``u`` is rows
            ``j * block_stride + u * batch_stride`` to ``+ block_rows``, inside ``a``.
        b: ``[K, N]``, same dtype and device.
        inboxes: one ``[2, world, blocks * block_rows, N]`` contiguous tensor per rank (peer views), rank order.
        counters: one int32 tensor of ``>= world * chunks`` entries per rank (``scatter_geometry``).
        seen: this rank's reduction epochs (``scatter_reduce``'s); only ``seen[0]`` is read.
        rank: this rank (< world = len(inboxes) <= 8).
        blocks, block_rows, block_stride, batch_stride: the row layout above.
        impl: ``"auto"`` (TMA where it applies), ``"cuda"``, ``"triton"``.
        programs: persistent programs (default: the multiprocessors).
    """
    fn = "scatter_gemm"
    world = len(inboxes) if isinstance(inboxes, (list, tuple)) else -1
    key = path_key((impl, rank, world, blocks, block_rows, block_stride, batch_stride, programs), (a, b, seen),
                   tuple(inboxes) + tuple(counters)) if world > 0 else None
    plan = _PRODUCE.get(key) if key is not None else None
    if plan is None:
        impl = forward_only(fn, check_impl(fn, impl, SCATTER_GEMM_IMPLS), has_reference=False, a=a, b=b)
        _check_operands(fn, a, b)
        if not 1 <= world <= _MAX_WORLD or not isinstance(counters, (list, tuple)) or len(counters) != world:
            raise ValueError(f"{fn}: inboxes and counters must be lists of one tensor per rank (1 to {_MAX_WORLD})")
        _int(fn, "rank", rank)
        if rank >= world:
            raise ValueError(f"{fn}: rank={rank} is not below the world size {world}")
        for name, v in (("blocks", blocks), ("block_rows", block_rows)):
            _int(fn, name, v, 1)
        _int(fn, "block_stride", block_stride)
        _int(fn, "batch_stride", batch_stride)
        if programs is not None:
            _int(fn, "programs", programs, 1)
        last = (world - 1) * block_stride + (blocks - 1) * batch_stride + block_rows
        if last > a.shape[0]:
            raise ValueError(f"{fn}: the last sub-block ends at row {last}, past a.shape[0]={a.shape[0]}")
        N = b.shape[1]
        geo = scatter_geometry(world, blocks, block_rows, N)
        _check_buffers(fn, inboxes, counters, world, blocks * block_rows, N, a.dtype, geo.chunks)
        check_tensor(fn, "seen", seen)
        if seen.dtype != torch.int32 or seen.numel() < 1:
            raise ValueError(f"{fn}: seen must be int32 with at least one entry, got {seen.dtype} with {seen.numel()}")
        check_same_device(fn, a=a, b=b, seen=seen)
        if impl == "auto":
            impl = "cuda" if _tma_applies(a, b) else "triton"
        require_triton(fn, impl, a.device)
        if impl == "cuda" and not _tma_applies(a, b):
            raise ValueError(f"{fn}: impl='cuda' needs sm90 and TMA's 16-byte alignment of a and b "
                             f"(a.stride()={a.stride()}, b.stride()={b.stride()}); use impl='triton'")
        if a.shape[0] == 0 or N == 0:
            return
        plan = _Produce(a, b, world, rank, blocks, block_rows, block_stride, batch_stride, impl, programs, geo)
        if key is not None:
            _PRODUCE.remember(key, plan)
    plan(a, b, inboxes, counters, seen)


class _Reduce:
    __slots__ = ("grid", "ints", "kwargs", "slot")

    def __init__(self, inbox, out, blocks, block_rows, geo, avg, programs, device):
        world, N = inbox.shape[1], inbox.shape[3]
        self.grid = (programs,)
        self.ints = (N, block_rows, out.stride(0), out.stride(1), geo.tiles_per_chunk)
        timer = device.type == "cuda" and not interpreting()
        self.kwargs = dict(WORLD=world, BLOCKS=blocks, CHUNK_ROWS=geo.chunk_rows,
                           ROWS=min(_REDUCE_ROWS, geo.chunk_rows), BLOCK_N=_REDUCE_COLS, AVG=bool(avg),
                           NUM_PROGRAMS=programs, TIMER=timer, num_warps=4)
        self.slot = Slot(_scatter_reduce_kernel)

    def __call__(self, inbox, counters, seen, error, out, timeout_ns, scale):
        launch_plan(self.slot, _scatter_reduce_kernel, self.grid,
                    (inbox, counters, seen, error, out, *self.ints, timeout_ns, scale), self.kwargs)


_REDUCE = Paths()


def scatter_reduce(inbox: torch.Tensor, counters: torch.Tensor, seen: torch.Tensor, out: torch.Tensor, *,
                   error: torch.Tensor, blocks: int = 1, block_rows: int, avg: bool = False,
                   timeout_ns: int | None = None) -> torch.Tensor:
    """The owner's side: wait for every rank's tiles of each chunk, sum them in rank order, write ``out``.

    Args:
        inbox: this rank's ``[2, world, blocks * block_rows, N]`` receive buffer (half precision).
        counters: this rank's int32 counters (``world * chunks`` entries), which the producers add to.
        seen: int32 ``[>= reduce_programs(device)]`` local epochs, zero before the first call, never reset.
        out: ``[blocks * block_rows, N]`` (unit stride along N not required), the inbox's dtype.
        error: contiguous int32 ``[>= 1 + world]`` (device or pinned host) the late waits mark.
        blocks, block_rows: as ``scatter_gemm``'s.
        avg: divide the sum by the world size.
        timeout_ns: each wait's deadline (None: none).

    Returns:
        ``out``.
    """
    fn = "scatter_reduce"
    # timeout_ns by value: it decides the class Triton specializes it on, which the launcher slot relies on
    key = path_key((blocks, block_rows, bool(avg), timeout_ns), (inbox, counters, seen, error, out))
    plan = _REDUCE.get(key) if key is not None else None
    if plan is None:
        check_tensor(fn, "inbox", inbox, 4)
        check_tensor(fn, "out", out, 2)
        _int(fn, "blocks", blocks, 1)
        _int(fn, "block_rows", block_rows, 1)
        world, rows, N = inbox.shape[1], inbox.shape[2], inbox.shape[3]
        if inbox.shape[0] != 2 or rows != blocks * block_rows or not inbox.is_contiguous() or \
                inbox.dtype not in (torch.bfloat16, torch.float16) or not 1 <= world <= _MAX_WORLD:
            raise ValueError(f"{fn}: inbox must be a contiguous half-precision [2, world<=8, {blocks * block_rows}, N] "
                             f"tensor, got {inbox.dtype} {tuple(inbox.shape)}")
        if tuple(out.shape) != (rows, N) or out.dtype != inbox.dtype:
            raise ValueError(f"{fn}: out must be {inbox.dtype} [{rows}, {N}], got {out.dtype} {tuple(out.shape)}")
        geo = scatter_geometry(world, blocks, block_rows, N)
        _check_buffers(fn, [inbox], [counters], world, rows, N, inbox.dtype, geo.chunks)
        programs = reduce_programs(inbox.device)
        _check_seen(fn, seen, programs)
        if error is None or not isinstance(error, torch.Tensor) or error.dtype != torch.int32 or \
                error.numel() < 1 + world or not error.is_contiguous():
            raise ValueError(f"{fn}: error must be a contiguous int32 tensor of at least {1 + world} entries, "
                             f"got {error!r:.80}")
        if timeout_ns is not None:
            _int(fn, "timeout_ns", timeout_ns, 1)
        check_same_device(fn, inbox=inbox, counters=counters, seen=seen, out=out)
        require_triton(fn, "triton", inbox.device)
        if rows == 0 or N == 0:
            return out
        plan = _Reduce(inbox, out, blocks, block_rows, geo, avg, programs, inbox.device)
        if key is not None:
            _REDUCE.remember(key, plan)
    plan(inbox, counters, seen, error, out, _NEVER if timeout_ns is None else timeout_ns,
         1.0 / inbox.shape[1])
    return out

"""``gated_gemm``: ``c = a @ b`` in one persistent kernel whose tiles wait for their rows of ``a`` to land.

The rows of ``a`` come in chunks of ``chunk_rows`` (the last may be shorter), and each chunk in ``k_slices``
column slices (``column_slices``: slice ``s`` is columns ``[s * K // k_slices, (s + 1) * K // k_slices)``) that
land in order; ``flags[q]`` counts the slices of chunk ``q`` that have landed (with one slice: 0, then 1).
Whoever fills a slice (a copy-engine copy on another stream, a peer's write, a kernel) sets its chunk's flag
to the slice's number + 1 after the data, in stream or memory order; a tile of the kernel polls the flags of
the chunks its rows span (acquires at system scope) before it reads the columns of a slice. Tiles are
handed out in the order the chunks are expected to land (``order``), so the first tiles are those of the
chunks already there. This is the fused all-gather + GEMM of ``xelink.dist`` (issue 22): one launch for
the whole gathered matrix instead of one GEMM per chunk, with no kernel boundary between chunks.

Why column slices: a tile reads all of K of its rows, so with whole row chunks the first wave of tiles
needs as many chunks as its rows span (at 2048x4096x4096 with 8 chunks, 5 of them) before it runs at full
width. Slices of every chunk's columns let every tile start on the first slice and read the next ones as
they land, so the copy hides under the GEMM from the first slice on.

Rules for callers:

- **Flags** are int32, one per chunk, zero before the call; the kernel never writes them. A chunk's slices
  land in order (a flag only grows within a call). Reset them
  after the call, ordered after it (a stream-ordered ``zero_`` or a copy of zeros on the kernel's stream)
  and before the producers of the next call set them; a graph replays that the same way.
- **Programs.** The kernel is persistent: ``programs`` programs (default: the multiprocessors less one)
  loop over the tiles, and a program that waits keeps its multiprocessor. The flags must be set by
  something that does not need those multiprocessors (copy engines, another GPU, the spare
  multiprocessor left by the default), or a waiting kernel starves its own producer.
- **Deadline.** A wait polls the global timer (CUDA; elsewhere it counts polls, about 100 ns each);
  past ``timeout_ns`` it writes ``error[0] = 1`` and ``error[1 + q] = 1`` for the late chunk ``q`` and
  reads the rows anyway: the result is then garbage, and the caller raises from ``error`` (the
  peer-memory layer's error word works: ``xelink.symm`` raises ``xelink.TimeoutError`` on its next call).

Two kernels: ``impl="cuda"`` (sm90: TMA descriptors, the gemm kernel's tiles; each tile runs its own
pipelined K loop; with whole chunks it waits once before it, with column slices each of its loads waits
first for the slices it reads: a PTX poll whose result the load's coordinate depends on, so the pipeliner
issues each wait with its load, stages ahead of the math, and a wait costs a compare once the tile has seen
its slices land (the slices a load reaches into are counted from load to load, without a division); fusing
the tile and K loops into one pipeline as ``gemm`` does, with each tile waiting one tile ahead, measured 3.5x
slower on an H200, so it is not offered) and ``impl="triton"`` (portable: block pointers, the one the Intel
compile check covers; a tile waits for each slice, then runs a K loop over it).
"""
from __future__ import annotations

import torch

from .common import (Paths, cdiv, check_impl, check_no_overlap, check_out, check_same_device, check_tensor,
                     forward_only, interpreting, path_key, require_triton, sm_count, tl, triton)
from .gemm import _gemm_config, _orientation, _tma_applies, _tma_out_ok, _tma_view
from .launcher import Descriptor, Slot, launch_keyed

__all__ = ["GATED_GEMM_IMPLS", "column_slices", "gated_gemm"]

GATED_GEMM_IMPLS = ("auto", "triton", "cuda")
_POLL_NS = 100  # the deadline of a poll-counting wait: polls = timeout_ns / _POLL_NS
_MAX_CROSS = 4  # the most slice steps the sliced TMA tile unrolls a load (more: it divides)


if triton is not None:  # the gemm kernel's jitted tile helpers exist only where Triton does
    from .gemm import _block_tile, _grouped_tile, _store_tile, _tma_operands, _tma_tile

    @triton.jit
    def _await_count(counter, target, err, who, timeout_ns, TIMER: tl.constexpr):
        """Acquire-poll ``counter`` (int32, system scope) until it reaches ``target`` (wrap-safe: counters
        that only grow may pass 2**31) or the deadline passes; a late wait marks ``err[1 + who]`` and
        ``err[0]`` and returns. The caller orders its block after the wait (a block barrier)."""
        v = tl.atomic_add(counter, 0, sem="acquire", scope="sys")
        if (v - target) < 0:
            late = 0
            if TIMER:
                start = tl.extra.cuda.globaltimer()
                while ((v - target) < 0) & (late == 0):
                    v = tl.atomic_add(counter, 0, sem="acquire", scope="sys")
                    late = ((tl.extra.cuda.globaltimer() - start) > timeout_ns).to(tl.int32)
            else:
                polls = 0
                while ((v - target) < 0) & (late == 0):
                    v = tl.atomic_add(counter, 0, sem="acquire", scope="sys")
                    polls += 1
                    late = (polls > timeout_ns // 100).to(tl.int32)
            if late != 0:
                tl.store(err + 1 + who, 1)
                tl.store(err, 1)

    @triton.jit
    def _await_rows(flags, err, off_m, M, chunk_rows, need, timeout_ns, BLOCK_M: tl.constexpr,
                    TIMER: tl.constexpr):
        """Wait until every chunk rows [off_m, off_m + BLOCK_M) span has ``need`` slices landed, then order
        the block after it."""
        q = off_m // chunk_rows
        last = (tl.minimum(off_m + BLOCK_M, M) - 1) // chunk_rows
        while q <= last:
            _await_count(flags + q, need, err, q, timeout_ns, TIMER)
            q += 1
        tl.debug_barrier()  # thread 0's acquires happen before every thread's reads below

    # The TMA kernel's wait, run by every thread: $0 = the slices known landed on every chunk of the span ($3
    # before), polling the span's n ($5) flags from $2 (acquire, system scope) only while fewer than need ($4)
    # are known; $1 = $9 (the load's column, which the load then takes from the wait). Past the deadline ($6 ns
    # of %globaltimer) it marks the late chunk ($7: its error word for the span's first chunk) and the error flag
    # ($8), and returns 2**30, which no later wait of the thread polls again. (A thread marks its own lateness:
    # threads poll on their own, and the one issuing the loads may be the only late one.)
    _SLICE_WAIT = tl.constexpr("""{
        .reg .pred p;
        .reg .s32 v, m, i;
        .reg .u64 a, t0, t1;
        mov.b32 $1, $9;
        mov.b32 $0, $3;
        setp.ge.s32 p, $3, $4;
        @p bra DONE;
        mov.u64 t0, %globaltimer;
        mov.b32 m, 0x7fffffff;
        mov.b64 a, $2;
        mov.b32 i, 0;
        POLL:
        ld.acquire.sys.global.s32 v, [a];
        setp.ge.s32 p, v, $4;
        @p bra HAVE;
        mov.u64 t1, %globaltimer;
        sub.u64 t1, t1, t0;
        setp.lt.u64 p, t1, $6;
        @p bra POLL;
        sub.u64 a, a, $2;
        add.u64 a, a, $7;
        st.global.s32 [a], 1;
        st.global.s32 [$8], 1;
        mov.b32 $0, 0x40000000;
        bra DONE;
        HAVE:
        min.s32 m, m, v;
        add.u64 a, a, 4;
        add.s32 i, i, 1;
        setp.lt.s32 p, i, $5;
        @p bra POLL;
        mov.b32 $0, m;
        DONE:
    }""")

    @triton.jit
    def _slice_wait(first_flag, known, need, n_chunks, timeout_ns, first_err, err, off_k):
        """(slices known landed, ``off_k`` as the wait's output: the column the load then reads)."""
        # pure to the compiler: the software pipeliner then issues it with the load whose coordinate depends
        # on it (it cannot predicate a side-effecting op; the only effect, marking a late chunk, is idempotent);
        # its inputs change every iteration, so it is never merged or hoisted
        # (timeout_ns as int64 whatever width the launch gave it: Triton types a small deadline as i32)
        return tl.inline_asm_elementwise(_SLICE_WAIT, "=r,=r,l,r,r,r,l,l,l,r",
                                         [first_flag, known, need, n_chunks, tl.cast(timeout_ns, tl.int64), first_err,
                                          err, off_k], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)

    @triton.jit
    def _tile_of(tile, order, num_m, num_n, GROUP_M: tl.constexpr):
        lm, pid_n = _grouped_tile(tile, num_m, num_n, GROUP_M)
        return tl.load(order + lm), pid_n

    @triton.jit
    def _gated_gemm_tma_kernel(a_desc, b_desc, c_desc, flags, order, err, M, N, K, chunk_rows, timeout_ns,
                               A_ROW_MAJOR: tl.constexpr, B_ROW_MAJOR: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, TIMER: tl.constexpr,
                               SLICES: tl.constexpr, CROSS: tl.constexpr = 1):
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        tiles = num_m * num_n
        for tile in tl.range(tl.program_id(0), tiles, NUM_PROGRAMS):
            pid_m, pid_n = _tile_of(tile, order, num_m, num_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            if SLICES == 1:  # whole chunks: the tile waits once, then runs gemm's K loop
                _await_rows(flags, err, off_m, M, chunk_rows, 1, timeout_ns, BLOCK_M, TIMER)
                acc = _tma_tile(a_desc, b_desc, off_m, off_n, K, A_ROW_MAJOR, B_ROW_MAJOR, BLOCK_M, BLOCK_N,
                                BLOCK_K)
            else:
                acc = _sliced_tma_tile(a_desc, b_desc, flags, err, off_m, off_n, M, K, chunk_rows, timeout_ns,
                                       A_ROW_MAJOR, B_ROW_MAJOR, BLOCK_M, BLOCK_N, BLOCK_K, SLICES, CROSS)
            c_desc.store([off_m, off_n], acc.to(c_desc.dtype))

    @triton.jit
    def _sliced_tma_tile(a_desc, b_desc, flags, err, off_m, off_n, M, K, chunk_rows, timeout_ns,
                         A_ROW_MAJOR: tl.constexpr, B_ROW_MAJOR: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SLICES: tl.constexpr, CROSS: tl.constexpr):
        """``_tma_tile`` whose loads each wait for the column slices they read (module docstring)."""
        first = off_m // chunk_rows
        n_chunks = (tl.minimum(off_m + BLOCK_M, M) - 1) // chunk_rows - first + 1
        known = first * 0
        # need: the slices the loads so far reach into (those that start before their end); edge: where slice
        # `need` starts (column_slices' bounds). Carried from load to load, with at most CROSS slices entered a
        # load (``_crossings``), instead of a division by K a load, which cost the loop 3-7% on an H100; CROSS 0
        # (slices much narrower than a load) divides.
        need = first * 0
        edge = first * 0
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for off_k in range(0, K, BLOCK_K):
            end = tl.minimum(off_k + BLOCK_K, K)
            if CROSS == 0:
                need = (end * SLICES - 1) // K + 1  # through the slice of column end - 1 (bounds inverted)
            else:
                for _ in tl.static_range(CROSS):
                    need += ((need < SLICES) & (end > edge)).to(tl.int32)
                    edge = need * K // SLICES
            known, k = _slice_wait(flags + first, known, need, n_chunks, timeout_ns, err + 1 + first, err, off_k)
            a, b = _tma_operands(a_desc, b_desc, off_m, off_n, k, A_ROW_MAJOR, B_ROW_MAJOR)
            acc = tl.dot(a, b, acc)
        return acc

    @triton.jit
    def _gated_gemm_kernel(a_ptr, b_ptr, c_ptr, flags, order, err, M, N, K,
                           stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, chunk_rows, timeout_ns,
                           A_ROW_MAJOR: tl.constexpr, B_ROW_MAJOR: tl.constexpr, EVEN: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, TIMER: tl.constexpr,
                           SLICES: tl.constexpr):
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        for tile in range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS):
            pid_m, pid_n = _tile_of(tile, order, num_m, num_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            if SLICES == 1:
                _await_rows(flags, err, off_m, M, chunk_rows, 1, timeout_ns, BLOCK_M, TIMER)
                acc = _block_tile(a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, off_m, off_n,
                                  A_ROW_MAJOR, B_ROW_MAJOR, EVEN, BLOCK_M, BLOCK_N, BLOCK_K)
            else:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(0, SLICES):  # each slice once it landed, a K loop over its columns
                    lo = s * K // SLICES
                    _await_rows(flags, err, off_m, M, chunk_rows, s + 1, timeout_ns, BLOCK_M, TIMER)
                    acc += _block_tile(a_ptr + lo.to(tl.int64) * stride_ak, b_ptr + lo.to(tl.int64) * stride_bk, M, N,
                                       (s + 1) * K // SLICES - lo, stride_am, stride_ak, stride_bk, stride_bn, off_m,
                                       off_n, A_ROW_MAJOR, B_ROW_MAJOR, False, BLOCK_M, BLOCK_N, BLOCK_K)
            _store_tile(c_ptr, acc, M, N, stride_cm, stride_cn, off_m, off_n, BLOCK_M, BLOCK_N)


def _cross(K: int, block_k: int, k_slices: int) -> int:
    """The sliced TMA tile's CROSS: ``_crossings`` where it is small, else 0 (the tile divides instead of
    unrolling that many steps a load)."""
    if k_slices == 1:
        return 1  # (unused: whole chunks take gemm's K loop)
    most = _crossings(K, block_k, k_slices)
    return most if most <= _MAX_CROSS else 0


def _crossings(K: int, block_k: int, k_slices: int) -> int:
    """The most slices one K block of ``block_k`` columns enters, reading K in order (the sliced TMA tile's
    CROSS: how many times a load may have to advance its slice count)."""
    starts = [lo for lo, _ in column_slices(K, k_slices)]
    most = need = 0
    for off in range(0, K, block_k):
        end, entered = min(off + block_k, K), 0
        while need < k_slices and end > starts[need]:
            need, entered = need + 1, entered + 1
        most = max(most, entered)
    return most


def column_slices(K: int, k_slices: int) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` columns of each of the ``k_slices`` slices of a ``K``-column chunk (the last ones empty
    where k_slices > K)."""
    return [(s * K // k_slices, (s + 1) * K // k_slices) for s in range(k_slices)]


def block_order(M: int, block_m: int, chunk_rows: int, order) -> list[int]:
    """The row blocks of ``a`` in the order their chunks land: a block is ready once the last of the
    chunks it spans (by position in ``order``) has landed; ties keep row order."""
    pos = {q: i for i, q in enumerate(order)}
    blocks = range(cdiv(M, block_m))
    ready = [max(pos[q] for q in range(b * block_m // chunk_rows, (min(M, (b + 1) * block_m) - 1) // chunk_rows + 1))
             for b in blocks]
    return sorted(blocks, key=lambda b: (ready[b], b))


_ORDERS = Paths()  # (device, M, BLOCK_M, chunk_rows, order) -> block_order on the device, uploaded once (bounded)


def _device_order(device: torch.device, M: int, block_m: int, chunk_rows: int, order) -> torch.Tensor:
    """``block_order`` as an int32 tensor on ``device``, uploaded at its first use only (so that a plan made again,
    e.g. for flags at another alignment, needs no upload and may be made inside a CUDA graph capture)."""
    key = (str(device), M, block_m, chunk_rows, tuple(order))
    hit = _ORDERS.get(key)
    if hit is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("gated_gemm: the first call of a shape uploads its tile order, which a CUDA graph "
                               "capture cannot; run it once before capturing")
        hit = torch.tensor(block_order(M, block_m, chunk_rows, order), dtype=torch.int32, device=device)
        _ORDERS.remember(key, hit)
    return hit


class _Plan:
    """One gated_gemm path: the kernel, grid, block order on the device, descriptors' fields or integer
    arguments, constexprs and the launcher slot."""

    __slots__ = ("fn", "grid", "views", "ints", "kwargs", "order", "slot")

    def __init__(self, a, b, c, impl: str, chunk_rows: int, k_slices: int, order, programs, cfg: dict):
        (M, K), N = a.shape, b.shape[1]
        bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
        self.order = _device_order(a.device, M, bm, chunk_rows, order)
        tiles = cdiv(M, bm) * cdiv(N, bn)
        if programs is None:
            programs = max(1, sm_count(a.device) - 1) if a.is_cuda else 4
        programs = max(1, min(programs, tiles))
        self.grid = (programs,)
        timer = a.is_cuda and not interpreting()
        a_row, b_row = _orientation(a), _orientation(b)
        if impl == "cuda":
            self.fn = _gated_gemm_tma_kernel
            self.views = (_tma_view(a) + ((bm, bk) if a_row else (bk, bm),),
                          _tma_view(b) + ((bk, bn) if b_row else (bn, bk),), _tma_view(c) + ((bm, bn),))
            self.ints = (M, N, K, chunk_rows)
            self.kwargs = dict(A_ROW_MAJOR=bool(a_row), B_ROW_MAJOR=bool(b_row), NUM_PROGRAMS=programs, TIMER=timer,
                               SLICES=k_slices, CROSS=_cross(K, bk, k_slices), **cfg)
        else:
            self.fn, self.views = _gated_gemm_kernel, None
            self.ints = (M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
                         chunk_rows)
            even = M % bm == 0 and N % bn == 0 and K % bk == 0
            self.kwargs = dict(A_ROW_MAJOR=a_row is not False, B_ROW_MAJOR=b_row is not False, EVEN=even,
                               NUM_PROGRAMS=programs, TIMER=timer, SLICES=k_slices, **cfg)
        self.slot = Slot(self.fn)

    def __call__(self, a, b, c, flags, error, timeout_ns: int) -> None:
        # The addresses and the deadline are all that may differ from call to call (self.order is the plan's).
        launch_keyed(self.slot, (a.data_ptr(), b.data_ptr(), c.data_ptr(), flags.data_ptr(), error.data_ptr(),
                                 timeout_ns), self.grid, lambda: self._args(a, b, c, flags, error, timeout_ns),
                     self.kwargs)

    def _args(self, a, b, c, flags, error, timeout_ns) -> tuple:
        if self.views is None:
            head = (a, b, c)
        else:
            av, bv, cv = self.views
            head = (Descriptor(a, *av), Descriptor(b, *bv), Descriptor(c, *cv))
        return (*head, flags, self.order, error, *self.ints, timeout_ns)


_PATHS = Paths()
_CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
_NEVER = 1 << 62  # timeout_ns=None: wait without a deadline (fits the kernels' int64)
_MAX_SLICES = 1024


def _check(a, b, flags, chunk_rows, k_slices, order, out, error, timeout_ns, programs, impl):
    fn = "gated_gemm"
    impl = forward_only(fn, check_impl(fn, impl, GATED_GEMM_IMPLS), has_reference=False, a=a, b=b)
    _check_operands(fn, a, b)
    check_tensor(fn, "flags", flags, 1)
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows <= 0:
        raise ValueError(f"gated_gemm: chunk_rows={chunk_rows!r} must be a positive int")
    if isinstance(k_slices, bool) or not isinstance(k_slices, int) or not 1 <= k_slices <= _MAX_SLICES:
        raise ValueError(f"gated_gemm: k_slices={k_slices!r} must be an int in [1, {_MAX_SLICES}]")
    if a.shape[1] * k_slices >= 2**31:
        raise ValueError(f"gated_gemm: K * k_slices = {a.shape[1]} * {k_slices} must stay below 2**31")
    chunks = max(1, cdiv(a.shape[0], chunk_rows))
    if flags.dtype != torch.int32 or flags.numel() < chunks:
        raise ValueError(f"gated_gemm: flags must be int32 with at least {chunks} entries (one per chunk of "
                         f"{chunk_rows} rows), got {flags.dtype} with {flags.numel()}")
    order = tuple(range(chunks)) if order is None else tuple(order)
    if sorted(order) != list(range(chunks)):
        raise ValueError(f"gated_gemm: order={order} must list each of the {chunks} chunks once")
    if error is None or not isinstance(error, torch.Tensor) or error.dtype != torch.int32 or \
            error.numel() < 1 + chunks or not error.is_contiguous():
        raise ValueError(f"gated_gemm: error must be a contiguous int32 tensor of at least {1 + chunks} entries "
                         f"(on the device or in pinned host memory), got {error!r:.80}")
    if timeout_ns is not None and (isinstance(timeout_ns, bool) or not isinstance(timeout_ns, int) or timeout_ns <= 0):
        raise ValueError(f"gated_gemm: timeout_ns={timeout_ns!r} must be a positive int or None")
    if programs is not None and (isinstance(programs, bool) or not isinstance(programs, int) or programs <= 0):
        raise ValueError(f"gated_gemm: programs={programs!r} must be a positive int or None")
    check_same_device(fn, a=a, b=b, flags=flags)
    if out is not None:
        check_out(fn, out, (a.shape[0], b.shape[1]), a.dtype, a.device)
    if impl == "auto":
        impl = "cuda" if _tma_applies(a, b) and _tma_out_ok(out) else "triton"
    require_triton(fn, impl, a.device)
    if impl == "cuda" and not (_tma_applies(a, b) and _tma_out_ok(out)):
        raise ValueError("gated_gemm: impl='cuda' needs sm90, TMA's 16-byte alignment of a, b and out, and "
                         f"N*itemsize a multiple of 16 (a.stride()={a.stride()}, b.stride()={b.stride()}); use "
                         "impl='triton'")
    return impl, order


def _check_operands(fn: str, a, b) -> None:
    """The checks the kernel GEMMs built for the distributed ops share: 2-D half-precision ``a [M, K]`` and
    ``b [K, N]`` of one dtype."""
    check_tensor(fn, "a", a, 2)
    check_tensor(fn, "b", b, 2)
    if a.dtype not in (torch.bfloat16, torch.float16) or b.dtype != a.dtype:
        raise TypeError(f"{fn}: a.dtype={a.dtype} and b.dtype={b.dtype} must both be bfloat16 or both float16")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{fn}: a.shape[1]={a.shape[1]} != b.shape[0]={b.shape[0]} (a is [M, K], b is [K, N])")


def gated_gemm(a: torch.Tensor, b: torch.Tensor, flags: torch.Tensor, *, chunk_rows: int, error: torch.Tensor,
               k_slices: int = 1, order=None, out: torch.Tensor | None = None, timeout_ns: int | None = None,
               programs: int | None = None, impl: str = "auto", config: dict | None = None) -> torch.Tensor:
    """``c = a @ b`` (fp32 accumulation) where the columns of slice ``s`` of chunk ``q`` of ``a`` are read only
    after ``flags[q] > s`` (module docstring: the rules).

    Args:
        a: ``[M, K]`` bf16/fp16 CUDA tensor (row- or column-major); chunk ``q`` is rows
            ``[q * chunk_rows, (q + 1) * chunk_rows)``.
        b: ``[K, N]``, same dtype and device.
        flags: int32 ``[>= ceil(M / chunk_rows)]`` on the device: the slices of each chunk landed so far.
        chunk_rows: rows per chunk.
        k_slices: column slices a chunk lands in, in order (``column_slices(K, k_slices)``; 1 to 1024).
        error: contiguous int32 ``[>= 1 + chunks]`` (device or pinned host memory) the late waits mark.
        order: the chunks in their expected order of arrival (default 0, 1, ...): tiles go out in it.
        out: optional ``[M, N]`` destination (``gemm``'s rules).
        timeout_ns: each wait's deadline (None: none).
        programs: persistent programs (default: multiprocessors - 1).
        impl: ``"auto"`` (``"cuda"`` where TMA applies, else ``"triton"``), ``"cuda"``, ``"triton"``.
        config: tile override for benchmarks (``gemm``'s keys: ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``GROUP_M``,
            ``num_warps``, ``num_stages``; each missing key from the default): e.g. smaller tiles at small M,
            where a chunk's rows feed fewer tiles than a wave has programs.

    Returns:
        ``out`` or a new ``[M, N]`` tensor.
    """
    # Remembered by everything the checks and the launch read (timeout_ns too: its value decides the
    # class Triton specializes it on, which the launcher slot relies on); addresses are checked every call.
    if config is not None and (not isinstance(config, dict) or set(config) - set(_CONFIG_KEYS)):
        raise ValueError(f"gated_gemm: config={config!r} must be a dict of {', '.join(_CONFIG_KEYS)}")
    # (the config as a str: path_key takes plain options only, and a tuple would leave the call unremembered,
    # so that a capture would plan it again)
    key = path_key((impl, chunk_rows, k_slices, programs, timeout_ns,
                    None if config is None else str(sorted(config.items()))),
                   (a, b, flags, error), (out,))
    if key is not None:
        key = (key, None if order is None else tuple(order))
    hit = _PATHS.get(key) if key is not None else None
    if hit is None:
        impl, order_t = _check(a, b, flags, chunk_rows, k_slices, order, out, error, timeout_ns, programs, impl)
    if out is not None:
        check_no_overlap("gated_gemm", out, a=a, b=b)
    (M, K), N = a.shape, b.shape[1]
    c = a.new_empty((M, N)) if out is None else out
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_()
    if hit is None:
        hit = _Plan(a, b, c, impl, chunk_rows, k_slices, order_t, programs,
                    {**_gemm_config(M, N, K), **(config or {})})
        if key is not None:
            _PATHS.remember(key, hit)
    hit(a, b, c, flags, error, _NEVER if timeout_ns is None else timeout_ns)
    return c

"""Triton kernels of the peer-memory collectives (NVIDIA), and their launcher.

Every kernel runs on a fixed grid of ``G`` blocks (the team's ``blocks``). Block b of rank r pairs
with block b of every peer: it signals the peers' pad slot ``[b][r]`` with a release atomic at system
scope after a block-wide barrier, and waits on its own pad ``[b][p]`` with acquire loads. A block
touches only the elements it is paired on (tiles ``j`` with ``j % G == b`` of every chunk), so a
per-block barrier orders everything that matters and no grid-wide sync is needed. Counters are
monotonic: a block's local epoch says how many barriers it passed, so the kernels need no reset and
replay unchanged inside CUDA graphs. A wait that outlives ``timeout_ns`` (global timer) writes the
missing peers into the pinned error word and moves on; the host raises ``xelink.TimeoutError``.

Scratch parity rule. The scratch buffer of every rank has two slots. A kernel that starts at
epoch ``e`` and ends at epoch ``E`` (one more per barrier) may, before its first barrier, write only
slot ``e & 1`` (of any rank), and after its last barrier touch only slot ``(E - 1) & 1``. Then the
next kernel, which a fast peer may start while this rank is still after its last barrier, writes
slot ``E & 1``, never the one still being read; between barriers every rank is inside the same
kernel. One-barrier kernels (direct, gather, reduce_scatter) stage and read slot ``e & 1``; the
two-shot all-reduce stages its input in slot ``e & 1`` and writes the reduced chunks into slot
``(e + 1) & 1``, from which each rank copies its result after the second barrier (reading slot
``e & 1`` there let a peer's next direct all-reduce push into it mid-copy).

Peer addresses are separate pointer arguments (``B0..B7``, ``S0..S7``) so that Triton specializes
them on 16-byte alignment and emits vector loads; unused ones are None.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the GPU collectives report that Triton is missing
    triton = None

__all__ = ["Kernel", "Bound", "acc_type", "available"]

# OP codes of the kernels: collectives/gpu.py's _OPS (sum 0, avg 1, max 2, min 3, prod 4).
_MAXW = 8      # MAX_WORLD of transport/cuda.py
_MAXB = 1024   # MAX_BLOCKS of transport/cuda.py


def available() -> bool:
    return triton is not None


if triton is not None:
    _globaltimer = tl.extra.cuda.globaltimer

    @triton.jit
    def _pick(i: tl.constexpr, a0, a1, a2, a3, a4, a5, a6, a7):
        if i == 0:
            return a0
        elif i == 1:
            return a1
        elif i == 2:
            return a2
        elif i == 3:
            return a3
        elif i == 4:
            return a4
        elif i == 5:
            return a5
        elif i == 6:
            return a6
        else:
            return a7

    @triton.jit
    def _combine(acc, x, OP: tl.constexpr):
        if OP == 2:
            return tl.maximum(acc, x)
        elif OP == 3:
            return tl.minimum(acc, x)
        elif OP == 4:
            return acc * x
        else:
            return acc + x

    @triton.jit
    def _barrier(S0, S1, S2, S3, S4, S5, S6, S7, ERR, target, timeout_ns, pid,
                 RANK: tl.constexpr, WORLD: tl.constexpr):
        # Every thread's earlier stores (to peers too) happen before thread 0's release below.
        tl.debug_barrier()
        for p in tl.static_range(WORLD):
            if p != RANK:
                peer = _pick(p, S0, S1, S2, S3, S4, S5, S6, S7)
                tl.atomic_add(peer + pid * 8 + RANK, 1, sem="release", scope="sys")
        mine = _pick(RANK, S0, S1, S2, S3, S4, S5, S6, S7)
        for p in tl.static_range(WORLD):
            if p != RANK:
                v = tl.atomic_add(mine + pid * 8 + p, 0, sem="acquire", scope="sys")
                start = _globaltimer()
                late = (start < 0).to(tl.int32)
                while ((v - target) < 0) & (late == 0):
                    v = tl.atomic_add(mine + pid * 8 + p, 0, sem="acquire", scope="sys")
                    late = ((_globaltimer() - start) > timeout_ns).to(tl.int32)
                if late != 0:
                    tl.store(ERR + 1 + p, 1)
                    tl.store(ERR, 1)
        # ...and the peers' writes this block waited for happen before every thread's loads after it.
        tl.debug_barrier()

    @triton.jit
    def _direct_all_reduce(X, Y, B0, B1, B2, B3, B4, B5, B6, B7, S0, S1, S2, S3, S4, S5, S6, S7,
                           EPOCH, ERR, n, region, slot, timeout_ns,
                           RANK: tl.constexpr, WORLD: tl.constexpr, OP: tl.constexpr, ACC: tl.constexpr,
                           BLOCK: tl.constexpr):
        """One-shot, push: write my input into region RANK of every rank's scratch slot, one barrier,
        then reduce the WORLD regions of my own slot (local reads) in rank order.

        Pushing puts the link latency on stores, which the release before the signal waits for, instead
        of on loads after the barrier; each slot holds WORLD regions of ``region`` >= n elements
        (rounded up so that every region starts 16-byte aligned).
        """
        pid = tl.program_id(0)
        G = tl.num_programs(0)
        e0 = tl.load(EPOCH + pid)
        off = (e0 & 1).to(tl.int64) * slot
        ar = tl.arange(0, BLOCK)
        tiles = tl.cdiv(n, BLOCK)
        for t in range(pid, tiles, G):
            o = t * BLOCK + ar
            m = o < n
            v = tl.load(X + o, mask=m)
            for p in tl.static_range(WORLD):
                dst = _pick(p, B0, B1, B2, B3, B4, B5, B6, B7) + off + RANK * region
                tl.store(dst + o, v, mask=m)
        _barrier(S0, S1, S2, S3, S4, S5, S6, S7, ERR, e0 + 1, timeout_ns, pid, RANK, WORLD)
        mine = _pick(RANK, B0, B1, B2, B3, B4, B5, B6, B7) + off
        for t in range(pid, tiles, G):
            o = t * BLOCK + ar
            m = o < n
            acc = tl.load(mine + o, mask=m).to(ACC)
            for q in tl.static_range(1, WORLD):
                acc = _combine(acc, tl.load(mine + q * region + o, mask=m).to(ACC), OP)
            if OP == 1:
                acc = acc / WORLD
            tl.store(Y + o, acc.to(Y.dtype.element_ty), mask=m)
        tl.store(EPOCH + pid, e0 + 1)

    @triton.jit
    def _two_shot_all_reduce(X, Y, B0, B1, B2, B3, B4, B5, B6, B7, S0, S1, S2, S3, S4, S5, S6, S7,
                             EPOCH, ERR, n, chunk, slot, timeout_ns,
                             RANK: tl.constexpr, WORLD: tl.constexpr, OP: tl.constexpr, ACC: tl.constexpr,
                             COPY: tl.constexpr, OUT: tl.constexpr, BLOCK: tl.constexpr):
        """Two-shot: rank r reduces chunk r from every rank and writes the result into every rank.

        Chunk q is ``[q*chunk, min((q+1)*chunk, n))``. COPY stages X into scratch slot ``e0 & 1``
        first and the reduced chunks go to slot ``(e0 + 1) & 1`` (the parity rule: that is the slot
        read after the last barrier); otherwise B are X's peer addresses (X symmetric) and the result
        lands in X in place. OUT copies this rank's result to Y at the end (COPY, or Y is not X).
        """
        pid = tl.program_id(0)
        G = tl.num_programs(0)
        e0 = tl.load(EPOCH + pid)
        off = (e0 & 1).to(tl.int64) * slot if COPY else 0
        res = ((e0 + 1) & 1).to(tl.int64) * slot if COPY else 0
        mine = _pick(RANK, B0, B1, B2, B3, B4, B5, B6, B7) + off
        ar = tl.arange(0, BLOCK)
        tiles = tl.cdiv(chunk, BLOCK)
        if COPY:
            for q in tl.static_range(WORLD):
                for j in range(pid, tiles, G):
                    c = j * BLOCK + ar
                    o = q * chunk + c
                    m = (c < chunk) & (o < n)
                    tl.store(mine + o, tl.load(X + o, mask=m), mask=m)
        _barrier(S0, S1, S2, S3, S4, S5, S6, S7, ERR, e0 + 1, timeout_ns, pid, RANK, WORLD)
        for j in range(pid, tiles, G):
            c = j * BLOCK + ar
            o = RANK * chunk + c
            m = (c < chunk) & (o < n)
            acc = tl.load(B0 + off + o, mask=m).to(ACC)
            for p in tl.static_range(1, WORLD):
                src = _pick(p, B0, B1, B2, B3, B4, B5, B6, B7) + off
                acc = _combine(acc, tl.load(src + o, mask=m).to(ACC), OP)
            if OP == 1:
                acc = acc / WORLD
            val = acc.to(X.dtype.element_ty)
            for p in tl.static_range(WORLD):
                dst = _pick(p, B0, B1, B2, B3, B4, B5, B6, B7) + res
                tl.store(dst + o, val, mask=m)
        _barrier(S0, S1, S2, S3, S4, S5, S6, S7, ERR, e0 + 2, timeout_ns, pid, RANK, WORLD)
        if OUT:
            out = _pick(RANK, B0, B1, B2, B3, B4, B5, B6, B7) + res
            for q in tl.static_range(WORLD):
                for j in range(pid, tiles, G):
                    c = j * BLOCK + ar
                    o = q * chunk + c
                    m = (c < chunk) & (o < n)
                    tl.store(Y + o, tl.load(out + o, mask=m), mask=m)
        tl.store(EPOCH + pid, e0 + 2)

    @triton.jit
    def _gather(X, Y, B0, B1, B2, B3, B4, B5, B6, B7, S0, S1, S2, S3, S4, S5, S6, S7,
                EPOCH, ERR, n, x_stride, b_stride, y_stride, slot, timeout_ns,
                RANK: tl.constexpr, WORLD: tl.constexpr, A2A: tl.constexpr, COPY: tl.constexpr,
                BLOCK: tl.constexpr):
        """All-gather, or all-to-all (A2A): ``Y[p*y_stride + i] = B_p[RANK*b_stride + i]`` for i < n.

        B_p is rank p's X (symmetric, COPY=False: a second barrier keeps X alive until the peers
        are done) or its scratch slot, where COPY stages ``X[q*x_stride + i]`` at ``q*b_stride + i``
        (q < WORLD for all-to-all, q = 0 for all-gather). This rank's own part comes from X.
        """
        pid = tl.program_id(0)
        G = tl.num_programs(0)
        e0 = tl.load(EPOCH + pid)
        off = (e0 & 1).to(tl.int64) * slot if COPY else 0
        ar = tl.arange(0, BLOCK)
        tiles = tl.cdiv(n, BLOCK)
        if COPY:
            mine = _pick(RANK, B0, B1, B2, B3, B4, B5, B6, B7) + off
            for q in tl.static_range(WORLD if A2A else 1):
                if q != RANK or not A2A:
                    for j in range(pid, tiles, G):
                        c = j * BLOCK + ar
                        m = c < n
                        tl.store(mine + q * b_stride + c, tl.load(X + q * x_stride + c, mask=m), mask=m)
        _barrier(S0, S1, S2, S3, S4, S5, S6, S7, ERR, e0 + 1, timeout_ns, pid, RANK, WORLD)
        for p in tl.static_range(WORLD):
            if p == RANK:
                src = X + (RANK * x_stride if A2A else 0)
            else:
                src = _pick(p, B0, B1, B2, B3, B4, B5, B6, B7) + off + (RANK * b_stride if A2A else 0)
            for j in range(pid, tiles, G):
                c = j * BLOCK + ar
                m = c < n
                tl.store(Y + p * y_stride + c, tl.load(src + c, mask=m), mask=m)
        if COPY:
            tl.store(EPOCH + pid, e0 + 1)
        else:
            _barrier(S0, S1, S2, S3, S4, S5, S6, S7, ERR, e0 + 2, timeout_ns, pid, RANK, WORLD)
            tl.store(EPOCH + pid, e0 + 2)

    @triton.jit
    def _reduce_scatter(X, Y, B0, B1, B2, B3, B4, B5, B6, B7, S0, S1, S2, S3, S4, S5, S6, S7,
                        EPOCH, ERR, n, x_stride, b_stride, slot, timeout_ns,
                        RANK: tl.constexpr, WORLD: tl.constexpr, OP: tl.constexpr, ACC: tl.constexpr,
                        COPY: tl.constexpr, BLOCK: tl.constexpr):
        """``Y[i] = op over p of B_p[RANK*b_stride + i]`` for i < n, in rank order.

        B_p is rank p's X (symmetric, COPY=False, two barriers) or its scratch slot, where COPY
        stages ``X[q*x_stride + i]`` at ``q*b_stride + i`` for every q.
        """
        pid = tl.program_id(0)
        G = tl.num_programs(0)
        e0 = tl.load(EPOCH + pid)
        off = (e0 & 1).to(tl.int64) * slot if COPY else 0
        ar = tl.arange(0, BLOCK)
        tiles = tl.cdiv(n, BLOCK)
        if COPY:
            mine = _pick(RANK, B0, B1, B2, B3, B4, B5, B6, B7) + off
            for q in tl.static_range(WORLD):
                for j in range(pid, tiles, G):
                    c = j * BLOCK + ar
                    m = c < n
                    tl.store(mine + q * b_stride + c, tl.load(X + q * x_stride + c, mask=m), mask=m)
        _barrier(S0, S1, S2, S3, S4, S5, S6, S7, ERR, e0 + 1, timeout_ns, pid, RANK, WORLD)
        for j in range(pid, tiles, G):
            c = j * BLOCK + ar
            m = c < n
            o = RANK * b_stride + c
            acc = tl.load(B0 + off + o, mask=m).to(ACC)
            for p in tl.static_range(1, WORLD):
                src = _pick(p, B0, B1, B2, B3, B4, B5, B6, B7) + off
                acc = _combine(acc, tl.load(src + o, mask=m).to(ACC), OP)
            if OP == 1:
                acc = acc / WORLD
            tl.store(Y + c, acc.to(Y.dtype.element_ty), mask=m)
        if COPY:
            tl.store(EPOCH + pid, e0 + 1)
        else:
            _barrier(S0, S1, S2, S3, S4, S5, S6, S7, ERR, e0 + 2, timeout_ns, pid, RANK, WORLD)
            tl.store(EPOCH + pid, e0 + 2)

    @triton.jit
    def _barrier_kernel(S0, S1, S2, S3, S4, S5, S6, S7, EPOCH, ERR, timeout_ns,
                        RANK: tl.constexpr, WORLD: tl.constexpr):
        pid = tl.program_id(0)
        e0 = tl.load(EPOCH + pid)
        _barrier(S0, S1, S2, S3, S4, S5, S6, S7, ERR, e0 + 1, timeout_ns, pid, RANK, WORLD)
        tl.store(EPOCH + pid, e0 + 1)

    KERNELS = {"direct_all_reduce": _direct_all_reduce, "two_shot_all_reduce": _two_shot_all_reduce,
               "gather": _gather, "reduce_scatter": _reduce_scatter, "barrier": _barrier_kernel}

# Accumulation type per data type: half types reduce in float32.
_ACC = {torch.float16: "float32", torch.bfloat16: "float32", torch.float32: "float32", torch.float64: "float64",
        torch.int32: "int32", torch.int64: "int64"}


def acc_type(dtype: torch.dtype):
    return getattr(tl, _ACC[dtype])


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


class Kernel:
    """One collective kernel of one team with fixed meta-parameters.

    ``kernel.bind(**dynamic)`` fixes the arguments that vary between calls (data addresses, counts,
    strides, the deadline) and returns a ``Bound`` launch.
    """

    def __init__(self, name: str, team, dtype: torch.dtype, num_warps: int = 8, **consts):
        self.fn = KERNELS[name]
        self.grid = team.blocks
        self.num_warps = num_warps
        names = self.fn.arg_names
        fixed = dict(consts, EPOCH=team.epochs.data_ptr(), ERR=team.error.data_ptr(), RANK=team.rank,
                     WORLD=team.size)
        for i in range(_MAXW):
            fixed[f"S{i}"] = team.pad_ptrs[i] if i < team.size else None
            if i >= team.size:
                fixed[f"B{i}"] = None
        self._template = [fixed.get(a) for a in names]
        self._slots = {a: i for i, a in enumerate(names) if a not in fixed}
        self.types = {a: (dtype if a in "XY" or a[0] == "B" else torch.int32)
                      for a in names if a in ("X", "Y", "EPOCH", "ERR") or (a[0] in "BS" and a[1:].isdigit())}
        self.compiled: dict = {}

    def bind(self, **dynamic) -> "Bound":
        args = self._template.copy()
        for name, value in dynamic.items():
            args[self._slots[name]] = value
        return Bound(self, args, tuple(map(_spec, dynamic.values())))


class Bound:
    """A kernel launch with every argument fixed: ``bound(stream)`` enqueues it.

    The first launch of an alignment class compiles through Triton's JIT (which checks every
    argument); after that a launch goes straight to the compiled kernel's launcher, a few
    microseconds of host time, which keeps eager latency close to the kernel's.
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
        types = k.types
        typed = [_Ptr(a, types[n]) if n in types and a is not None else a for n, a in zip(k.fn.arg_names, self._args)]
        c = k.compiled[self._key] = k.fn[(k.grid,)](*typed, num_warps=k.num_warps)
        self._bind(c)

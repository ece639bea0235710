"""Triton kernels of the peer-memory collectives on CUDA tensors (one-shot and two-shot all-reduce, the
pull all-gather / all-to-all, the reduce-scatter), written on ``xelink.symm``'s device functions.

They follow the rules of ``xelink.symm.cuda`` (pairing of blocks, epochs, scratch parity). How each one
keeps the parity rule: one-barrier kernels (direct, gather, reduce_scatter) stage and read slot ``e & 1``;
the two-shot all-reduce stages its input in slot ``e & 1`` and writes the reduced chunks into slot
``(e + 1) & 1``, from which each rank copies its result after the second barrier (reading slot ``e & 1``
there let a peer's next direct all-reduce push into it mid-copy).

Peer addresses are separate pointer arguments (``B0..B7``, ``S0..S7``) so that Triton specializes them on
16-byte alignment and emits vector loads; unused ones are None. OP codes: ``launch.OPS``.
"""
from __future__ import annotations

import torch

from ...symm.device import block_barrier, notify, pick, triton, wait_at_least

if triton is not None:
    import triton.language as tl

__all__ = ["KERNELS", "acc_type", "available"]

KERNELS: dict = {}


def available() -> bool:
    return triton is not None


if triton is not None:
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
                dst = pick(p, B0, B1, B2, B3, B4, B5, B6, B7) + off + RANK * region
                tl.store(dst + o, v, mask=m)
        block_barrier(S0, S1, S2, S3, S4, S5, S6, S7, ERR, e0 + 1, timeout_ns, pid, RANK, WORLD)
        mine = pick(RANK, B0, B1, B2, B3, B4, B5, B6, B7) + off
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
        mine = pick(RANK, B0, B1, B2, B3, B4, B5, B6, B7) + off
        ar = tl.arange(0, BLOCK)
        tiles = tl.cdiv(chunk, BLOCK)
        if COPY:
            for q in tl.static_range(WORLD):
                for j in range(pid, tiles, G):
                    c = j * BLOCK + ar
                    o = q * chunk + c
                    m = (c < chunk) & (o < n)
                    tl.store(mine + o, tl.load(X + o, mask=m), mask=m)
        block_barrier(S0, S1, S2, S3, S4, S5, S6, S7, ERR, e0 + 1, timeout_ns, pid, RANK, WORLD)
        for j in range(pid, tiles, G):
            c = j * BLOCK + ar
            o = RANK * chunk + c
            m = (c < chunk) & (o < n)
            acc = tl.load(B0 + off + o, mask=m).to(ACC)
            for p in tl.static_range(1, WORLD):
                src = pick(p, B0, B1, B2, B3, B4, B5, B6, B7) + off
                acc = _combine(acc, tl.load(src + o, mask=m).to(ACC), OP)
            if OP == 1:
                acc = acc / WORLD
            val = acc.to(X.dtype.element_ty)
            for p in tl.static_range(WORLD):
                dst = pick(p, B0, B1, B2, B3, B4, B5, B6, B7) + res
                tl.store(dst + o, val, mask=m)
        block_barrier(S0, S1, S2, S3, S4, S5, S6, S7, ERR, e0 + 2, timeout_ns, pid, RANK, WORLD)
        if OUT:
            out = pick(RANK, B0, B1, B2, B3, B4, B5, B6, B7) + res
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
            mine = pick(RANK, B0, B1, B2, B3, B4, B5, B6, B7) + off
            for q in tl.static_range(WORLD if A2A else 1):
                if q != RANK or not A2A:
                    for j in range(pid, tiles, G):
                        c = j * BLOCK + ar
                        m = c < n
                        tl.store(mine + q * b_stride + c, tl.load(X + q * x_stride + c, mask=m), mask=m)
        block_barrier(S0, S1, S2, S3, S4, S5, S6, S7, ERR, e0 + 1, timeout_ns, pid, RANK, WORLD)
        for p in tl.static_range(WORLD):
            if p == RANK:
                src = X + (RANK * x_stride if A2A else 0)
            else:
                src = pick(p, B0, B1, B2, B3, B4, B5, B6, B7) + off + (RANK * b_stride if A2A else 0)
            for j in range(pid, tiles, G):
                c = j * BLOCK + ar
                m = c < n
                tl.store(Y + p * y_stride + c, tl.load(src + c, mask=m), mask=m)
        if COPY:
            tl.store(EPOCH + pid, e0 + 1)
        else:
            block_barrier(S0, S1, S2, S3, S4, S5, S6, S7, ERR, e0 + 2, timeout_ns, pid, RANK, WORLD)
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
            mine = pick(RANK, B0, B1, B2, B3, B4, B5, B6, B7) + off
            for q in tl.static_range(WORLD):
                for j in range(pid, tiles, G):
                    c = j * BLOCK + ar
                    m = c < n
                    tl.store(mine + q * b_stride + c, tl.load(X + q * x_stride + c, mask=m), mask=m)
        block_barrier(S0, S1, S2, S3, S4, S5, S6, S7, ERR, e0 + 1, timeout_ns, pid, RANK, WORLD)
        for j in range(pid, tiles, G):
            c = j * BLOCK + ar
            m = c < n
            o = RANK * b_stride + c
            acc = tl.load(B0 + off + o, mask=m).to(ACC)
            for p in tl.static_range(1, WORLD):
                src = pick(p, B0, B1, B2, B3, B4, B5, B6, B7) + off
                acc = _combine(acc, tl.load(src + o, mask=m).to(ACC), OP)
            if OP == 1:
                acc = acc / WORLD
            tl.store(Y + c, acc.to(Y.dtype.element_ty), mask=m)
        if COPY:
            tl.store(EPOCH + pid, e0 + 1)
        else:
            block_barrier(S0, S1, S2, S3, S4, S5, S6, S7, ERR, e0 + 2, timeout_ns, pid, RANK, WORLD)
            tl.store(EPOCH + pid, e0 + 2)

    # Sizes and the deadline are int64 and never specialized, so one compiled kernel per word and alignment
    # serves every message (all of them are loaded up front: see gpu/p2p.py's _preload).
    @triton.jit(do_not_specialize=["n", "nbytes", "timeout_ns"])
    def _p2p_send(X, INBOX, READY, FREE, SENT, HEADER, ERR, n: tl.int64, nbytes: tl.int64, timeout_ns: tl.int64,
                  CHUNK: tl.constexpr, SLOTS: tl.constexpr, TILE: tl.constexpr):
        """Push ``n`` words of X to the peer in chunks of CHUNK words through its inbox of SLOTS slots.

        Per block b: ``SENT[b]`` counts the chunks this rank pushed so far (local), ``FREE[b]`` the
        chunks the peer consumed (the peer adds), ``READY[b]`` (the peer's) the chunks pushed. Chunk s
        goes to slot ``s % SLOTS`` once the peer consumed chunk ``s - SLOTS``. Block b moves tiles
        ``j % G == b`` of every chunk (TILE words, the same bytes on both sides), and writes the message
        size into its header of the slot (one per block: only block b's counters order it) so that the
        receiver can refuse a buffer of another size.
        """
        pid = tl.program_id(0)
        G = tl.num_programs(0)
        s0 = tl.load(SENT + pid)
        ar = tl.arange(0, TILE)
        chunks = tl.cdiv(n, CHUNK)
        for c in range(chunks):
            s = s0 + c
            wait_at_least(FREE + pid, s - SLOTS + 1, ERR, 0, timeout_ns)
            base = c.to(tl.int64) * CHUNK
            dst = INBOX + (s % SLOTS).to(tl.int64) * CHUNK
            for j in range(pid, CHUNK // TILE, G):
                o = j * TILE + ar
                m = base + o < n
                tl.store(dst + o, tl.load(X + base + o, mask=m), mask=m)
            tl.store(HEADER + (s % SLOTS) * G + pid, nbytes)
            notify(READY + pid)
        tl.store(SENT + pid, s0 + chunks)

    @triton.jit(do_not_specialize=["n", "nbytes", "timeout_ns"])
    def _p2p_recv(Y, INBOX, READY, FREE, GOT, HEADER, ERR, n: tl.int64, nbytes: tl.int64, timeout_ns: tl.int64,
                  CHUNK: tl.constexpr, SLOTS: tl.constexpr, TILE: tl.constexpr):
        """Take ``n`` words from the peer's pushes (``_p2p_send``) into Y. ``GOT[b]`` counts the chunks
        this rank consumed (local), ``READY[b]`` the chunks the peer pushed, ``FREE[b]`` (the peer's) the
        chunks consumed. A header that disagrees with ``nbytes`` is reported (ERR[2], the sent size in
        ERR[3]) and the chunk dropped; after a wait past the deadline (ERR[0]) the slot holds no message, so
        nothing is read from it and the deadline stays the error reported."""
        pid = tl.program_id(0)
        G = tl.num_programs(0)
        g0 = tl.load(GOT + pid)
        ar = tl.arange(0, TILE)
        chunks = tl.cdiv(n, CHUNK)
        for c in range(chunks):
            g = g0 + c
            late = wait_at_least(READY + pid, g + 1, ERR, 0, timeout_ns)
            sent = tl.load(HEADER + (g % SLOTS) * G + pid, volatile=True)
            if late != 0:
                pass
            elif sent != nbytes:
                tl.store(ERR + 3, sent.to(tl.int32))
                tl.store(ERR + 2, 1)
            else:
                base = c.to(tl.int64) * CHUNK
                src = INBOX + (g % SLOTS).to(tl.int64) * CHUNK
                for j in range(pid, CHUNK // TILE, G):
                    o = j * TILE + ar
                    m = base + o < n
                    tl.store(Y + base + o, tl.load(src + o, mask=m), mask=m)
            notify(FREE + pid)
        tl.store(GOT + pid, g0 + chunks)

    KERNELS.update(p2p_send=_p2p_send, p2p_recv=_p2p_recv)

    KERNELS.update(direct_all_reduce=_direct_all_reduce, two_shot_all_reduce=_two_shot_all_reduce, gather=_gather,
                   reduce_scatter=_reduce_scatter)

# Accumulation type per data type: half types reduce in float32.
_ACC = {torch.float16: "float32", torch.bfloat16: "float32", torch.float32: "float32", torch.float64: "float64",
        torch.int32: "int32", torch.int64: "int64"}


def acc_type(dtype: torch.dtype):
    """The Triton type a kernel reduces ``dtype`` in."""
    return getattr(tl, _ACC[dtype])

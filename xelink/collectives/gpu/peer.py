"""xelink's peer-memory algorithms on CUDA tensors (one host, CUDA IPC): the one-shot and two-shot
all-reduce, the copy-engine paths, the pull all-gather / all-to-all and the reduce-scatter.

Each call builds its launch plan once (``launch``) and then replays it; inputs that are symmetric
(``xelink.empty``) are read in place by the peers, others are staged through the team's scratch slots
(the parity rule of ``xelink.symm.cuda`` says which slot each kernel may touch when).
"""
from __future__ import annotations

import torch

from ...symm import Copy, Join
from .launch import OPS, done, kernel, launch, peers, pieces, round16, symmetric

__all__ = ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "SMALL"]

SMALL = 512 << 10  # bytes up to which the direct all-reduce runs the small configuration


def all_reduce(comm, x, op, async_op, timeout, *, algo):
    """``algo``: direct (one-shot push), two_shot, copy_engine (input from ``xelink.empty``)."""
    fn = "all_reduce"
    sym = symmetric(comm, x) if algo != "direct" else None
    key = (fn, x.data_ptr(), x.numel(), x.dtype, op, algo, timeout, sym)
    launch(comm, fn, timeout, key, lambda team, t_ns: _all_reduce_plan(team, x, op, algo, sym, t_ns))
    return done(comm, fn, async_op)


def all_gather_into_tensor(comm, out, inp, async_op, timeout, *, algo):
    """``algo``: direct (every rank pulls every shard), copy_engine (the DMA engines pull)."""
    fn = "all_gather_into_tensor"
    x, y = inp.view(-1), out.view(-1)
    sym = symmetric(comm, x)
    key = (fn, y.data_ptr(), x.data_ptr(), x.numel(), x.dtype, algo, timeout, sym)
    if algo == "copy_engine":
        launch(comm, fn, timeout, key, lambda team, t_ns: _copy_engine_plan(team, y, x, sym, t_ns))
    else:
        launch(comm, fn, timeout, key, lambda team, t_ns: _gather_plan(team, y, x, x.numel(), sym, False, t_ns))
    return done(comm, fn, async_op)


def reduce_scatter_tensor(comm, out, inp, op, async_op, timeout, *, algo="direct"):
    fn = "reduce_scatter_tensor"
    x, y = inp.view(-1), out.view(-1)
    sym = symmetric(comm, x)
    key = (fn, y.data_ptr(), x.data_ptr(), y.numel(), x.dtype, op, algo, timeout, sym)
    launch(comm, fn, timeout, key, lambda team, t_ns: _reduce_scatter_plan(team, y, x, op, sym, t_ns))
    return done(comm, fn, async_op)


def all_to_all_single(comm, out, inp, async_op, timeout, *, algo="direct"):
    fn = "all_to_all_single"
    x, y = inp.view(-1), out.view(-1)
    sym = symmetric(comm, x)
    key = (fn, y.data_ptr(), x.data_ptr(), x.numel(), x.dtype, algo, timeout, sym)
    n = x.numel() // comm.size
    launch(comm, fn, timeout, key, lambda team, t_ns: _gather_plan(team, y, x, n, sym, True, t_ns))
    return done(comm, fn, async_op)


def _all_reduce_plan(team, x, op, algo, sym, timeout_ns):
    n, es, ptr = x.numel(), x.element_size(), x.data_ptr()
    code = OPS[op]
    if algo == "copy_engine":
        return _copy_engine_all_reduce_plan(team, x, code, sym, timeout_ns)
    if sym is not None:  # two-shot in place on a symmetric tensor: no copies at all
        k = kernel(team, "two_shot_all_reduce", x.dtype, OP=code, ACC=None, COPY=False, OUT=False)
        return [k.bind(X=ptr, Y=ptr, **peers(sym), n=n, chunk=round16(-(-n // team.size)), slot=0,
                       timeout_ns=timeout_ns)]
    slot = team.ensure_scratch(n * es, "all_reduce") // es
    if algo == "two_shot":
        k = kernel(team, "two_shot_all_reduce", x.dtype, OP=code, ACC=None, COPY=True, OUT=True)
        per = (slot // team.size) // 16 * 16 * team.size
        return [k.bind(X=ptr + s * es, Y=ptr + s * es, **peers(team.scratch_ptrs), n=m,
                       chunk=round16(-(-m // team.size)), slot=slot, timeout_ns=timeout_ns)
                for s, m in pieces(n, per)]
    k = kernel(team, "direct_all_reduce", x.dtype, small=n * es <= SMALL, OP=code, ACC=None)
    slot = team.ensure_scratch(team.size * round16(n) * es, "all_reduce") // es  # a region per rank
    return [k.bind(X=ptr + s * es, Y=ptr + s * es, **peers(team.scratch_ptrs), n=m, region=round16(m),
                   slot=slot, timeout_ns=timeout_ns) for s, m in pieces(n, slot // team.size // 16 * 16)]


def _copy_engine_all_reduce_plan(team, x, code, sym, timeout_ns):
    """Reduce-scatter on the SMs (each rank reduces its chunk of the symmetric ``x`` in place), then
    the copy engines pull the peers' reduced chunks, then a barrier (no peer may change ``x`` while
    another still pulls from it). The reduce-scatter kernel's second barrier orders the pulls after
    the peers' chunks are final."""
    n, es, ptr = x.numel(), x.element_size(), x.data_ptr()
    w, r = team.size, team.rank
    chunk = round16(-(-n // w))
    bounds = [min(q * chunk, n) for q in range(w + 1)]
    rs = kernel(team, "reduce_scatter", x.dtype, OP=code, ACC=None, COPY=False)
    mine = bounds[r + 1] - bounds[r]
    plan = [rs.bind(X=ptr, Y=ptr + bounds[r] * es, **peers(sym), n=mine, x_stride=chunk, b_stride=chunk, slot=0,
                    timeout_ns=timeout_ns)]
    for i in range(1, w):
        p = (r + i) % w
        size = (bounds[p + 1] - bounds[p]) * es
        if size:
            plan.append(Copy(ptr + bounds[p] * es, sym[p] + bounds[p] * es, size))
    plan.append(team.barrier_piece(timeout_ns))
    return plan


def _gather_plan(team, out, inp, n, sym, a2a, timeout_ns):
    """Y[p*n + i] = rank p's X[(RANK if a2a else 0)*n + i] through the ``gather`` kernel, in pieces."""
    es = inp.element_size()
    if sym is not None:
        k = kernel(team, "gather", inp.dtype, A2A=a2a, COPY=False)
        return [k.bind(X=inp.data_ptr(), Y=out.data_ptr(), **peers(sym), n=n, x_stride=n, b_stride=n,
                       y_stride=n, slot=0, timeout_ns=timeout_ns)]
    staged = team.size if a2a else 1
    fn = "all_to_all_single" if a2a else "all_gather_into_tensor"
    slot = team.ensure_scratch(staged * n * es, fn) // es
    k = kernel(team, "gather", inp.dtype, A2A=a2a, COPY=True)
    return [k.bind(X=inp.data_ptr() + s * es, Y=out.data_ptr() + s * es, **peers(team.scratch_ptrs), n=m,
                   x_stride=n, b_stride=m, y_stride=n, slot=slot, timeout_ns=timeout_ns)
            for s, m in pieces(n, slot // staged // 16 * 16)]


def _copy_engine_plan(team, out, inp, sym, timeout_ns):
    """Barrier, then the copy engines pull every peer's shard over the links, then a barrier.

    A symmetric input is read in place; another is first staged in the scratch buffer, after a
    barrier that makes sure no peer still reads the scratch buffer.
    """
    es, n = inp.element_size(), inp.numel()
    nbytes = n * es
    barrier = team.barrier_piece(timeout_ns)
    plan = []
    if sym is None:
        team.ensure_scratch(nbytes, "all_gather_into_tensor")
        if nbytes > team.slot:
            raise ValueError(f"all_gather_into_tensor: algo='copy_engine' stages at most {team.slot} B of an "
                             f"input that is not from xelink.empty (got {nbytes} B)")
        plan += [barrier, Copy(team.scratch_ptrs[team.rank], inp.data_ptr(), nbytes)]
        sym = team.scratch_ptrs
    plan.append(barrier)
    aside = (torch.cuda.Stream(team.device), torch.cuda.Event(), torch.cuda.Event())
    plan.append(Copy(out.data_ptr() + team.rank * nbytes, inp.data_ptr(), nbytes, aside))
    for i in range(1, team.size):
        p = (team.rank + i) % team.size
        plan.append(Copy(out.data_ptr() + p * nbytes, sym[p], nbytes))
    plan += [Join(aside[2]), barrier]
    return plan


def _reduce_scatter_plan(team, y, x, op, sym, timeout_ns):
    es, n, code = x.element_size(), y.numel(), OPS[op]
    if sym is not None:
        k = kernel(team, "reduce_scatter", x.dtype, OP=code, ACC=None, COPY=False)
        return [k.bind(X=x.data_ptr(), Y=y.data_ptr(), **peers(sym), n=n, x_stride=n, b_stride=n, slot=0,
                       timeout_ns=timeout_ns)]
    slot = team.ensure_scratch(x.numel() * es, "reduce_scatter_tensor") // es
    k = kernel(team, "reduce_scatter", x.dtype, OP=code, ACC=None, COPY=True)
    return [k.bind(X=x.data_ptr() + s * es, Y=y.data_ptr() + s * es, **peers(team.scratch_ptrs), n=m,
                   x_stride=n, b_stride=m, slot=slot, timeout_ns=timeout_ns)
            for s, m in pieces(n, slot // team.size // 16 * 16)]


"""Rooted collectives: broadcast, reduce, gather, scatter (direct: the root talks to every rank)."""
from __future__ import annotations

import torch

from ._common import (as_tensor, check_op_dtype, check_rank, combine, finish, fingerprint_check, group_of, parse_op,
                      run, step, tag_for, work_dtype)

__all__ = ["broadcast", "reduce", "gather", "scatter"]


def broadcast(tensor, src: int, group=None, async_op: bool = False, timeout=None):
    """Copy ``tensor`` of rank ``src`` (a rank of ``group``) into ``tensor`` on every rank, in place.

    Collective: every rank of ``group`` must call this with the same shape and dtype.
    """
    fn = "broadcast"
    comm = group_of(group, fn)
    x = as_tensor(fn, "tensor", tensor)
    check_rank(fn, "src", src, comm.size)
    fingerprint_check(comm, fn, (fn, tuple(x.shape), str(x.dtype), src))

    def body(deadline):
        if comm.size == 1:
            return
        sends = [(p, x) for p in range(comm.size) if p != src] if comm.rank == src else []
        recvs = [] if comm.rank == src else [(src, x)]
        step(comm, sends, recvs, tag_for(comm), deadline, fn)

    return run(comm, fn, body, async_op, timeout)


def reduce(tensor, dst: int, op="sum", group=None, async_op: bool = False, timeout=None):
    """Reduce ``tensor`` over all ranks into ``tensor`` of rank ``dst`` (others keep theirs).

    Collective: every rank of ``group`` must call this with the same shape, dtype and op.
    """
    fn = "reduce"
    comm = group_of(group, fn)
    x = as_tensor(fn, "tensor", tensor, reduce=True)
    op = parse_op(fn, op)
    check_op_dtype(fn, op, x.dtype)
    check_rank(fn, "dst", dst, comm.size)
    fingerprint_check(comm, fn, (fn, tuple(x.shape), str(x.dtype), op, dst))

    def body(deadline):
        n = comm.size
        if comm.rank != dst:
            step(comm, [(dst, x)], [], tag_for(comm), deadline, fn)
            return
        parts = [x if p == dst else torch.empty_like(x) for p in range(n)]
        step(comm, [], [(p, parts[p]) for p in range(n) if p != dst], tag_for(comm), deadline, fn)
        acc = parts[0].to(work_dtype(x.dtype), copy=True)
        for p in range(1, n):
            combine(acc, parts[p], op)
        x.copy_(finish(acc, op, n))

    return run(comm, fn, body, async_op, timeout)


def _list(fn, name, items, comm, like):
    if not isinstance(items, (list, tuple)) or len(items) != comm.size:
        raise ValueError(f"{fn}: {name} must be a list of world_size={comm.size} tensors on the root")
    out = [as_tensor(fn, f"{name}[{i}]", t) for i, t in enumerate(items)]
    for i, t in enumerate(out):
        if t.dtype != like.dtype or t.numel() != like.numel():
            raise ValueError(f"{fn}: {name}[{i}] has {t.numel()} x {t.dtype}, expected {like.numel()} x {like.dtype}")
    return out


def gather(tensor, gather_list=None, dst: int = 0, group=None, async_op: bool = False, timeout=None):
    """Rank ``dst`` receives every rank's ``tensor`` in ``gather_list`` (None on the other ranks).

    Collective: every rank of ``group`` must call this.
    """
    fn = "gather"
    comm = group_of(group, fn)
    x = as_tensor(fn, "tensor", tensor)
    check_rank(fn, "dst", dst, comm.size)
    if comm.rank == dst:
        outs = _list(fn, "gather_list", gather_list, comm, x)
    elif gather_list is not None:
        raise ValueError(f"{fn}: gather_list must be None on non-destination rank {comm.rank}")
    fingerprint_check(comm, fn, (fn, tuple(x.shape), str(x.dtype), dst))

    def body(deadline):
        if comm.rank != dst:
            step(comm, [(dst, x)], [], tag_for(comm), deadline, fn)
            return
        outs[dst].view(-1).copy_(x.reshape(-1))
        step(comm, [], [(p, outs[p]) for p in range(comm.size) if p != dst], tag_for(comm), deadline, fn)

    return run(comm, fn, body, async_op, timeout)


def scatter(tensor, scatter_list=None, src: int = 0, group=None, async_op: bool = False, timeout=None):
    """Rank ``src`` sends ``scatter_list[r]`` to rank r, which receives it into ``tensor``.

    Collective: every rank of ``group`` must call this.
    """
    fn = "scatter"
    comm = group_of(group, fn)
    x = as_tensor(fn, "tensor", tensor)
    check_rank(fn, "src", src, comm.size)
    if comm.rank == src:
        ins = _list(fn, "scatter_list", scatter_list, comm, x)
    elif scatter_list is not None:
        raise ValueError(f"{fn}: scatter_list must be None on non-source rank {comm.rank}")
    fingerprint_check(comm, fn, (fn, tuple(x.shape), str(x.dtype), src))

    def body(deadline):
        if comm.rank != src:
            step(comm, [], [(src, x)], tag_for(comm), deadline, fn)
            return
        x.view(-1).copy_(ins[src].reshape(-1))
        step(comm, [(p, ins[p]) for p in range(comm.size) if p != src], [], tag_for(comm), deadline, fn)

    return run(comm, fn, body, async_op, timeout)

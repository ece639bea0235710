"""Rooted collectives on CPU ranks: broadcast, reduce, gather, scatter (direct: the root talks to every rank)."""
from __future__ import annotations

import torch

from .base import reduce_into, step, tag_for

__all__ = ["broadcast", "reduce", "gather", "scatter"]


def broadcast(comm, x, src, deadline):
    if comm.size == 1:
        return
    sends = [(p, x) for p in range(comm.size) if p != src] if comm.rank == src else []
    recvs = [] if comm.rank == src else [(src, x)]
    step(comm, sends, recvs, tag_for(comm), deadline, "broadcast")


def reduce(comm, x, dst, op, deadline):
    n = comm.size
    if comm.rank != dst:
        step(comm, [(dst, x)], [], tag_for(comm), deadline, "reduce")
        return
    parts = [x if p == dst else torch.empty_like(x) for p in range(n)]
    step(comm, [], [(p, parts[p]) for p in range(n) if p != dst], tag_for(comm), deadline, "reduce")
    reduce_into(x, parts, op, disjoint=False)  # parts[dst] is x


def gather(comm, x, outs, dst, deadline):
    if comm.rank != dst:
        step(comm, [(dst, x)], [], tag_for(comm), deadline, "gather")
        return
    outs[dst].view(-1).copy_(x.reshape(-1))
    step(comm, [], [(p, outs[p]) for p in range(comm.size) if p != dst], tag_for(comm), deadline, "gather")


def scatter(comm, x, ins, src, deadline):
    if comm.rank != src:
        step(comm, [], [(src, x)], tag_for(comm), deadline, "scatter")
        return
    x.view(-1).copy_(ins[src].reshape(-1))
    step(comm, [(p, ins[p]) for p in range(comm.size) if p != src], [], tag_for(comm), deadline, "scatter")

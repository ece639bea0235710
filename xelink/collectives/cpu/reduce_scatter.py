"""Reduce-scatter on CPU ranks: ring, destination-split (direct), and hierarchical (reduce inside the
package first). ``out`` is this rank's block, ``inp`` the flat input of ``comm.size`` blocks."""
from __future__ import annotations

import torch

from .all_gather import cross_target
from .all_reduce import ring_reduce_scatter
from .base import bounds, chunks, combine, finish, reduce_into, step, tag_for, work_copy, work_dtype

__all__ = ["ring", "dest_split", "hierarchical"]


def ring(comm, out, inp, op, deadline):
    n, r = comm.size, comm.rank
    parts = chunks(work_copy(inp), bounds(inp.numel(), n))  # n blocks of out.numel()
    ring_reduce_scatter(comm, parts, op, tag_for(comm), deadline, "reduce_scatter_tensor")
    out.copy_(finish(parts[r], op, n))


def dest_split(comm, out, inp, op, deadline):
    n, r = comm.size, comm.rank
    blocks = chunks(inp, bounds(inp.numel(), n))  # n blocks of out.numel()
    parts = {p: torch.empty_like(out) for p in range(n) if p != r}
    step(comm, [(p, blocks[p]) for p in parts], list(parts.items()), tag_for(comm), deadline,
         "reduce_scatter_tensor")
    parts[r] = blocks[r]
    reduce_into(out, [parts[p] for p in range(n)], op)


def hierarchical(comm, out, inp, op, deadline):
    """Sum each package's contributions before they cross the fabric, so each crosses once per package.

    For destination d, the aggregator in package P is d itself when d is in P, else the member of P
    that the topology-aware all-gather pairs with d (``cross_target``). Step 1 (inside packages):
    every rank sends block d to its package's aggregator for d. Step 2 (across): each aggregator
    sends its package's partial of block d to d, which combines the partials of all packages in
    package order (the same order on every rank, so every run gives the same bits).
    """
    fn = "reduce_scatter_tensor"
    n, r, m = comm.size, comm.rank, out.numel()
    packages = comm.packages
    me_p, _ = comm.package_index(r)
    wd = work_dtype(inp.dtype)
    inner = "sum" if op == "avg" else op

    def aggregator(p, d):
        d_p, d_i = comm.package_index(d)
        return d if d_p == p else cross_target(packages, d_i, p)

    block = lambda d: inp[d * m:(d + 1) * m]  # noqa: E731
    mine = [d for d in range(n) if aggregator(me_p, d) == r]  # blocks I aggregate for my package
    # Step 1: inside my package.
    sends = [(aggregator(me_p, d), block(d)) for d in range(n) if aggregator(me_p, d) != r]
    members = [q for q in packages[me_p] if q != r]
    incoming = {(q, d): torch.empty(m, dtype=inp.dtype) for d in mine for q in members}
    step(comm, sends, [(q, incoming[q, d]) for d in mine for q in members], tag_for(comm), deadline, fn)
    partial = {}
    for d in mine:
        acc = None
        for q in packages[me_p]:
            x = block(d) if q == r else incoming[q, d]
            if acc is None:
                acc = x.to(wd, copy=True)
            else:
                combine(acc, x, inner)
        partial[d] = acc
    # Step 2: across packages, each partial goes to its destination once.
    sends = [(d, partial[d]) for d in mine if d != r]
    from_pkgs = [p for p in range(len(packages)) if p != me_p]
    got = {p: torch.empty(m, dtype=wd) for p in from_pkgs}
    step(comm, sends, [(aggregator(p, r), got[p]) for p in from_pkgs], tag_for(comm), deadline, fn)
    got[me_p] = partial[r]
    acc = got[0].clone()
    for p in range(1, len(packages)):
        combine(acc, got[p], inner)
    if op == "avg":
        acc.div_(n)
    out.copy_(acc)

"""Reduce-scatter: ring, destination-split (direct), and hierarchical (reduce inside the package first)."""
from __future__ import annotations

import torch

from . import _groups
from . import gpu
from ._common import (check_algo, check_op_dtype, combine, finish, fingerprint_check, group_of, is_cuda,
                      output_input, parse_op, run, step, tag_for, work_dtype)
from .all_gather import cross_target
from .all_reduce import _ring_reduce_scatter

__all__ = ["reduce_scatter_tensor", "ALGOS"]

ALGOS = ("ring", "dest_split", "hierarchical")


def reduce_scatter_tensor(output, input, op="sum", group=None, async_op: bool = False, algo: str = "auto",
                          timeout=None):
    """Reduce ``input`` over all ranks and leave block ``rank`` of the result in ``output``.

    Args:
        output: this rank's block, ``input.numel() / world_size`` elements, same dtype.
        input: ``world_size`` equal blocks in rank order (torch.distributed.reduce_scatter_tensor).
        op: "sum", "avg" (floating dtypes), "max", "min", "prod" (half types reduced in float32).
        algo: "auto" or one of ``ALGOS``.
        timeout: deadline in seconds (default: the group's).

    Returns:
        None, or a ``Work`` when ``async_op``.

    Collective: every rank of ``group`` must call this with the same shapes, dtype and op.
    """
    fn = "reduce_scatter_tensor"
    if torch.compiler.is_compiling():
        from . import compiled

        compiled.traced(fn, async_op)
        return torch.ops.xelink.reduce_scatter_tensor_(output, input, parse_op(fn, op), algo,
                                                       compiled.group_name(group))
    comm = group_of(group, fn)
    if is_cuda(output) or is_cuda(input):
        return gpu.reduce_scatter_tensor(comm, output, input, parse_op(fn, op), algo, async_op, timeout)
    out, inp = output_input(fn, output, input, reduce=True)
    op = parse_op(fn, op)
    check_op_dtype(fn, op, inp.dtype)
    if inp.numel() != comm.size * out.numel():
        raise ValueError(f"{fn}: input.numel()={inp.numel()} != world_size*output.numel()="
                         f"{comm.size * out.numel()}")
    check_algo(fn, algo, ALGOS)
    fingerprint_check(comm, fn, (fn, tuple(out.shape), str(out.dtype), op, algo))
    if algo == "auto" and comm.size > 1:
        from .dispatch import choose

        algo = choose(comm, "reduce_scatter", inp.numel() * inp.element_size(), inp.dtype)
    return run(comm, fn, lambda deadline: _scatter(comm, out.view(-1), inp.reshape(-1), op, algo, deadline, fn),
               async_op, timeout)


def _scatter(comm, out, inp, op, algo, deadline, fn):
    n, r, m = comm.size, comm.rank, out.numel()
    if n == 1:
        out.copy_(inp)
        return
    if algo == "ring":
        acc = inp.to(work_dtype(inp.dtype), copy=True)
        _ring_reduce_scatter(comm, acc, op, tag_for(comm), deadline)
        out.copy_(finish(acc[r * m:(r + 1) * m], op, n))
        return
    if algo == "dest_split":
        parts = {p: torch.empty(m, dtype=inp.dtype) for p in range(n) if p != r}
        step(comm, [(p, inp[p * m:(p + 1) * m]) for p in parts], list(parts.items()), tag_for(comm), deadline, fn)
        parts[r] = inp[r * m:(r + 1) * m]
        acc = parts[0].to(work_dtype(inp.dtype), copy=True)
        for p in range(1, n):
            combine(acc, parts[p], op)
        out.copy_(finish(acc, op, n))
        return
    _hierarchical(comm, out, inp, op, deadline, fn)


def _hierarchical(comm, out, inp, op, deadline, fn):
    """Sum each package's contributions before they cross the fabric, so each crosses once per package.

    For destination d, the aggregator in package P is d itself when d is in P, else the member of P
    that the topology-aware all-gather pairs with d (``cross_target``). Step 1 (inside packages):
    every rank sends block d to its package's aggregator for d. Step 2 (across): each aggregator
    sends its package's partial of block d to d, which combines the partials of all packages in
    package order (the same order on every rank, so every run gives the same bits).
    """
    n, r, m = comm.size, comm.rank, out.numel()
    packages = _groups.layout(comm)
    me_p, _ = _groups.where(packages, r)
    wd = work_dtype(inp.dtype)
    inner = "sum" if op == "avg" else op

    def aggregator(p, d):
        d_p, d_i = _groups.where(packages, d)
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

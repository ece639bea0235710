"""The CPU backend: collectives on CPU tensors (and numpy arrays) over the host transports (MPI, or
torch.distributed's gloo under torchrun), with MPI-3 shared memory for the one-shot all-reduce.

Importing it registers its algorithms (``registry``). The op functions below take checked, contiguous
tensors and a resolved ``registry.Algorithm``; they run the call now, or on the communicator's worker
thread when ``async_op`` (a ``Work`` handle).
"""
from __future__ import annotations

import sys

import torch

from .. import registry
from . import all_gather as _ag, all_reduce as _ar, all_to_all as _a2a, reduce_scatter as _rs, rooted
from .base import Work, chunks, run

__all__ = ["BACKEND", "MODEL_AUTO", "size_rule", "unmet", "Work", "all_reduce", "all_gather_into_tensor", "all_gather",
           "reduce_scatter_tensor",
           "all_to_all_single", "broadcast", "reduce", "gather", "scatter", "barrier"]

BACKEND = "cpu"
# algo="auto" on CPU tensors: the measured tuning table, else the cost model, else the size rule.
MODEL_AUTO = True
# The size rule: below this many bytes one round of messages (direct) beats the 2(n-1) rounds of a
# ring; above it the ring's bandwidth efficiency wins, or the hierarchical path with several packages.
_DIRECT_MAX_BYTES = 64 << 10
_RULE = {"all_reduce": ("direct", "ring", "hierarchical"), "all_gather": ("direct", "ring", "topo"),
         "reduce_scatter": ("dest_split", "ring", "hierarchical")}

for _op, _algos in (
    ("all_reduce", ((_ar.ring, "reduce-scatter then all-gather around the ring"),
                    (_ar.direct, "one-shot: every rank reads every peer's buffer (shared memory on one host)"),
                    (_ar.two_shot, "each rank reduces one chunk from every peer, then sends it to every peer"),
                    (_ar.hierarchical, "reduce-scatter in each package, all-reduce across, all-gather in each"))),
    ("all_gather", ((_ag.ring, "n-1 steps around the ring"), (_ag.direct, "every shard to every rank at once"),
                    (_ag.topo, "each shard crosses once per remote package, then is copied inside it"))),
    ("reduce_scatter", ((_rs.ring, "n-1 steps around the ring"),
                        (_rs.dest_split, "every block straight to its destination, which reduces"),
                        (_rs.hierarchical, "blocks summed inside the package before they cross"))),
    ("all_to_all", ((_a2a.dest_split, "every block straight to its destination"),)),
    ("broadcast", ((rooted.broadcast, "the root sends to every rank"),)),
):
    for _impl, _summary in _algos:
        registry.register(_op, "direct" if _op == "broadcast" else _impl.__name__, BACKEND, _impl,
                          summary=_summary)


registry.add_backend(BACKEND, sys.modules[__name__])


def size_rule(comm, op: str, nbytes: int) -> str | None:
    if op not in _RULE:
        return None  # one algorithm: it is the choice
    small, flat, hier = _RULE[op]
    return small if nbytes <= _DIRECT_MAX_BYTES else (hier if len(comm.packages) > 1 else flat)


def unmet(comm, algo, x=None) -> Exception | None:
    """Every CPU algorithm runs on any communicator (layouts of any shape included)."""
    return None


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) as one dimension; a 1-D tensor as it is (a view costs about a microsecond)."""
    return t if t.dim() == 1 else t.view(-1)


def all_reduce(comm, x, op, algo, async_op, timeout):
    flat = _flat(x)

    def body(deadline):
        if comm.size > 1:  # (a world of one has nothing to reduce; the call still returns None, as torch's)
            algo.impl(comm, flat, op, deadline)

    return run(comm, "all_reduce", body, async_op, timeout)


def _gather_into(comm, out, inp, algo, deadline):
    n, r, m = comm.size, comm.rank, inp.numel()
    if n == 1 or not m:
        out.copy_(inp)
        return
    parts = chunks(out, [i * m for i in range(n + 1)])
    parts[r].copy_(inp)
    algo.impl(comm, parts, inp, deadline)


def all_gather_into_tensor(comm, out, inp, algo, async_op, timeout):
    return run(comm, "all_gather_into_tensor", lambda d: _gather_into(comm, _flat(out), _flat(inp), algo, d),
               async_op, timeout)


def all_gather(comm, outs, inp, algo, async_op, timeout):
    """List form: ``outs[r]`` receives rank r's ``inp``."""
    def body(deadline):
        m = inp.numel()
        flat = torch.empty(comm.size * m, dtype=inp.dtype)
        _gather_into(comm, flat, _flat(inp), algo, deadline)
        for i, t in enumerate(outs):
            t.view(-1).copy_(flat[i * m:(i + 1) * m])

    return run(comm, "all_gather", body, async_op, timeout)


def reduce_scatter_tensor(comm, out, inp, op, algo, async_op, timeout):
    def body(deadline):
        if comm.size == 1:
            _flat(out).copy_(_flat(inp))
        else:
            algo.impl(comm, _flat(out), _flat(inp), op, deadline)

    return run(comm, "reduce_scatter_tensor", body, async_op, timeout)


def all_to_all_single(comm, out, inp, out_splits, in_splits, algo, async_op, timeout):
    n = comm.size
    row = 1
    for d in inp.shape[1:]:
        row *= d
    io = [sum(in_splits[:j]) * row for j in range(n + 1)]
    oo = [sum(out_splits[:j]) * row for j in range(n + 1)]
    return run(comm, "all_to_all_single", lambda d: algo.impl(comm, _flat(out), _flat(inp), io, oo, d),
               async_op, timeout)


def broadcast(comm, x, src, algo, async_op, timeout):
    return run(comm, "broadcast", lambda d: algo.impl(comm, x, src, d), async_op, timeout)


def reduce(comm, x, dst, op, async_op, timeout):
    return run(comm, "reduce", lambda d: rooted.reduce(comm, x, dst, op, d), async_op, timeout)


def gather(comm, x, outs, dst, async_op, timeout):
    return run(comm, "gather", lambda d: rooted.gather(comm, x, outs, dst, d), async_op, timeout)


def scatter(comm, x, ins, src, async_op, timeout):
    return run(comm, "scatter", lambda d: rooted.scatter(comm, x, ins, src, d), async_op, timeout)


def barrier(comm, async_op, timeout):
    return run(comm, "barrier", lambda d: comm.barrier(d.remaining() or 1e-9), async_op, timeout)

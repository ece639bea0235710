"""Autograd of the distributed GEMMs (the layers of sequence and tensor parallelism): each backward is built from
the public ops themselves:

- ``all_gather_matmul`` (c_i = gather(a) @ b_i): grad a = this rank's block of the sum over ranks of
  ``sum_i grad c_i @ b_i^T``, which is ``matmul_reduce_scatter(cat(grad c_i), cat(b_i)^T)``; grad b_i =
  ``gather(a)^T @ grad c_i`` (the gathered a kept from the forward). With ``return_gathered`` the gathered a
  is differentiable too: its gradient joins the sum before one ``reduce_scatter_tensor``.
- ``matmul_reduce_scatter`` (c = block of sum over ranks of a @ b): grad a = ``gather(grad c) @ b^T``, which
  is ``all_gather_matmul(grad c, b^T)``; grad b = ``a^T @ gather(grad c)`` (``avg`` scales both by 1/n).
- ``matmul_all_reduce`` (c = sum over ranks of a @ b, on every rank): every rank's c feeds that rank's loss,
  so the gradient of the total is the sum over ranks of grad c (torch.distributed.nn's all_reduce): grad a =
  ``all_reduce(grad c) @ b^T``, grad b = ``a^T @ all_reduce(grad c)``.

One convention throughout (torch.distributed.nn's): the loss a job minimises is the sum of every rank's loss,
each rank's tensors its own variables. Ranks that hold shards of a sequence compute their shards' losses and
nothing more is needed; ranks that compute one loss alike (the replicated output of tensor parallelism)
divide it by their number; a tensor replicated on several ranks (a weight, an input) gets each rank's share
of its gradient, which the user sums (``all_reduce``), as data parallelism does.

The backward calls run the forward's algorithm (``auto`` for ``fused``, whose conditions the transposed
problems need not meet). They are collective: every rank must back-propagate, with the same inputs requiring
grad (``XELINK_CHECK=1`` checks that in the forward).
"""
from __future__ import annotations

import dataclasses

import torch

from ..collectives import all_gather_into_tensor, all_reduce, reduce_scatter_tensor

__all__ = ["bind", "backward_algo", "weight_grad", "Call", "AllGatherMatmul", "MatmulReduceScatter", "MatmulAllReduce"]

# The public ops the backwards call (``gemm`` binds them when it is imported; this module cannot import it:
# ``gemm`` builds the autograd nodes defined here).
_ops: dict = {}


def bind(**functions) -> None:
    _ops.update(functions)


@dataclasses.dataclass(frozen=True)
class Call:
    """A checked forward call: ``run(a, weights, keep_gathered)`` computes it (no grad), the rest its backward
    reads."""
    comm: object
    dim: int
    algo: str
    run: object
    return_gathered: bool = False
    avg: bool = False

    @property
    def backward_algo(self) -> str:
        return backward_algo(self.algo)


def backward_algo(algo: str) -> str:
    """The algorithm a backward runs: the forward's, ``auto`` for ``fused`` (whose conditions the transposed
    problems need not meet)."""
    return "auto" if algo == "fused" else algo


def weight_grad(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``a^T @ g`` over every leading dimension: the gradient of a [K, N] weight."""
    return a.reshape(-1, a.shape[-1]).t() @ g.reshape(-1, g.shape[-1])


def _along(x: torch.Tensor, dim: int, n: int, gather: bool, comm) -> torch.Tensor:
    """``x`` gathered (n times longer) or reduce-scattered (n times shorter) along ``dim``, in rank order."""
    moved = x.movedim(dim, 0).contiguous()
    rows = moved.shape[0] * n if gather else moved.shape[0] // n
    out = moved.new_empty((rows,) + tuple(moved.shape[1:]))
    if gather:
        all_gather_into_tensor(out, moved, group=comm)
    else:
        reduce_scatter_tensor(out, moved, group=comm)
    return out.movedim(0, dim)


class AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call, a, *weights):
        need_w = any(ctx.needs_input_grad[2:])
        a_full, cs = call.run(a, list(weights), call.return_gathered or need_w)
        ctx.call = call
        ctx.save_for_backward(a_full if need_w else None, *weights)
        if not call.return_gathered:
            return tuple(cs)
        return (a_full.clone() if a_full is a else a_full, *cs)  # world size 1: the gathered a is a itself

    @staticmethod
    def backward(ctx, *grads):
        call = ctx.call
        a_full, *weights = ctx.saved_tensors
        g_full, gcs = (grads[0], grads[1:]) if call.return_gathered else (None, grads)
        ga = None
        if ctx.needs_input_grad[1]:
            G = gcs[0] if len(gcs) == 1 else torch.cat(gcs, -1)
            W = (weights[0] if len(weights) == 1 else torch.cat(weights, 1)).t()
            if g_full is None:
                ga = _ops["matmul_reduce_scatter"](G, W, group=call.comm, scatter_dim=call.dim,
                                                   algo=call.backward_algo)
            else:
                ga = _along(G @ W + g_full, call.dim, call.comm.size, False, call.comm)
        gws = [weight_grad(a_full, g) if need else None for g, need in zip(gcs, ctx.needs_input_grad[2:])]
        return (None, ga, *gws)


class _OneWeight(torch.autograd.Function):
    """The forward of the ops with one weight: the call, keeping ``a`` where the weight's gradient needs it."""

    @staticmethod
    def forward(ctx, call, a, w):
        ctx.call = call
        ctx.save_for_backward(a if ctx.needs_input_grad[2] else None, w)
        return call.run(a, [w], False)


class MatmulReduceScatter(_OneWeight):
    @staticmethod
    def backward(ctx, g):
        call = ctx.call
        a, w = ctx.saved_tensors
        need_a, need_w = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        if call.avg:
            g = g / call.comm.size
        ga = g_full = None
        if need_a:
            got = _ops["all_gather_matmul"](g, w.t(), group=call.comm, gather_dim=call.dim, return_gathered=need_w,
                                            algo=call.backward_algo)
            g_full, ga = got if need_w else (None, got)
        elif need_w:
            g_full = _along(g, call.dim, call.comm.size, True, call.comm)
        return None, ga, weight_grad(a, g_full) if need_w else None


class MatmulAllReduce(_OneWeight):
    @staticmethod
    def backward(ctx, g):
        a, w = ctx.saved_tensors
        total = g.clone(memory_format=torch.contiguous_format)
        all_reduce(total, group=ctx.call.comm)
        ga = total @ w.t() if ctx.needs_input_grad[1] else None
        return None, ga, weight_grad(a, total) if ctx.needs_input_grad[2] else None

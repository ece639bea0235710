"""The distributed GEMMs as torch custom ops (``torch.ops.xelink.*``), so that ``torch.compile`` can trace them.

Under ``torch.compile`` the front doors (``gemm``) still run their checks that need no bytes moved (types,
shapes, dtypes, devices, dims, divisibility, ``out``, the algorithm's name), traced by Dynamo, then call
one of these ops instead of the schedules. The ops are functional: they return new tensors, whose shapes
and dtype the fake implementations give, and the front door copies them into ``out=`` when one is given
(one copy more than eagerly). Eagerly, an op runs the front door on the communicator named by ``group``
("" for the world, as ``xelink.collectives.compiled`` names it); that call resolves ``algo="auto"``,
refuses an algorithm the tensors' backend cannot run and, with ``XELINK_CHECK=1``, checks that every rank
makes the same call, so those checks happen when the compiled code runs, not when it is traced.

Schemas (``b`` and the results as lists, so one op serves one weight or several sharing the gather)::

    xelink::all_gather_matmul(Tensor a_shard, Tensor[] b, int gather_dim, bool return_gathered, str algo,
                              str group) -> Tensor[]      # one c per b, then a_full with return_gathered
    xelink::matmul_reduce_scatter(Tensor a, Tensor b, int scatter_dim, str op, str algo, str group) -> Tensor
    xelink::matmul_all_reduce(Tensor a, Tensor b, str algo, str group) -> Tensor

A custom op's results may not alias its inputs, so under ``torch.compile`` the gathered ``a`` is always a new
tensor (eagerly, world size 1 returns ``a_shard`` itself).

Autograd: each op has its formula (``register_autograd``), the eager backward's (``gemm_grad``) spelled with
these ops and ``xelink::reduce_scatter_tensor_``, so a compiled training step traces its backward too. The
traced backward computes every input's gradient (a custom op's backward cannot tell which are needed; unused
ones are dropped from the graph); ``all_gather_matmul`` is traced with ``return_gathered`` whenever a weight
requires grad (the gathered ``a`` its gradient needs), handing the caller only what it asked for.
"""
from __future__ import annotations

import torch

from ..collectives.compiled import comm_named, group_name
from .gemm_grad import backward_algo, weight_grad

__all__ = ["bind", "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"]

# The front doors the ops run eagerly (``gemm`` binds them when it is imported; this module cannot import
# it: ``gemm`` calls the ops).
_front: dict = {}


def bind(**functions) -> None:
    _front.update(functions)


def _fresh(x: torch.Tensor, inputs) -> torch.Tensor:
    """``x``, or a copy of it where it shares memory with one of ``inputs`` (world size 1's gathered ``a``)."""
    storage = x.untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() == storage for t in inputs):
        return x.clone(memory_format=torch.contiguous_format)
    return x


def _gathered_shape(a: torch.Tensor, dim: int, n: int) -> list:
    full = list(a.shape)
    full[dim] *= n
    return full


# -- the ops --------------------------------------------------------------------------------------

@torch.library.custom_op("xelink::all_gather_matmul", mutates_args=())
def _all_gather_matmul(a_shard: torch.Tensor, b: list[torch.Tensor], gather_dim: int, return_gathered: bool,
                       algo: str, group: str) -> list[torch.Tensor]:
    res = _front["all_gather_matmul"](a_shard, list(b), group=comm_named(group), gather_dim=gather_dim,
                                      return_gathered=return_gathered, algo=algo)
    if not return_gathered:
        return list(res)
    a_full, cs = res
    return list(cs) + [_fresh(a_full, [a_shard, *b])]


@_all_gather_matmul.register_fake
def _(a_shard, b, gather_dim, return_gathered, algo, group):
    full = _gathered_shape(a_shard, gather_dim, comm_named(group).size)
    outs = [a_shard.new_empty(full[:-1] + [w.shape[1]]) for w in b]
    return outs + [a_shard.new_empty(full)] if return_gathered else outs


@torch.library.custom_op("xelink::matmul_reduce_scatter", mutates_args=())
def _matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, scatter_dim: int, op: str, algo: str,
                           group: str) -> torch.Tensor:
    return _front["matmul_reduce_scatter"](a, b, group=comm_named(group), scatter_dim=scatter_dim, op=op, algo=algo)


@_matmul_reduce_scatter.register_fake
def _(a, b, scatter_dim, op, algo, group):
    shape = list(a.shape[:-1]) + [b.shape[1]]
    shape[scatter_dim] //= comm_named(group).size
    return a.new_empty(shape)


@torch.library.custom_op("xelink::matmul_all_reduce", mutates_args=())
def _matmul_all_reduce(a: torch.Tensor, b: torch.Tensor, algo: str, group: str) -> torch.Tensor:
    return _front["matmul_all_reduce"](a, b, group=comm_named(group), algo=algo)


@_matmul_all_reduce.register_fake
def _(a, b, algo, group):
    return a.new_empty(list(a.shape[:-1]) + [b.shape[1]])


# -- autograd of the ops (gemm_grad's formulas, spelled with the ops) ------------------------------

def _reduce_scatter_along(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // comm_named(group).size,) + tuple(moved.shape[1:]))
    torch.ops.xelink.reduce_scatter_tensor_(out, moved, "sum", "auto", group)
    return out.movedim(0, dim)


def _gather_setup(ctx, inputs, output):
    a, b, dim, return_gathered, algo, group = inputs
    ctx.args = (dim, return_gathered, backward_algo(algo), group, len(b))
    ctx.save_for_backward(output[-1] if return_gathered else None, *b)


def _gather_backward(ctx, grads):
    dim, return_gathered, algo, group, m = ctx.args
    a_full, *b = ctx.saved_tensors
    gcs = list(grads[:m])
    G = gcs[0] if m == 1 else torch.cat(gcs, -1)
    W = (b[0] if m == 1 else torch.cat(b, 1)).t()
    ga = torch.ops.xelink.matmul_reduce_scatter(G, W, dim, "sum", algo, group)
    if return_gathered and grads[m] is not None:
        ga = ga + _reduce_scatter_along(grads[m], dim, group)
    gws = [weight_grad(a_full, g) if a_full is not None else None for g in gcs]
    return ga, gws, None, None, None, None


def _scatter_setup(ctx, inputs, output):
    a, b, dim, op, algo, group = inputs
    ctx.args = (dim, op, backward_algo(algo), group)
    ctx.save_for_backward(a, b)


def _scatter_backward(ctx, g):
    dim, op, algo, group = ctx.args
    a, b = ctx.saved_tensors
    if op == "avg":
        g = g / comm_named(group).size
    ga, g_full = torch.ops.xelink.all_gather_matmul(g, [b.t()], dim, True, algo, group)
    return ga, weight_grad(a, g_full), None, None, None, None


def _all_reduce_setup(ctx, inputs, output):
    ctx.group = inputs[3]
    ctx.save_for_backward(inputs[0], inputs[1])


def _all_reduce_backward(ctx, g):
    a, b = ctx.saved_tensors
    total = g.clone(memory_format=torch.contiguous_format)
    torch.ops.xelink.all_reduce_(total, "sum", "auto", ctx.group)
    return total @ b.t(), weight_grad(a, total), None, None


_all_gather_matmul.register_autograd(_gather_backward, setup_context=_gather_setup)
_matmul_reduce_scatter.register_autograd(_scatter_backward, setup_context=_scatter_setup)
_matmul_all_reduce.register_autograd(_all_reduce_backward, setup_context=_all_reduce_setup)


# -- what the front doors trace (their arguments already checked) ---------------------------------

def _into(cs: list, outs: list) -> list:
    return [c if o is None else o.copy_(c) for c, o in zip(cs, outs)]


def all_gather_matmul(a, weights: list, dim: int, return_gathered: bool, algo: str, group, outs: list):
    """(the gathered ``a`` or None, the list of ``c``) through ``xelink::all_gather_matmul`` (asked for the
    gathered ``a`` also where a weight's gradient needs it)."""
    keep = return_gathered or (torch.is_grad_enabled() and any(w.requires_grad for w in weights))
    res = torch.ops.xelink.all_gather_matmul(a, weights, dim, keep, algo, group_name(group))
    return (res[-1] if return_gathered else None), _into(res[:len(weights)], outs)


def matmul_reduce_scatter(a, w, dim: int, op: str, algo: str, group, out):
    return _into([torch.ops.xelink.matmul_reduce_scatter(a, w, dim, op, algo, group_name(group))], [out])[0]


def matmul_all_reduce(a, w, algo: str, group, out):
    return _into([torch.ops.xelink.matmul_all_reduce(a, w, algo, group_name(group))], [out])[0]

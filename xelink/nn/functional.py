"""Collectives that autograd differentiates, under torch.distributed.nn.functional's names.

Each returns new tensors (the inputs are left as they are) and its backward runs the collective the chain rule
asks for on the gradients, over the same group:

- ``all_reduce`` (sum or avg): every rank's gradient is the same reduction of all ranks' gradients;
- ``all_gather``: rank q's gradient is the sum over ranks of their gradients of slot q (a reduce-scatter);
- ``reduce_scatter`` (sum or avg): each input block's gradient is the gradient of the rank that received its
  reduction (an all-gather);
- ``broadcast``: the root's gradient is the sum of every rank's (a reduce to the root), the others' zero;
- ``reduce`` (sum or avg): the root's output is the reduction, the others' their own input (as ``xelink.reduce``
  leaves it), so each rank's gradient is the root's (broadcast; avg: over the ranks) plus, off the root, its own
  output's. (torch's broadcasts the root's alone, dropping what a non-root output used by the loss contributes.)
- ``all_to_all_single``, ``all_to_all``: the gradients go back the way the rows came (the reverse exchange);
- ``gather``: each rank's gradient is the root's gradient of its slot (a scatter from the root);
- ``scatter``: the root's gradient of each slot is the gradient of the rank that received it (a gather).

They run xelink's collectives (``xelink.all_reduce`` and the rest: CPU tensors on CPU ranks, CUDA tensors with
stream semantics), so the forward and the backward take the same algorithms and deadlines. ``reduce_scatter`` and
``all_to_all_single`` also write ``output`` as torch's do; the tensor they return is the one that carries the
gradient. Collective: every rank of ``group`` calls each function, and its backward runs where autograd reaches it
on every rank (as every rank's loss must use the result).
"""
from __future__ import annotations

import torch

from .. import collectives as C
from ..comm import resolve_group
from ..config import is_int

__all__ = ["all_gather", "all_reduce", "all_to_all", "all_to_all_single", "broadcast", "gather", "reduce",
           "reduce_scatter", "scatter"]


def _sum_or_avg(fn: str, op) -> str:
    """"sum" or "avg" (the reductions with a gradient; torch's ReduceOp.SUM / AVG too); else refused by name."""
    name = str(getattr(op, "name", op)).rsplit(".", 1)[-1].lower()
    if name not in ("sum", "avg"):
        raise ValueError(f"{fn}: op={op!r} has no gradient here; use 'sum' or 'avg'")
    return name


def _like(fn: str, names: str, tensors, ref: torch.Tensor) -> None:
    """Refuses, by name, a tensor of ``tensors`` whose dtype or device is not ``ref``'s: the result is written into
    the outputs, which would otherwise cast it (a float into an int output truncated) without a word."""
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor) and (t.dtype != ref.dtype or t.device != ref.device):
            raise TypeError(f"{fn}: {names}[{i}] is {t.dtype} on {t.device}, expected {ref.dtype} on {ref.device} "
                            "(every input and output of one dtype and device)")


def _on_copy(collective, tensor, **kwargs):
    """A contiguous copy of ``tensor`` that ``collective`` (an in-place xelink collective, with ``kwargs``) ran on."""
    out = tensor.clone(memory_format=torch.contiguous_format)
    collective(out, **kwargs)
    return out


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, comm):
        ctx.op, ctx.comm = op, comm
        return _on_copy(C.all_reduce, tensor, op=op, group=comm)

    @staticmethod
    def backward(ctx, grad):
        return _AllReduce.apply(grad, ctx.op, ctx.comm), None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, comm):
        ctx.comm = comm
        # a tensor of its own a rank, as torch's (views of one buffer could not be modified in place before backward)
        outs = [torch.empty_like(tensor, memory_format=torch.contiguous_format) for _ in range(comm.size)]
        C.all_gather(outs, tensor.contiguous(), group=comm)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        grad = torch.empty_like(grads[0], memory_format=torch.contiguous_format)
        C.reduce_scatter_tensor(grad, torch.stack(grads).contiguous(), group=ctx.comm)
        return grad, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, comm, *inputs):
        ctx.op, ctx.comm = op, comm
        out = inputs[0].new_empty(inputs[0].shape)
        C.reduce_scatter_tensor(out, torch.stack(inputs).contiguous(), op=op, group=comm)
        return out

    @staticmethod
    def backward(ctx, grad):
        got = grad.new_empty((ctx.comm.size,) + tuple(grad.shape))
        C.all_gather_into_tensor(got, grad.contiguous(), group=ctx.comm)
        if ctx.op == "avg":
            got = got / ctx.comm.size
        return (None, None) + tuple(got.unbind(0))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root, comm):
        ctx.root, ctx.comm = root, comm
        return _on_copy(C.broadcast, tensor, group=comm, group_src=root)

    @staticmethod
    def backward(ctx, grad):
        total = _on_copy(C.reduce, grad, group=ctx.comm, group_dst=ctx.root)
        return (total if ctx.comm.rank == ctx.root else torch.zeros_like(total)), None, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root, op, comm):
        ctx.root, ctx.op, ctx.comm = root, op, comm
        return _on_copy(C.reduce, tensor, op=op, group=comm, group_dst=root)

    @staticmethod
    def backward(ctx, grad):
        total = _on_copy(C.broadcast, grad, group=ctx.comm, group_src=ctx.root)  # the root's gradient, everywhere
        if ctx.op == "avg":
            total = total / ctx.comm.size
        return (total if ctx.comm.rank == ctx.root else total + grad), None, None, None


class _AllToAllSingle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, out_shape, out_splits, in_splits, comm):
        ctx.in_shape, ctx.out_splits, ctx.in_splits, ctx.comm = tuple(tensor.shape), out_splits, in_splits, comm
        out = tensor.new_empty(out_shape)
        C.all_to_all_single(out, tensor.contiguous(), out_splits, in_splits, group=comm)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = _AllToAllSingle.apply(grad.contiguous(), ctx.in_shape, ctx.in_splits, ctx.out_splits, ctx.comm)
        return back, None, None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, shapes, *inputs):
        ctx.comm, ctx.in_shapes = comm, [tuple(t.shape) for t in inputs]
        outs = [inputs[0].new_empty(s) for s in shapes]
        C.all_to_all(outs, [t.contiguous() for t in inputs], group=comm)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None) + _AllToAll.apply(ctx.comm, ctx.in_shapes, *[g.contiguous() for g in grads])


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root, comm):
        ctx.root, ctx.comm = root, comm
        mine = comm.rank == root
        outs = [torch.zeros_like(tensor, memory_format=torch.contiguous_format) for _ in range(comm.size)]
        C.gather(tensor.contiguous(), outs if mine else None, group=comm, group_dst=root)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        grad = torch.empty_like(grads[0], memory_format=torch.contiguous_format)
        mine = ctx.comm.rank == ctx.root
        C.scatter(grad, [g.contiguous() for g in grads] if mine else None, group=ctx.comm, group_src=ctx.root)
        return grad, None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, root, comm, like, *tensors):
        ctx.root, ctx.comm = root, comm
        out = like.new_empty(like.shape)
        C.scatter(out, [t.contiguous() for t in tensors] if comm.rank == root else None, group=comm,
                  group_src=root)
        return out

    @staticmethod
    def backward(ctx, grad):
        mine = ctx.comm.rank == ctx.root
        got = [torch.empty_like(grad, memory_format=torch.contiguous_format) for _ in range(ctx.comm.size)]
        C.gather(grad.contiguous(), got if mine else None, group=ctx.comm, group_dst=ctx.root)
        return (None, None, None) + (tuple(got) if mine else (None,) * ctx.comm.size)


def _root(fn: str, comm, name: str, rank, group_rank) -> int:
    """The root as a rank of ``comm``: ``name`` a world rank or ``group_<name>`` a rank of the group."""
    if (rank is None) == (group_rank is None):
        raise ValueError(f"{fn}: pass {name}= (a world rank) or group_{name}= (a rank of the group), one of them")
    given, ranks = (rank, list(comm.world_ranks)) if group_rank is None else (group_rank, range(comm.size))
    if not is_int(given) or int(given) not in ranks:
        if group_rank is None:
            raise ValueError(f"{fn}: {name}={given!r} is not a world rank of the group (its world ranks: {ranks})")
        raise ValueError(f"{fn}: group_{name}={given!r} is out of range for a group of size {comm.size}")
    return ranks.index(int(given))  # (a rank of the group)


def all_reduce(tensor, op="sum", group=None) -> torch.Tensor:
    """The reduction of ``tensor`` over the ranks of ``group`` ("sum" or "avg"), as a new tensor."""
    fn = "xelink.nn.functional.all_reduce"
    return _AllReduce.apply(tensor, _sum_or_avg(fn, op), resolve_group(group, fn))


def all_gather(tensor, group=None) -> tuple:
    """Every rank's ``tensor``, in rank order (a tuple of ``world_size`` new tensors)."""
    return _AllGather.apply(tensor, resolve_group(group, "xelink.nn.functional.all_gather"))


def reduce_scatter(output, input_list, op="sum", group=None) -> torch.Tensor:
    """The reduction over ranks of ``input_list[rank]`` (``world_size`` tensors shaped like ``output``), written
    to ``output`` and returned as a new tensor (the one with the gradient)."""
    fn = "xelink.nn.functional.reduce_scatter"
    comm, op = resolve_group(group, fn), _sum_or_avg(fn, op)
    if not isinstance(input_list, (list, tuple)) or len(input_list) != comm.size or \
            any(not isinstance(t, torch.Tensor) or t.shape != output.shape for t in input_list):
        raise ValueError(f"{fn}: input_list must be {comm.size} tensors shaped like output {tuple(output.shape)}")
    _like(fn, "input_list", input_list, output)
    out = _ReduceScatter.apply(op, comm, *input_list)
    with torch.no_grad():
        output.copy_(out)
    return out


def broadcast(tensor, src: int | None = None, group=None, group_src: int | None = None) -> torch.Tensor:
    """The root's ``tensor`` on every rank, as a new tensor; the root: ``src`` a world rank or ``group_src`` a
    rank of ``group``, as ``xelink.broadcast``."""
    fn = "xelink.nn.functional.broadcast"
    comm = resolve_group(group, fn)
    return _Broadcast.apply(tensor, _root(fn, comm, "src", src, group_src), comm)


def reduce(tensor, dst: int | None = None, op="sum", group=None, group_dst: int | None = None) -> torch.Tensor:
    """The reduction of ``tensor`` over the ranks ("sum" or "avg") on the root (``dst`` a world rank or ``group_dst``
    a rank of ``group``), this rank's ``tensor`` elsewhere, as a new tensor (the gradient: the module's)."""
    fn = "xelink.nn.functional.reduce"
    comm = resolve_group(group, fn)
    return _Reduce.apply(tensor, _root(fn, comm, "dst", dst, group_dst), _sum_or_avg(fn, op), comm)


def gather(tensor, dst: int | None = None, group=None, group_dst: int | None = None) -> tuple:
    """Every rank's ``tensor`` in rank order on the root (``dst`` a world rank or ``group_dst`` a rank of
    ``group``), as a tuple of new tensors; zeros on the other ranks (as torch's)."""
    fn = "xelink.nn.functional.gather"
    comm = resolve_group(group, fn)
    return _Gather.apply(tensor, _root(fn, comm, "dst", dst, group_dst), comm)


def scatter(tensors, src: int | None = None, group=None, group_src: int | None = None) -> torch.Tensor:
    """This rank's entry of the root's ``tensors`` (``world_size`` tensors of one shape, on every rank: the
    others' give the shape), as a new tensor; the root: ``src`` a world rank or ``group_src`` a rank of
    ``group``."""
    fn = "xelink.nn.functional.scatter"
    comm = resolve_group(group, fn)
    root = _root(fn, comm, "src", src, group_src)
    if not isinstance(tensors, (list, tuple)) or len(tensors) != comm.size:
        raise ValueError(f"{fn}: tensors must be a list of world_size={comm.size} tensors")
    return _Scatter.apply(root, comm, tensors[0], *tensors)


def all_to_all(output_tensor_list, input_tensor_list, group=None) -> tuple:
    """``input_tensor_list[j]`` to rank j, which receives it in slot ``rank`` (``xelink.all_to_all``), written to
    ``output_tensor_list`` and returned as new tensors (the ones with the gradient)."""
    fn = "xelink.nn.functional.all_to_all"
    comm = resolve_group(group, fn)
    if input_tensor_list and isinstance(input_tensor_list[0], torch.Tensor):
        _like(fn, "output_tensor_list", output_tensor_list, input_tensor_list[0])
    outs = _AllToAll.apply(comm, [tuple(t.shape) for t in output_tensor_list], *input_tensor_list)
    with torch.no_grad():
        for t, o in zip(output_tensor_list, outs):
            t.copy_(o)
    return outs


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None) -> torch.Tensor:
    """``xelink.all_to_all_single`` of ``input`` (rows split along dim 0), written to ``output`` and returned as
    a new tensor (the one with the gradient)."""
    fn = "xelink.nn.functional.all_to_all_single"
    comm = resolve_group(group, fn)
    _like(fn, "output", [output], input)
    out = _AllToAllSingle.apply(input, tuple(output.shape), output_split_sizes, input_split_sizes, comm)
    with torch.no_grad():
        output.copy_(out)
    return out

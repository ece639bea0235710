"""Distributed GEMM of tensor-parallel layers, with the communication under the local GEMMs.

- ``all_gather_matmul(a_shard, b)``: ``cat(a_shard over ranks, gather_dim) @ b`` (the column-parallel
  layer after a sequence-parallel one; ``b`` a list of weights sharing one gather, e.g. Q, K and V).
- ``matmul_reduce_scatter(a, b)``: this rank's block, along ``scatter_dim``, of the sum over ranks of
  ``a @ b`` (the row-parallel layer before a sequence-parallel one).
- ``matmul_all_reduce(a, b)``: the sum over ranks of ``a @ b``, on every rank.

Algorithms (``algo=``, ``DIST_GEMM_ALGOS``):

- ``"sequential"``: xelink's own collective, then the GEMM (or the GEMM, then the collective): the
  unfused reference.
- ``"pipelined"``: one chunk per rank, the local chunk first; chunk i's GEMM runs while chunk i+1
  moves. CPU ranks: a ring over nonblocking point-to-point (a private duplicate of the group, so no
  message meets the user's own); CUDA: peer reads by the copy engines on a side stream, each chunk's
  GEMM on the current stream into its row block of the output, ordered by events and ``xelink.symm``
  semaphores (``schedule.direct_plan``).
- ``"topo"``: the pipelined schedule in the topology-aware order of ``group.packages``: own shard, the
  package's shards, then each remote shard, which crosses the package boundary once per remote package
  (to one member, who forwards it inside the package); uneven packages included
  (``schedule.topo_plan``). ``matmul_reduce_scatter``: partials summed inside the package before they
  cross (CPU ranks). ``matmul_all_reduce``: the pipelined chunks all-reduced by the hierarchical
  algorithm.
- ``"fused"`` (CUDA tensors, half precision): ``all_gather_matmul``: the pipelined reads, consumed by
  one persistent GEMM whose tiles wait for their shard's flag (``xelink.kernels.gated_gemm``; ``device``'s
  docstring), in the plan's order (``topo``'s on a group with packages of several ranks).
  ``matmul_reduce_scatter``: one persistent GEMM whose tiles are stored straight into their owner's
  receive buffer in peer memory and counted there, then the owner's reduction, which waits per chunk and
  sums the partials in rank order (deterministic; ``xelink.kernels.scatter_gemm``). ``matmul_all_reduce``:
  that reduce-scatter of the rows, then xelink's all-gather (the rows divisible by the group size)
  (``device.fused_scatter_unmet``: half precision only). CPU ranks get a ``ValueError``.
- ``"auto"``: world size 1 is a local matmul; else ``topo`` when the group has more than one package
  and some package holds more than one rank, else ``pipelined`` (on CUDA tensors without peer memory
  between the ranks: ``sequential``).

Autograd: where grad mode is on and an input requires grad, each call is a node of the autograd graph whose
backward is built from these same ops (``gemm_grad``: all_gather_matmul's is a matmul_reduce_scatter,
matmul_reduce_scatter's an all_gather_matmul, matmul_all_reduce's an all_reduce of the output's gradient; the
loss is the sum of every rank's, as torch.distributed.nn's); ``out=`` is then refused.

Every argument is checked before any byte moves (with ``XELINK_CHECK=1``, also that every rank makes the
same call, which inputs require grad included). The CUDA path's staging buffers and the rules for CUDA graphs
are in ``device``'s docstring. Under ``torch.compile`` the checks that move no bytes are traced and the call
becomes a custom op (``torch.ops.xelink.all_gather_matmul`` ..., ``compiled``), which runs the eager call.
"""
from __future__ import annotations

import torch

from .. import config
from ..collectives.checks import check_rank_device, fingerprint_check, group_of, parse_op
from ..kernels.common import check_distinct, check_no_overlap
from . import compiled, gemm_grad
from .gemm_grad import AllGatherMatmul, Call, MatmulAllReduce, MatmulReduceScatter

__all__ = ["DIST_GEMM_ALGOS", "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "auto_algo"]

DIST_GEMM_ALGOS = ("sequential", "pipelined", "topo", "fused")
_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_REDUCE_OPS = ("sum", "avg")


# -- checks ---------------------------------------------------------------------------------------

def _algo(fn: str, algo) -> str:
    if not isinstance(algo, str) or algo not in ("auto",) + DIST_GEMM_ALGOS:
        raise ValueError(f"{fn}: algo={algo!r} is not one of auto, {', '.join(DIST_GEMM_ALGOS)}")
    return algo


def _tensor(fn: str, name: str, x, comm, dims: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in dims:
        want = " or ".join(f"{d}-D" for d in dims)
        raise ValueError(f"{fn}: {name} must be {want}, got shape {tuple(x.shape)}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"{fn}: {name}.dtype={x.dtype} is not supported; use float64, float32, float16 or "
                        f"bfloat16")
    check_rank_device(fn, name, x, comm)
    return x


def _grad(fn: str, out, *tensors) -> bool:
    """Whether the call is a node of the autograd graph; ``out=`` cannot be (torch's rule for out= arguments)."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if grad and out is not None:
        raise ValueError(f"{fn}: out= is not differentiable, and an input requires grad; drop out= (the result is "
                         f"a new tensor) or call it under torch.no_grad()")
    return grad


def _weights(fn: str, b, a: torch.Tensor, comm, allow_list: bool) -> tuple[list[torch.Tensor], bool]:
    """(the weights as a list, whether a list was given), each checked to chain with ``a``."""
    many = isinstance(b, (list, tuple))
    if many and not allow_list:
        raise TypeError(f"{fn}: b must be one [K, N] tensor, got a {type(b).__name__}")
    items = list(b) if many else [b]
    if many and not items:
        raise ValueError(f"{fn}: b is an empty {type(b).__name__}; give at least one [K, N] tensor")
    k = a.shape[-1]
    for i, w in enumerate(items):
        name = f"b[{i}]" if many else "b"
        _tensor(fn, name, w, comm, (2,))
        if w.dtype != a.dtype:
            raise TypeError(f"{fn}: {name}.dtype={w.dtype} != a.dtype={a.dtype}")
        if w.is_cuda != a.is_cuda:  # each is on the CPU or this rank's device (``_tensor``)
            raise ValueError(f"{fn}: {name} is on {w.device} and a on {a.device}; both must be on one device")
        if w.shape[0] != k:
            raise ValueError(f"{fn}: {name}.shape[0]={w.shape[0]} != a.shape[-1]={k} (a is [..., K], b is [K, N])")
    return items, many


def _dim(fn: str, name: str, value, a: torch.Tensor) -> int:
    """``value`` as a non-negative dimension of ``a`` other than the last (K)."""
    value = config.integer(fn, name, value)
    d = value + a.dim() if value < 0 else value
    if not 0 <= d < a.dim() - 1:
        valid = ", ".join(map(str, range(a.dim() - 1)))
        raise ValueError(f"{fn}: {name}={value} is not valid for a {a.dim()}-D input of shape {tuple(a.shape)} "
                         f"(one of {valid}; the last dim is K)")
    return d


def _needs(grad: bool, *tensors) -> tuple:
    """Which inputs require grad (the backward's collectives depend on it: part of the call ranks agree on)."""
    return tuple(bool(grad and t.requires_grad) for t in tensors)


def _outputs(fn: str, out, shapes: list[tuple], a: torch.Tensor, many: bool, weights: list) -> list:
    """The caller's output tensors (None each when ``out`` is None), checked against the result shapes, and
    (eager calls: addresses) for sharing memory with an input, another output or themselves: the products are
    written while the inputs are still read, so an alias would silently corrupt the result."""
    if out is None:
        return [None] * len(shapes)
    if many:
        if not isinstance(out, (list, tuple)) or len(out) != len(shapes):
            got = f"{len(out)} items" if isinstance(out, (list, tuple)) else type(out).__name__
            raise ValueError(f"{fn}: out must be a list of {len(shapes)} tensors (one per b), got {got}")
        items, names = list(out), [f"out[{i}]" for i in range(len(shapes))]
    else:
        items, names = [out], ["out"]
    for t, name, shape in zip(items, names, shapes):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{fn}: {name}.shape={tuple(t.shape)} != {tuple(shape)}, the shape of the result")
        if t.dtype != a.dtype:
            raise TypeError(f"{fn}: {name}.dtype={t.dtype} != a.dtype={a.dtype}")
        if t.device != a.device:
            raise ValueError(f"{fn}: {name} is on {t.device} and a on {a.device}")
        check_distinct(fn, name, t)
    if not torch.compiler.is_compiling():  # (traced: checked when the custom op runs this function eagerly)
        inputs = {"a": a, **{f"b[{i}]" if many else "b": w for i, w in enumerate(weights)}}
        for i, t in enumerate(items):
            check_no_overlap(fn, t, **inputs, **{f"out[{j}]": o for j, o in enumerate(items) if j != i})
    return items


def auto_algo(comm, cuda: bool = False) -> str:
    """What ``algo="auto"`` runs on ``comm``: ``topo`` when it has more than one package and some package
    holds more than one rank, else ``pipelined`` (``sequential`` for CUDA tensors without peer memory).
    World size 1 runs a local matmul whatever the name."""
    if cuda:
        from .. import symm

        if not symm.available(comm):
            return "sequential"
    packages = comm.packages
    return "topo" if len(packages) > 1 and max(len(p) for p in packages) > 1 else "pipelined"


def _pick(fn: str, comm, a: torch.Tensor, algo: str) -> str:
    """The algorithm that runs: ``auto`` resolved, and the choice checked against the tensors' backend."""
    picked = auto_algo(comm, a.is_cuda) if algo == "auto" else algo
    if a.is_cuda and comm.size > 1:
        from . import device

        why = device.unmet(comm, picked)
        if why is not None:
            raise ValueError(f"{fn}: {why}")
    return picked


def _fused_checks(fn: str, a: torch.Tensor, picked: str, why) -> None:
    """``algo="fused"`` on these tensors, or the ``ValueError`` that says why not (``why``: the device
    module's reason for this op, called only for a CUDA ``a``)."""
    if picked != "fused":
        return
    if not a.is_cuda:
        raise ValueError(f"{fn}: algo='fused' is a GPU kernel and runs on CUDA tensors; CPU ranks take "
                         f"'pipelined' or 'topo'")
    reason = why()
    if reason is not None:
        raise ValueError(f"{fn}: {reason}")


def _backend(a: torch.Tensor):
    if a.is_cuda:
        from . import device

        return device
    from . import host

    return host


def _local(a, weights, outs):
    """World size 1 (and the empty problem): the local product into ``outs``."""
    cs = []
    for w, o in zip(weights, outs):
        c = torch.matmul(a, w)
        cs.append(c if o is None else o.copy_(c))
    return cs


# -- the ops --------------------------------------------------------------------------------------

def all_gather_matmul(a_shard, b, *, group=None, gather_dim: int = 0, return_gathered: bool = False,
                      algo: str = "auto", out=None):
    """``cat(a_shard of every rank, gather_dim) @ b``, the gather hidden under the GEMM of the chunks.

    Args:
        a_shard: this rank's shard, ``[M/n, K]`` or ``[B, S/n, K]``, the same shape on every rank; float64,
            float32, float16 or bfloat16; a CPU tensor, or a CUDA tensor on this rank's device.
        b: one ``[K, N]`` weight (contiguous or a transposed view such as an ``nn.Linear`` weight's
            ``.t()``), or a list/tuple of them (each its own N) multiplied with one gather; same dtype and
            device as ``a_shard``.
        group: xelink communicator (None: the world).
        gather_dim: the dimension gathered: 0 for 2-D; 0 or 1 (the sequence) for 3-D; negative counts
            from the end, the last (K) is not allowed.
        return_gathered: also return the gathered ``a`` (a new tensor on CUDA; on CPU ranks with
            ``gather_dim=0`` the gather buffer itself).
        algo: "auto", "sequential", "pipelined", "topo" or "fused" (CUDA, half precision; module docstring).
        out: a tensor of the result's shape (a list of them, one per ``b``, for a list), written in place.

    Returns:
        ``c`` (``[M, N]`` or the 3-D shape with the gathered dim ``n`` times larger), a list of ``c`` for a
        list of ``b``, or ``(a_full, c)`` with ``return_gathered``.

    Raises:
        TypeError: non-tensors, unsupported or mixed dtypes, a non-int gather_dim.
        ValueError: shapes that do not chain, mixed devices, a bad gather_dim, an empty list of b, a bad out,
            an unknown algo, or (``XELINK_CHECK=1``) ranks whose calls differ; all before any byte moves.

    Collective: every rank of ``group`` must call this with the same shapes, dtype, gather_dim and algo.
    """
    fn = "all_gather_matmul"
    comm = group_of(group, fn)
    algo = _algo(fn, algo)
    a = _tensor(fn, "a_shard", a_shard, comm, (2, 3))
    dim = _dim(fn, "gather_dim", gather_dim, a)
    weights, many = _weights(fn, b, a, comm, allow_list=True)
    n = comm.size
    full = list(a.shape)
    full[dim] *= n
    shapes = [tuple(full[:-1]) + (w.shape[1],) for w in weights]
    outs = _outputs(fn, out, shapes, a, many, weights)
    if algo == "fused" and not a.is_cuda:
        _fused_checks(fn, a, algo, None)
    grad = _grad(fn, out, a, *weights)
    if torch.compiler.is_compiling():  # traced: the custom op, which runs this function eagerly (``compiled``)
        a_full, cs = compiled.all_gather_matmul(a, weights, dim, bool(return_gathered), algo, group, outs)
    else:
        picked = _pick(fn, comm, a, algo)
        if picked == "fused":
            from . import device

            why = device.fused_unmet(a, dim)
            if why is not None:
                raise ValueError(f"{fn}: {why}")
        fingerprint_check(comm, fn, (fn, tuple(a.shape), str(a.dtype), dim,
                                     tuple(tuple(w.shape) for w in weights), algo, bool(return_gathered),
                                     _needs(grad, a, *weights)))

        def run(a, weights, keep_gathered):
            if n == 1:
                return a, _local(a, weights, outs)
            return _backend(a).all_gather_matmul(comm, a, weights, dim, outs, picked, keep_gathered)

        if grad:
            got = AllGatherMatmul.apply(Call(comm, dim, algo, run, return_gathered=bool(return_gathered)), a,
                                        *weights)
            a_full, cs = (got[0], list(got[1:])) if return_gathered else (None, list(got))
        else:
            a_full, cs = run(a, weights, bool(return_gathered))
    c = cs if many else cs[0]
    return (a_full, c) if return_gathered else c


def _scatter_shape(fn: str, a: torch.Tensor, dim: int, n: int, ncols: int) -> tuple:
    if a.shape[dim] % n:
        raise ValueError(f"{fn}: a.shape[{dim}]={a.shape[dim]} (scatter_dim={dim}) is not divisible by the group "
                         f"size {n}")
    shape = list(a.shape[:-1]) + [ncols]
    shape[dim] //= n
    return tuple(shape)


def matmul_reduce_scatter(a, b, *, group=None, scatter_dim: int = 0, op="sum", algo: str = "auto", out=None):
    """This rank's block (rank order, along ``scatter_dim``) of the sum over ranks of ``a @ b``.

    Args:
        a: ``[M, K]`` or ``[B, S, K]`` (this rank's partial input, e.g. the output of a column-parallel layer),
            float64/32/16 or bfloat16, CPU or this rank's CUDA device.
        b: one ``[K, N]`` weight, contiguous or a transposed view; same dtype and device.
        group: xelink communicator (None: the world).
        scatter_dim: the dimension split over the ranks (0 for 2-D, 0 or 1 for 3-D); its size must be
            divisible by the group size.
        op: "sum" or "avg" (or torch's ``ReduceOp`` of them). Half types are summed in float32, rounded once.
        algo: "auto", "sequential", "pipelined", "topo" or "fused" (CUDA, half precision; module docstring).
        out: a tensor of the block's shape (``scatter_dim`` divided by the group size, last dim N).

    Returns:
        The block (``out`` when given).

    Raises:
        TypeError / ValueError: as ``all_gather_matmul``; also a scatter dim not divisible by the group size
            and an op other than sum/avg; all before any byte moves.

    Collective: every rank of ``group`` must call this with the same shapes, dtype, scatter_dim, op and algo.
    """
    fn = "matmul_reduce_scatter"
    comm = group_of(group, fn)
    algo = _algo(fn, algo)
    a = _tensor(fn, "a", a, comm, (2, 3))
    dim = _dim(fn, "scatter_dim", scatter_dim, a)
    (w,), _ = _weights(fn, b, a, comm, allow_list=False)
    op = parse_op(fn, op)
    if op not in _REDUCE_OPS:
        raise ValueError(f"{fn}: op={op!r} is not supported here; use 'sum' or 'avg'")
    n = comm.size
    shape = _scatter_shape(fn, a, dim, n, w.shape[1])
    (o,) = _outputs(fn, out, [shape], a, False, [w])
    if algo == "fused" and not a.is_cuda:
        _fused_checks(fn, a, algo, None)
    grad = _grad(fn, out, a, w)
    if torch.compiler.is_compiling():
        return compiled.matmul_reduce_scatter(a, w, dim, op, algo, group, o)
    picked = _pick(fn, comm, a, algo)
    if picked == "fused" and n > 1:
        from . import device

        _fused_checks(fn, a, picked, lambda: device.fused_scatter_unmet(a))
    fingerprint_check(comm, fn, (fn, tuple(a.shape), str(a.dtype), dim, tuple(w.shape), op, algo,
                                 _needs(grad, a, w)))

    def run(a, weights, _):
        if n == 1:
            return _local(a, weights, [o])[0]
        return _backend(a).matmul_reduce_scatter(comm, a, weights[0], dim, op, o, picked)

    if grad:
        return MatmulReduceScatter.apply(Call(comm, dim, algo, run, avg=op == "avg"), a, w)
    return run(a, [w], False)


def matmul_all_reduce(a, b, *, group=None, algo: str = "auto", out=None):
    """The sum over ranks of ``a @ b``, on every rank (the row-parallel layer of tensor parallelism).

    Args:
        a: ``[M, K]`` or ``[B, S, K]``, float64/32/16 or bfloat16, CPU or this rank's CUDA device.
        b: one ``[K, N]`` weight, contiguous or a transposed view; same dtype and device.
        group: xelink communicator (None: the world).
        algo: "auto", "sequential" (the GEMM, then ``all_reduce``), "pipelined" (row chunks: chunk i
            all-reduced asynchronously while chunk i+1 is computed) or "topo" (the same with the
            hierarchical all-reduce) or "fused" (CUDA, half precision, rows divisible by the group size: the
            fused reduce-scatter, then an all-gather).
        out: a tensor of the result's shape (``a``'s with the last dim N).

    Returns:
        The sum (``out`` when given). Half types are summed in float32 and rounded once per chunk.

    Raises:
        TypeError / ValueError: as ``all_gather_matmul``, before any byte moves.

    Collective: every rank of ``group`` must call this with the same shapes, dtype and algo.
    """
    fn = "matmul_all_reduce"
    comm = group_of(group, fn)
    algo = _algo(fn, algo)
    a = _tensor(fn, "a", a, comm, (2, 3))
    (w,), _ = _weights(fn, b, a, comm, allow_list=False)
    shape = tuple(a.shape[:-1]) + (w.shape[1],)
    (o,) = _outputs(fn, out, [shape], a, False, [w])
    if algo == "fused" and not a.is_cuda:
        _fused_checks(fn, a, algo, None)
    grad = _grad(fn, out, a, w)
    if torch.compiler.is_compiling():
        return compiled.matmul_all_reduce(a, w, algo, group, o)
    picked = _pick(fn, comm, a, algo)
    if picked == "fused" and comm.size > 1:
        from . import device

        _fused_checks(fn, a, picked, lambda: device.fused_all_reduce_unmet(a, comm.size))
    fingerprint_check(comm, fn, (fn, tuple(a.shape), str(a.dtype), tuple(w.shape), algo, _needs(grad, a, w)))

    def run(a, weights, _):
        if comm.size == 1:
            return _local(a, weights, [o])[0]
        return _backend(a).matmul_all_reduce(comm, a, weights[0], o, picked)

    if grad:
        return MatmulAllReduce.apply(Call(comm, 0, algo, run), a, w)
    return run(a, [w], False)


compiled.bind(all_gather_matmul=all_gather_matmul, matmul_reduce_scatter=matmul_reduce_scatter,
              matmul_all_reduce=matmul_all_reduce)
gemm_grad.bind(all_gather_matmul=all_gather_matmul, matmul_reduce_scatter=matmul_reduce_scatter)

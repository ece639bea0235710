"""The front doors of the collectives, with torch.distributed's names and semantics.

Each call checks its arguments once (``checks``), resolves the group once, picks the backend by the
tensor's device (``cpu``: CPU tensors and numpy arrays; ``cuda``: CUDA tensors), resolves ``algo=``
through the registry (``dispatch``: the one ``auto``), and hands the checked call to the backend.
Nothing is sent before every check has passed.
"""
from __future__ import annotations

import torch

from .. import symm
from ..work import Work as Handle
from . import checks, compiled, cpu, dispatch, gpu, registry
from .gpu import rooted as gpu_rooted
from .checks import backend_of, check_op, collective_group, fingerprint_check, pair, parse_op, root_of, splits

__all__ = ["all_reduce", "all_gather_into_tensor", "all_gather_single", "all_gather", "reduce_scatter_tensor",
           "reduce_scatter_single", "reduce_scatter",
           "all_to_all_single", "all_to_all", "broadcast", "reduce", "gather", "scatter", "all_gather_object",
           "gather_object", "scatter_object_list", "broadcast_object_list", "barrier", "device_barrier",
           "synchronize"]

def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _handle(work, outputs: list):
    """``work`` (None: the call was not async), holding what the call writes: its ``result()`` and future's
    value, as torch.distributed's Work (``xelink.work``)."""
    if work is not None:
        work.outputs = list(outputs)
    return work


def all_reduce(tensor, op="sum", group=None, async_op: bool = False, algo: str = "auto", timeout=None):
    """Reduce ``tensor`` over every rank of ``group``, in place (torch.distributed.all_reduce).

    Args:
        tensor: torch CPU or CUDA tensor or numpy array, any shape, contiguous; float64/32/16,
            bfloat16, int32 or int64, and on CPU ranks int16, int8, uint8 or bool too (half types are
            reduced in float32 on CPU ranks; narrow integers wrap; bool: sum and max are "or", prod and
            min "and"). CUDA tensors run on the GPU with NCCL's stream semantics.
        op: "sum", "avg" (floating dtypes), "max", "min", "prod", "band", "bor", "bxor" (integer and bool
            tensors on CPU ranks), or a torch ``ReduceOp``.
        group: xelink communicator (None: the world).
        async_op: return a handle (``Work``; ``GpuWork`` on CUDA) instead of waiting.
        algo: "auto" or an algorithm of the tensor's backend (``ALGORITHMS``, ``GPU_ALGORITHMS``).
        timeout: deadline in seconds (default: the group's); expiry raises ``xelink.TimeoutError``.

    Returns:
        None, or the handle when ``async_op``.

    Collective: every rank of ``group`` must call this with the same shape, dtype, op and algo.
    """
    fn = "all_reduce"
    if torch.compiler.is_compiling():
        compiled.traced(fn, async_op)
        return torch.ops.xelink.all_reduce_(tensor, parse_op(fn, op), algo, compiled.group_name(group, fn))
    comm = collective_group(group, fn)
    x = checks.tensor(fn, "tensor", tensor, comm, reduce=True)
    op = parse_op(fn, op)
    check_op(fn, op, x)
    backend = backend_of(x)
    entry = dispatch.resolve(fn, "all_reduce", algo, comm, backend, _nbytes(x), x.dtype, x)
    fingerprint_check(comm, fn, (fn, tuple(x.shape), str(x.dtype), op, algo))
    return _handle(registry.backend(backend).all_reduce(comm, x, op, entry, async_op, timeout), [tensor])


def all_gather_into_tensor(output=None, input=None, group=None, async_op: bool = False, algo: str = "auto",
                           timeout=None, *, output_tensor=None, input_tensor=None):
    """Concatenate every rank's ``input`` into ``output`` in rank order (torch.distributed semantics).

    Args:
        output: tensor/array of ``world_size * input.numel()`` elements, same dtype; either shape
            ``(world_size * d0, ...)`` or any shape with that many elements.
        input: this rank's shard (any dtype on CPU ranks).
        output_tensor, input_tensor: torch.distributed's keyword names of ``output`` and ``input`` (one name
            of each).
        algo: "auto" or an algorithm of the backend.
        timeout: deadline in seconds (default: the group's).

    Returns:
        None, or a handle when ``async_op``.

    Collective: every rank of ``group`` must call this with inputs of the same shape and dtype.
    """
    fn = "all_gather_into_tensor"
    output = _one_of(fn, "output", output, "output_tensor", output_tensor)
    input = _one_of(fn, "input", input, "input_tensor", input_tensor)
    if torch.compiler.is_compiling():
        compiled.traced(fn, async_op)
        return torch.ops.xelink.all_gather_into_tensor_(output, input, algo, compiled.group_name(group, fn))
    comm = collective_group(group, fn)
    out, inp = pair(fn, output, input, comm)
    if out.numel() != comm.size * inp.numel():
        raise ValueError(f"{fn}: output.numel()={out.numel()} != world_size*input.numel()="
                         f"{comm.size * inp.numel()}")
    inp = checks.read_first(inp, out, in_place=(inp, out, comm.rank))
    backend = backend_of(out)
    entry = dispatch.resolve(fn, "all_gather", algo, comm, backend, _nbytes(out), out.dtype, inp)
    fingerprint_check(comm, fn, (fn, tuple(inp.shape), str(inp.dtype), algo))
    return _handle(registry.backend(backend).all_gather_into_tensor(comm, out, inp, entry, async_op, timeout),
                   [output])


def _one_of(fn: str, name: str, value, torch_name: str, torch_value):
    """The argument passed as ``name`` or under torch.distributed's ``torch_name``: exactly one of them."""
    if (value is None) == (torch_value is None):
        raise TypeError(f"{fn}: pass {name}= or {torch_name}= (torch.distributed's name), "
                        f"{'not both' if value is not None else 'one is required'}")
    return torch_value if value is None else value


def all_gather(tensor_list, tensor, group=None, async_op: bool = False, algo: str = "auto", timeout=None):
    """List form: ``tensor_list[r]`` receives rank r's ``tensor`` (torch.distributed.all_gather).

    Collective: every rank of ``group`` must call this with tensors of the same shape and dtype.
    """
    fn = "all_gather"
    comm = collective_group(group, fn)
    inp = checks.tensor(fn, "tensor", tensor, comm)
    outs = _tensor_list(fn, "tensor_list", tensor_list, comm, like=inp, like_name="tensor")
    checks.distinct_outputs(fn, "tensor_list", outs)
    inp = checks.read_first(inp, *outs)
    backend = backend_of(inp)
    entry = dispatch.resolve(fn, "all_gather", algo, comm, backend, comm.size * _nbytes(inp), inp.dtype, inp)
    fingerprint_check(comm, fn, (fn, tuple(inp.shape), str(inp.dtype), algo))
    return _handle(registry.backend(backend).all_gather(comm, outs, inp, entry, async_op, timeout), tensor_list)


def all_gather_single(output_tensor, input_tensor, group=None, async_op: bool = False, algo: str = "auto",
                      timeout=None):
    """torch.distributed.all_gather_single (torch 2.13's name): :func:`all_gather_into_tensor`, whose name its
    errors carry."""
    return all_gather_into_tensor(output_tensor, input_tensor, group, async_op, algo, timeout)


def reduce_scatter_single(output, input, op="sum", group=None, async_op: bool = False, algo: str = "auto",
                          timeout=None):
    """torch.distributed.reduce_scatter_single (torch 2.13's name): :func:`reduce_scatter_tensor`, whose name its
    errors carry."""
    return reduce_scatter_tensor(output, input, op, group, async_op, algo, timeout)


def reduce_scatter_tensor(output, input, op="sum", group=None, async_op: bool = False, algo: str = "auto",
                          timeout=None):
    """Reduce ``input`` over all ranks and leave block ``rank`` of the result in ``output``.

    Args:
        output: this rank's block, ``input.numel() / world_size`` elements, same dtype.
        input: ``world_size`` equal blocks in rank order (torch.distributed.reduce_scatter_tensor).
        op: "sum", "avg" (floating dtypes), "max", "min", "prod" (half types reduced in float32).
        algo: "auto" or an algorithm of the backend.
        timeout: deadline in seconds (default: the group's).

    Returns:
        None, or a handle when ``async_op``.

    Collective: every rank of ``group`` must call this with the same shapes, dtype and op.
    """
    fn = "reduce_scatter_tensor"
    if torch.compiler.is_compiling():
        compiled.traced(fn, async_op)
        return torch.ops.xelink.reduce_scatter_tensor_(output, input, parse_op(fn, op), algo,
                                                       compiled.group_name(group, fn))
    comm = collective_group(group, fn)
    out, inp = pair(fn, output, input, comm, reduce=True)
    op = parse_op(fn, op)
    check_op(fn, op, inp)
    if inp.numel() != comm.size * out.numel():
        raise ValueError(f"{fn}: input.numel()={inp.numel()} != world_size*output.numel()="
                         f"{comm.size * out.numel()}")
    inp = checks.read_first(inp, out, in_place=(out, inp, comm.rank))
    backend = backend_of(out)
    entry = dispatch.resolve(fn, "reduce_scatter", algo, comm, backend, _nbytes(inp), inp.dtype, inp)
    fingerprint_check(comm, fn, (fn, tuple(out.shape), str(out.dtype), op, algo))
    return _handle(registry.backend(backend).reduce_scatter_tensor(comm, out, inp, op, entry, async_op, timeout),
                   [output])


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op: bool = False, algo: str = "auto", timeout=None):
    """Split ``input`` along dim 0 and send block j to rank j; blocks from rank i fill ``output`` in order.

    Args:
        output, input: tensors/arrays of one dtype with equal trailing dims.
        output_split_sizes, input_split_sizes: rows per rank (None: equal splits of dim 0), checked on every
            backend before any byte moves. On CUDA tensors split sizes run on NCCL (``algo`` "auto" or "nccl").

    Returns:
        None, or a handle when ``async_op``.

    Collective: every rank of ``group`` must call this.
    """
    fn = "all_to_all_single"
    comm = collective_group(group, fn)
    out, inp = pair(fn, output, input, comm)
    n = comm.size
    sized = output_split_sizes is not None or input_split_sizes is not None
    if out.is_cuda and not sized:
        if out.numel() != inp.numel() or inp.numel() % n:
            raise ValueError(f"{fn}: input.numel()={inp.numel()} and output.numel()={out.numel()} must be equal and "
                             f"divisible by world_size={n} (equal splits on CUDA tensors)")
        outs = ins = None
    else:  # rows split along dim 0: the sizes checked here, before any byte moves (NCCL would not say why)
        if out.is_cuda and algo not in ("auto", "nccl"):
            raise ValueError(f"{fn}: split sizes on CUDA tensors run on NCCL only (algo='auto' or 'nccl'), "
                             f"got algo={algo!r}")
        if out.dim() == 0 or inp.dim() == 0:
            raise ValueError(f"{fn}: output and input need at least one dimension")
        if tuple(out.shape[1:]) != tuple(inp.shape[1:]):
            raise ValueError(f"{fn}: trailing dims differ: output {tuple(out.shape)} vs input {tuple(inp.shape)}")
        ins = splits(fn, "input_split_sizes", input_split_sizes, inp.shape[0], n)
        outs = splits(fn, "output_split_sizes", output_split_sizes, out.shape[0], n)
        if ins[comm.rank] != outs[comm.rank]:
            raise ValueError(f"{fn}: rank {comm.rank} sends itself {ins[comm.rank]} rows but expects "
                             f"{outs[comm.rank]} from itself")
        if out.is_cuda:
            algo = "nccl"
    inp = checks.read_first(inp, out)
    backend = backend_of(out)
    entry = dispatch.resolve(fn, "all_to_all", algo, comm, backend, _nbytes(inp), inp.dtype, inp)
    fingerprint_check(comm, fn, (fn, tuple(inp.shape[1:]), str(inp.dtype), algo))
    return _handle(registry.backend(backend).all_to_all_single(comm, out, inp, outs, ins, entry, async_op, timeout),
                   [output])


class _Staged(Handle):
    """The handle of a list-form call that runs through one staging buffer: ``wait()`` (or an
    ``is_completed()`` that finds the work done) waits for the inner call, then copies the results out once."""

    def __init__(self, work, finish):
        self._work, self._finish = work, finish

    def _done(self) -> None:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()

    def is_completed(self) -> bool:
        if self._finish is None:
            return True
        if not self._work.is_completed():
            return False
        self._done()
        return True

    def wait(self, timeout=None) -> bool:
        self._work.wait(timeout)
        self._done()
        return True


def _tensor_list(fn: str, name: str, items, comm, like=None, like_name: str = "", where: str = "") -> list:
    """``items``: a list of world_size tensors, checked; each like ``like`` (dtype, device, numel: ``like_name``
    names it in the error) where given, else like the first. ``where`` qualifies the length error."""
    if not isinstance(items, (list, tuple)) or len(items) != comm.size:
        got = len(items) if isinstance(items, (list, tuple)) else type(items).__name__
        raise ValueError(f"{fn}: {name} must be a list of world_size={comm.size} tensors{where}, got {got}")
    out = [checks.tensor(fn, f"{name}[{i}]", t, comm) for i, t in enumerate(items)]
    for i, t in enumerate(out):
        ref = out[0] if like is None else like
        if t.is_cuda != ref.is_cuda or t.dtype != ref.dtype or (like is not None and t.numel() != like.numel()):
            size = f"{like.numel()} x " if like is not None else ""
            named = f" like {like_name}" if like_name else ""
            raise ValueError(f"{fn}: {name}[{i}] has {t.numel()} x {t.dtype} on {t.device}, expected {size}"
                             f"{ref.dtype} on {ref.device}{named}")
    return out


def reduce_scatter(output, input_list, op="sum", group=None, async_op: bool = False, algo: str = "auto",
                   timeout=None):
    """List form (torch.distributed.reduce_scatter): ``output`` receives the reduction over ranks of
    ``input_list[rank]``; the list runs as one ``reduce_scatter_tensor`` of its concatenation.

    Collective: every rank of ``group`` must call this with tensors of the same shape and dtype.
    """
    fn = "reduce_scatter"
    comm = collective_group(group, fn)
    out = checks.tensor(fn, "output", output, comm)
    ins = _tensor_list(fn, "input_list", input_list, comm, like=out, like_name="output")
    stacked = torch.cat([t.reshape(-1) for t in ins])
    return _handle(reduce_scatter_tensor(out, stacked, op=op, group=comm, async_op=async_op, algo=algo,
                                         timeout=timeout), [output])


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op: bool = False, algo: str = "auto",
               timeout=None):
    """List form (torch.distributed.all_to_all): ``input_tensor_list[j]`` goes to rank j, which receives it in
    its ``output_tensor_list[rank]``; sizes may differ per pair. Runs as one ``all_to_all_single`` of the
    concatenated tensors (split sizes where they differ: NCCL on CUDA tensors), the results copied out.

    Collective: every rank of ``group`` must call this; the tensors rank i sends rank j and those rank j
    expects from rank i have the same number of elements.
    """
    fn = "all_to_all"
    comm = collective_group(group, fn)
    ins = _tensor_list(fn, "input_tensor_list", input_tensor_list, comm)
    outs = _tensor_list(fn, "output_tensor_list", output_tensor_list, comm)
    checks.distinct_outputs(fn, "output_tensor_list", outs)
    if outs[0].dtype != ins[0].dtype or outs[0].is_cuda != ins[0].is_cuda:
        raise ValueError(f"{fn}: output_tensor_list holds {outs[0].dtype} on {outs[0].device}, input_tensor_list "
                         f"{ins[0].dtype} on {ins[0].device}")
    send = torch.cat([t.reshape(-1) for t in ins])
    recv = send.new_empty(sum(t.numel() for t in outs))
    in_sizes, out_sizes = [t.numel() for t in ins], [t.numel() for t in outs]
    even = len(set(in_sizes)) == 1 and len(set(out_sizes)) == 1
    work = all_to_all_single(recv, send, None if even else out_sizes, None if even else in_sizes, group=comm,
                             async_op=async_op, algo=algo, timeout=timeout)

    def finish():
        for t, part in zip(outs, recv.split(out_sizes)):
            t.copy_(part.view(t.shape))

    if not async_op:
        finish()
        return None
    return _handle(_Staged(work, finish), output_tensor_list)


def broadcast(tensor, src: int | None = None, group=None, async_op: bool = False, timeout=None, group_src=None):
    """Copy ``tensor`` of the root into ``tensor`` on every rank, in place. The root, as torch.distributed's:
    ``src`` a rank of the world, or ``group_src`` a rank of ``group`` (one of them).

    CPU tensors and numpy arrays move through the host transport; CUDA tensors by point-to-point
    transfers from ``src``, ordered on the current stream (``gpu.rooted``).

    Collective: every rank of ``group`` must call this with the same shape and dtype.
    """
    fn = "broadcast"
    comm = collective_group(group, fn)
    x = checks.tensor(fn, "tensor", tensor, comm)
    src = root_of(fn, comm, "src", src, group_src)
    entry = None if x.is_cuda else dispatch.resolve(fn, "broadcast", "auto", comm, "cpu", _nbytes(x), x.dtype, x)
    fingerprint_check(comm, fn, (fn, tuple(x.shape), str(x.dtype), src))
    work = gpu_rooted.broadcast(comm, x, src, async_op) if x.is_cuda else \
        cpu.broadcast(comm, x, src, entry, async_op, timeout)
    return _handle(work, [tensor])


def reduce(tensor, dst: int | None = None, op="sum", group=None, async_op: bool = False, timeout=None,
           group_dst=None):
    """Reduce ``tensor`` over all ranks into ``tensor`` of the root (others keep theirs): ``dst`` a rank of the
    world or ``group_dst`` a rank of ``group``, as torch.distributed's.

    CUDA tensors: an all-reduce of a copy (``algo="auto"``), ``dst`` keeping the result; stream-ordered.

    Collective: every rank of ``group`` must call this with the same shape, dtype and op.
    """
    fn = "reduce"
    comm = collective_group(group, fn)
    x = checks.tensor(fn, "tensor", tensor, comm, reduce=True)
    op = parse_op(fn, op)
    check_op(fn, op, x)
    dst = root_of(fn, comm, "dst", dst, group_dst)
    entry = dispatch.resolve(fn, "all_reduce", "auto", comm, "cuda", _nbytes(x), x.dtype, x) if x.is_cuda else None
    fingerprint_check(comm, fn, (fn, tuple(x.shape), str(x.dtype), op, dst))
    if x.is_cuda:
        acc = x.clone()
        registry.backend("cuda").all_reduce(comm, acc, op, entry, False, timeout)
        if comm.rank == dst:
            x.copy_(acc)
        return _handle(symm.Work(None, fn) if async_op else None, [tensor])
    return _handle(cpu.reduce(comm, x, dst, op, async_op, timeout), [tensor])


def _rooted(fn: str, tensor, items, root_name: str, root, group_root, group):
    """The checked (comm, tensor, list, root as a rank of comm) of ``gather``/``scatter``: the list of
    ``world_size`` tensors like ``tensor`` on the root, None (or an empty list, as torch.distributed takes it)
    elsewhere."""
    comm = collective_group(group, fn)
    x = checks.tensor(fn, "tensor", tensor, comm)
    root = root_of(fn, comm, root_name, root, group_root, default=0)
    name = f"{fn}_list"
    if comm.rank != root:
        if items is not None and not (isinstance(items, (list, tuple)) and not items):
            where = "destination" if root_name == "dst" else "source"
            raise ValueError(f"{fn}: {name} must be None (or empty) on non-{where} rank {comm.rank}")
        return comm, x, None, root
    return comm, x, _tensor_list(fn, name, items, comm, like=x, where=" on the root"), root


def gather(tensor, gather_list=None, dst: int | None = None, group=None, async_op: bool = False, timeout=None,
           group_dst=None):
    """The root receives every rank's ``tensor`` in ``gather_list`` (None on the other ranks). The root:
    ``dst`` a rank of the world or ``group_dst`` a rank of ``group`` (neither: world rank 0), as
    torch.distributed's.

    Collective: every rank of ``group`` must call this.
    """
    comm, x, outs, dst = _rooted("gather", tensor, gather_list, "dst", dst, group_dst, group)
    if outs is not None:
        checks.distinct_outputs("gather", "gather_list", outs)
        x = checks.read_first(x, *outs)
    fingerprint_check(comm, "gather", ("gather", tuple(x.shape), str(x.dtype), dst))
    work = gpu_rooted.gather(comm, x, outs, dst, async_op) if x.is_cuda else \
        cpu.gather(comm, x, outs, dst, async_op, timeout)
    return _handle(work, gather_list or [])


def scatter(tensor, scatter_list=None, src: int | None = None, group=None, async_op: bool = False, timeout=None,
            group_src=None):
    """The root sends ``scatter_list[r]`` to rank r of ``group``, which receives it into ``tensor``. The root:
    ``src`` a rank of the world or ``group_src`` a rank of ``group`` (neither: world rank 0), as
    torch.distributed's.

    Collective: every rank of ``group`` must call this.
    """
    comm, x, ins, src = _rooted("scatter", tensor, scatter_list, "src", src, group_src, group)
    if ins is not None:
        ins = [checks.read_first(t, x) for t in ins]
    fingerprint_check(comm, "scatter", ("scatter", tuple(x.shape), str(x.dtype), src))
    work = gpu_rooted.scatter(comm, x, ins, src, async_op) if x.is_cuda else \
        cpu.scatter(comm, x, ins, src, async_op, timeout)
    return _handle(work, [tensor])


def _object_list(fn: str, object_list, size: int | None = None, name: str = "object_list") -> None:
    if not isinstance(object_list, list) or (size is not None and len(object_list) != size):
        want = f"a list of world_size={size} entries" if size is not None else "a list"
        got = len(object_list) if isinstance(object_list, list) else type(object_list).__name__
        raise ValueError(f"{fn}: {name} must be {want}, got {got}")


def all_gather_object(object_list, obj, group=None, timeout=None) -> None:
    """``object_list[r]`` becomes rank r's ``obj`` (any picklable object), as
    torch.distributed.all_gather_object; through the host transport, whatever the device.

    Collective: every rank of ``group`` must call this.
    """
    fn = "all_gather_object"
    comm = collective_group(group, fn)
    _object_list(fn, object_list, comm.size)
    object_list[:] = comm.allgather_object(obj, timeout)


def gather_object(obj, object_gather_list=None, dst: int | None = None, group=None, timeout=None,
                  group_dst=None) -> None:
    """The root's ``object_gather_list[r]`` becomes rank r's ``obj`` (torch.distributed.gather_object; the
    other ranks pass None); through the host transport. The root: ``dst`` a rank of the world or ``group_dst``
    a rank of ``group`` (neither: world rank 0).

    Raises ValueError on the root when its list is not world_size long, after the exchange (which every rank
    completes, so that no rank's object is left for a later call to take).
    Collective: every rank of ``group`` must call this.
    """
    fn = "gather_object"
    comm = collective_group(group, fn)
    dst = root_of(fn, comm, "dst", dst, group_dst, default=0)
    got = comm.allgather_object(obj, timeout)
    if comm.rank == dst:
        _object_list(fn, object_gather_list, comm.size, "object_gather_list")
        object_gather_list[:] = got


def scatter_object_list(scatter_object_output_list, scatter_object_input_list=None, src: int | None = None,
                        group=None, timeout=None, group_src=None) -> None:
    """``scatter_object_output_list[0]`` becomes the root's ``scatter_object_input_list[rank]``
    (torch.distributed.scatter_object_list; the input list matters on the root only); through the host transport.
    The root: ``src`` a rank of the world or ``group_src`` a rank of ``group`` (neither: world rank 0).

    Raises ValueError on every rank when src's input list is not world_size long (after the exchange).
    Collective: every rank of ``group`` must call this.
    """
    fn = "scatter_object_list"
    comm = collective_group(group, fn)
    src = root_of(fn, comm, "src", src, group_src, default=0)
    if not isinstance(scatter_object_output_list, list) or not scatter_object_output_list:
        raise ValueError(f"{fn}: scatter_object_output_list must be a non-empty list, got "
                         f"{scatter_object_output_list!r}")
    mine = list(scatter_object_input_list) if comm.rank == src and isinstance(scatter_object_input_list,
                                                                               (list, tuple)) else None
    got = comm.allgather_object(mine, timeout)[src]
    if got is None or len(got) != comm.size:
        what = type(scatter_object_input_list).__name__ if got is None else f"{len(got)} entries"
        raise ValueError(f"{fn}: the root's (group_src={src}) scatter_object_input_list must be a list of "
                         f"world_size={comm.size} entries, got {what}")
    scatter_object_output_list[0] = got[comm.rank]


def broadcast_object_list(object_list, src: int | None = None, group=None, timeout=None, device=None,
                          group_src=None) -> None:
    """Every rank's ``object_list`` becomes the root's (picklable objects), as
    torch.distributed.broadcast_object_list; every rank passes a list of the same length. The root: ``src`` a
    rank of the world or ``group_src`` a rank of ``group`` (neither: world rank 0). ``device`` is accepted for
    torch's signature and unused: objects always move through the host transport.

    Raises ValueError on a rank whose list length differs from ``src``'s (after the exchange, which every
    rank completes).
    Collective: every rank of ``group`` must call this.
    """
    fn = "broadcast_object_list"
    comm = collective_group(group, fn)
    src = root_of(fn, comm, "src", src, group_src, default=0)
    _object_list(fn, object_list)
    got = comm.allgather_object(list(object_list) if comm.rank == src else None, timeout)[src]
    if len(got) != len(object_list):
        raise ValueError(f"{fn}: object_list has {len(object_list)} entries on rank {comm.rank}, {len(got)} on "
                         f"the root (group_src={src})")
    object_list[:] = got


def barrier(group=None, async_op: bool = False, device_ids=None, timeout=None):
    """Block until every rank of ``group`` has called ``barrier`` (deadline: the group's timeout).

    ``device_ids`` is taken for torch.distributed's signature (NCCL code passes ``[local_rank]``) and checked
    to be a list of ints; the barrier is on the host, whatever the devices.

    Raises ``xelink.TimeoutError`` naming the ranks that did not arrive.
    Collective: every rank of ``group`` must call this.
    """
    if device_ids is not None and (not isinstance(device_ids, (list, tuple))
                                   or not all(isinstance(d, int) and not isinstance(d, bool) for d in device_ids)):
        raise TypeError(f"barrier: device_ids={device_ids!r} must be a list of ints")
    return cpu.barrier(collective_group(group, "barrier"), async_op, timeout)


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False) -> None:
    """``barrier`` under torch.distributed.monitored_barrier's name and signature: on the host, its
    ``xelink.TimeoutError`` names every rank that did not arrive (whatever ``wait_all_ranks``: torch names
    the first one only without it).

    Collective: every rank of ``group`` must call this.
    """
    if not isinstance(wait_all_ranks, bool):
        raise TypeError(f"monitored_barrier: wait_all_ranks={wait_all_ranks!r} must be a bool")
    cpu.barrier(collective_group(group, "monitored_barrier"), False, timeout)


device_barrier = gpu.device_barrier
synchronize = gpu.synchronize_group

compiled.bind(all_reduce=all_reduce, all_gather_into_tensor=all_gather_into_tensor,
              reduce_scatter_tensor=reduce_scatter_tensor)

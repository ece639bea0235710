"""Argument checks of the collectives, made once at the front door for every backend.

Each raises ``ValueError``/``TypeError`` prefixed with the function name and naming the bad value,
before anything is sent.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .. import config
from ..comm import Communicator, resolve_group
from ..kernels.common import byte_span

__all__ = ["ReduceOp", "DTYPES", "REDUCE_DTYPES", "parse_op", "tensor", "pair", "check_op",
           "check_rank", "root_of", "group_of", "collective_group", "fingerprint_check", "backend_of", "device_of",
           "check_rank_device", "read_first", "shared_pair", "distinct_outputs"]

DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64)
# CPU ranks reduce these too, as torch.distributed's gloo does (integers wrap; bool: sum and max are "or",
# prod and min "and"); the GPU kernels take DTYPES.
REDUCE_DTYPES = DTYPES + (torch.int16, torch.int8, torch.uint8, torch.bool)


class ReduceOp:
    """Reduction names accepted by ``op=`` (torch's ``ReduceOp`` values are accepted too)."""

    SUM, AVG, MAX, MIN, PROD = "sum", "avg", "max", "min", "prod"
    PRODUCT = PROD  # torch.distributed's name
    BAND, BOR, BXOR = "band", "bor", "bxor"  # integer and bool tensors on CPU ranks, as gloo's
    BITWISE = (BAND, BOR, BXOR)
    ALL = (SUM, AVG, MAX, MIN, PROD) + BITWISE


def parse_op(fn: str, op) -> str:
    if type(op) is str and op in ReduceOp.ALL:  # the common spelling, taken as it is
        return op
    name = op
    if not isinstance(op, str):
        # torch.distributed.ReduceOp's RedOpType members print as e.g. "RedOpType.SUM"; a ReduceOp instance
        # (``ReduceOp(ReduceOp.MAX)``) holds one as ``op``.
        member = getattr(op, "op", op)
        name = str(getattr(member, "name", member)).rsplit(".", 1)[-1]
    name = name.lower()
    name = {"product": ReduceOp.PROD}.get(name, name)  # torch's ReduceOp.PRODUCT
    if name not in ReduceOp.ALL:
        raise ValueError(f"{fn}: op={op!r} is not one of {', '.join(ReduceOp.ALL)}")
    return name


def backend_of(x) -> str:
    """The backend that moves ``x``: ``"cuda"`` for CUDA tensors, ``"cpu"`` for CPU tensors and numpy arrays."""
    return "cuda" if isinstance(x, torch.Tensor) and x.is_cuda else "cpu"


def _dtypes(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def tensor(fn: str, name: str, x, comm: Communicator, *, reduce: bool = False) -> torch.Tensor:
    """The torch tensor behind ``x`` (a numpy array is wrapped without a copy), checked for ``comm``.

    CPU tensors and numpy arrays take any dtype (``reduce``: a reducible one); CUDA tensors must be on
    the device this rank of ``comm`` drives and have one of ``DTYPES``. A tensor that requires grad is
    returned detached (the same memory): collectives move data outside autograd, as torch.distributed's
    do, so a leaf that requires grad is written in place instead of failing mid-call.
    """
    if isinstance(x, np.ndarray):
        if not (x.flags.c_contiguous and x.flags.writeable):
            raise ValueError(f"{fn}: {name} must be a C-contiguous, writeable numpy array")
        if not x.dtype.isnative:
            raise ValueError(f"{fn}: {name} has numpy dtype {x.dtype.str}, not in this machine's byte order, which "
                             f"torch cannot wrap (x.astype(x.dtype.newbyteorder('=')) makes a copy that is)")
        try:
            x = torch.from_numpy(x)
        except TypeError:
            raise TypeError(f"{fn}: {name} has numpy dtype {x.dtype}, which torch cannot wrap") from None
    elif not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor or numpy.ndarray, got {type(x).__name__}")
    elif x.requires_grad:
        x = x.detach()
    if x.is_cuda:
        if x.device != device_of(comm):
            raise ValueError(f"{fn}: {name} is on {x.device} but this rank of {comm.name} drives {comm.device}")
        if not x.is_contiguous():
            raise ValueError(f"{fn}: {name} must be contiguous (call .contiguous() first)")
        if x.dtype not in DTYPES:
            raise TypeError(f"{fn}: {name}.dtype={x.dtype} is not supported on GPUs; use one of {_dtypes(DTYPES)}")
        return x
    if not x.is_cpu:
        raise ValueError(f"{fn}: {name} is on {x.device}; collectives move CPU tensors, numpy arrays and "
                         f"CUDA tensors")
    if not x.is_contiguous():
        raise ValueError(f"{fn}: {name} must be contiguous (call .contiguous() first)")
    if x.is_conj() or x.is_neg():  # lazily conjugated / negated views: their bytes are not their values
        raise ValueError(f"{fn}: {name} is a lazily conjugated or negated view (call .resolve_conj() and "
                         f".resolve_neg() first)")
    if reduce and x.dtype not in REDUCE_DTYPES:
        raise TypeError(f"{fn}: {name}.dtype={x.dtype} is not reducible here; use one of {_dtypes(REDUCE_DTYPES)}")
    return x


def device_of(comm: Communicator) -> torch.device:
    """The device this rank of ``comm`` drives, with its index (the current CUDA device where none is set)."""
    dev = comm.device  # a torch.device with its index from xelink.init: no conversion on the hot path
    if not isinstance(dev, torch.device):
        dev = torch.device(dev)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def check_rank_device(fn: str, name: str, x: torch.Tensor, comm: Communicator) -> None:
    """A composed op's tensor ``x`` is a CPU tensor or on the CUDA device this rank of ``comm`` drives."""
    if x.is_cuda:
        if x.device != device_of(comm):
            raise ValueError(f"{fn}: {name} is on {x.device} but this rank of {comm.name} drives {comm.device}")
    elif x.device.type != "cpu":
        raise ValueError(f"{fn}: {name} is on {x.device}; CPU and CUDA tensors are supported")


def pair(fn: str, output, input, comm: Communicator, *, reduce: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``tensor`` of an op's output and input, which must share a backend and a dtype."""
    out = tensor(fn, "output", output, comm, reduce=reduce)
    inp = tensor(fn, "input", input, comm, reduce=reduce)
    if out.is_cuda != inp.is_cuda:
        raise ValueError(f"{fn}: output is on {out.device} and input on {inp.device}; both must be on one device")
    if out.dtype != inp.dtype:
        raise TypeError(f"{fn}: output.dtype={out.dtype} != input.dtype={inp.dtype}")
    return out, inp


def read_first(read: torch.Tensor, *written: torch.Tensor, in_place: tuple | None = None) -> torch.Tensor:
    """``read`` (a call's input), or a copy of it where its bytes meet an output's (``written``): a call reads all of
    its input before it writes any output, as if it had copied it first. (The algorithms send blocks of the input
    after writing blocks of the output: ``all_to_all_single(x, x)`` returned other ranks' blocks, a scatter root
    whose output was another rank's list entry sent it its own.) ``in_place``: (block, whole, index) when the one
    overlap the algorithms take without a copy is allowed: ``block`` exactly the index-th block of ``whole``
    (torch.distributed's in-place all_gather_into_tensor and reduce_scatter_tensor)."""
    lo = read.data_ptr()  # (contiguous tensors: the checks refuse others; a few host operations a call)
    hi = lo + read.numel() * read.element_size()
    for w in written:
        start = w.data_ptr()
        if start < hi and lo < start + w.numel() * w.element_size() and w.device == read.device:
            break
    else:
        return read
    if in_place is not None:
        block, whole, index = in_place
        if block.dtype == whole.dtype and block.data_ptr() == whole.data_ptr() + index * block.numel() * \
                block.element_size():
            return read
    return read.clone()


def shared_pair(buffers: Sequence[tuple[torch.Tensor, bool]]) -> tuple[int, int] | None:
    """The places (i < j) of two tensors that share memory, one of them written, among ``buffers`` ((tensor, whether
    the call writes it) pairs; tensors only read may share); None where there are none. A sweep over the byte spans
    in address order (a list of a large world's size costs a sort, not every pair)."""
    spans = sorted((byte_span(x) + (str(x.device), writes, i) for i, (x, writes) in enumerate(buffers) if x.numel()),
                   key=lambda e: (e[2], e[0]))
    ends: dict = {}  # device -> ((furthest end of any tensor so far, its place), (the same of a written one))
    for lo, hi, dev, writes, i in spans:
        (any_end, any_at), (written_end, written_at) = ends.get(dev, ((0, -1), (0, -1)))
        other = written_at if lo < written_end else any_at if writes and lo < any_end else None
        if other is not None:
            return min(other, i), max(other, i)
        ends[dev] = (max((any_end, any_at), (hi, i)),
                     max((written_end, written_at), (hi, i)) if writes else (written_end, written_at))
    return None


def distinct_outputs(fn: str, name: str, outs: Sequence[torch.Tensor]) -> None:
    """No two tensors of an output list share memory (``[t] * world_size`` would keep one rank's block and lose the
    rest): ValueError naming both entries."""
    pair = shared_pair([(t, True) for t in outs])
    if pair is not None:
        raise ValueError(f"{fn}: {name}[{pair[0]}] and {name}[{pair[1]}] share memory; each rank's block needs a "
                         f"tensor of its own")


def check_op(fn: str, op: str, x: torch.Tensor) -> None:
    """``op`` (parsed) suits ``x``: avg a floating dtype; the bitwise ops integers or bool, on CPU ranks."""
    if op == ReduceOp.AVG and not x.dtype.is_floating_point:
        raise TypeError(f"{fn}: op='avg' needs a floating dtype, got {x.dtype}")
    if op in ReduceOp.BITWISE:
        if x.dtype.is_floating_point or x.dtype.is_complex:
            raise TypeError(f"{fn}: op={op!r} needs an integer or bool dtype, got {x.dtype}")
        if x.is_cuda:
            raise ValueError(f"{fn}: op={op!r} runs on CPU ranks only (the GPU kernels and NCCL have no bitwise "
                             f"reductions)")


def check_rank(fn: str, name: str, value, size: int) -> int:
    value = config.integer(fn, name, value)
    if not 0 <= value < size:
        raise ValueError(f"{fn}: {name}={value} is out of range for a group of size {size}")
    return value


def root_of(fn: str, comm: Communicator, name: str, rank, group_rank, default: int | None = None) -> int:
    """The rank of ``comm`` that a root or peer argument names, as torch.distributed takes them: ``name=rank`` a
    rank of the world (``xelink.init``'s communicator, whatever ``group`` is), or ``group_<name>=group_rank`` a
    rank of ``comm``; not both. Neither: the world rank ``default`` (None: one of them is required)."""
    if rank is not None and group_rank is not None:
        raise ValueError(f"{fn}: pass {name}= (a world rank) or group_{name}= (a rank of the group), not both; got "
                         f"{name}={rank!r}, group_{name}={group_rank!r}")
    if group_rank is not None:
        return check_rank(fn, f"group_{name}", group_rank, comm.size)
    if rank is None:
        if default is None:
            raise ValueError(f"{fn}: {name}= (a world rank) or group_{name}= (a rank of the group) is required")
        rank = default
    rank = config.integer(fn, name, rank)
    index = comm.group_rank_of(rank)
    if index is not None:
        return index
    ranks = comm.world_ranks
    if ranks == list(range(comm.size)):
        raise ValueError(f"{fn}: {name}={rank} is out of range for a group of size {comm.size}")
    raise ValueError(f"{fn}: {name}={rank} is a world rank outside {comm.name} (its world ranks: {ranks}); "
                     f"group_{name}= takes a rank of the group")


def group_of(group, fn: str) -> Communicator:
    comm = resolve_group(group, fn)
    if comm._broken is not None or comm._freed:
        comm._live(fn)
    return comm


def collective_group(group, fn: str) -> Communicator:
    """``group_of`` for a collective call: counts the call (``Communicator.issued``) before its other arguments
    are checked."""
    comm = group_of(group, fn)
    comm.issued += 1
    return comm


def fingerprint_check(comm: Communicator, fn: str, signature: tuple) -> None:
    """With ``XELINK_CHECK=1`` (``comm.check_calls``): every rank must call the same op on the same shapes.

    Costs one control exchange per call, so it is off by default (like TORCH_DISTRIBUTED_DEBUG).
    """
    if not comm.check_calls or comm.size == 1:
        return
    seen = comm.allgather_object(signature)
    differ = [r for r, s in enumerate(seen) if s != signature]
    if differ:
        raise ValueError(f"{fn}: ranks disagree about the call: rank {comm.rank} has {signature}, rank "
                         f"{differ[0]} has {seen[differ[0]]}")


def splits(fn: str, name: str, sizes: Sequence[int] | None, rows: int, n: int) -> list[int]:
    """Rows per rank of an all-to-all (``sizes`` None: equal splits of ``rows``)."""
    if sizes is None:
        if rows % n:
            raise ValueError(f"{fn}: {name} is None, so dim 0 ({rows}) must divide by world_size={n}")
        return [rows // n] * n
    sizes = list(sizes)
    if len(sizes) != n or any(not config.is_int(s) or s < 0 for s in sizes):
        raise ValueError(f"{fn}: {name}={sizes} must be {n} non-negative ints (one per rank)")
    sizes = [int(s) for s in sizes]
    if sum(sizes) != rows:
        raise ValueError(f"{fn}: sum({name})={sum(sizes)} != dim 0 of the tensor ({rows})")
    return sizes

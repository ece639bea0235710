"""NCCL through torch.distributed (the communicator's process group): the baseline, and the fallback
where peer memory is missing (several hosts, more than ``MAX_WORLD`` ranks, no Triton)."""
from __future__ import annotations

__all__ = ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"]


def _dist():
    import torch.distributed as dist

    return dist


def _op(op):
    R = _dist().ReduceOp
    return {"sum": R.SUM, "avg": R.AVG, "max": R.MAX, "min": R.MIN, "prod": R.PRODUCT}[op]


def all_reduce(comm, x, op, async_op, timeout):
    return _dist().all_reduce(x, op=_op(op), group=comm.process_group(), async_op=async_op)


def all_gather_into_tensor(comm, out, inp, async_op, timeout):
    return _dist().all_gather_into_tensor(out, inp, group=comm.process_group(), async_op=async_op)


def reduce_scatter_tensor(comm, out, inp, op, async_op, timeout):
    return _dist().reduce_scatter_tensor(out, inp, op=_op(op), group=comm.process_group(), async_op=async_op)


def all_to_all_single(comm, out, inp, async_op, timeout, out_splits=None, in_splits=None):
    return _dist().all_to_all_single(out, inp, out_splits, in_splits, group=comm.process_group(),
                                     async_op=async_op)

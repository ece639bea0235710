"""Collectives with torch.distributed's names and semantics, on CPU tensors and numpy arrays."""
from . import all_gather as _ag, all_reduce as _ar, all_to_all as _a2a, reduce_scatter as _rs
from ._common import ReduceOp, Work
from .all_gather import all_gather, all_gather_into_tensor
from .all_reduce import all_reduce
from .all_to_all import all_to_all_single
from .p2p import P2POp, barrier, batch_isend_irecv, irecv, isend, recv, send
from .reduce_scatter import reduce_scatter_tensor
from .rooted import broadcast, gather, reduce, scatter

# The algorithms each op accepts as ``algo=`` (besides "auto").
ALGORITHMS = {"all_reduce": _ar.ALGOS, "all_gather": _ag.ALGOS, "reduce_scatter": _rs.ALGOS,
              "all_to_all": _a2a.ALGOS}

__all__ = [
    "ALGORITHMS", "P2POp", "ReduceOp", "Work", "all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all_single",
    "barrier", "batch_isend_irecv", "broadcast", "gather", "irecv", "isend", "recv", "reduce",
    "reduce_scatter_tensor", "scatter", "send",
]

"""Collectives with torch.distributed's names and semantics, on CPU tensors and numpy arrays."""
from . import all_gather as _ag, all_reduce as _ar, all_to_all as _a2a, compiled as _compiled, reduce_scatter as _rs  # noqa: F401 (compiled: registers the custom ops)
from . import gpu as _gpu
from ._common import ReduceOp, Work
from .all_gather import all_gather, all_gather_into_tensor
from .all_reduce import all_reduce
from .all_to_all import all_to_all_single
from .p2p import P2POp, barrier, batch_isend_irecv, irecv, isend, recv, send
from .reduce_scatter import reduce_scatter_tensor
from .rooted import broadcast, gather, reduce, scatter

device_barrier, synchronize = _gpu.device_barrier, _gpu.synchronize_group
# The algorithms each op accepts as ``algo=`` (besides "auto") on CPU tensors; GPU_ALGORITHMS on CUDA tensors.
GPU_ALGORITHMS = _gpu.ALGOS
ALGORITHMS = {"all_reduce": _ar.ALGOS, "all_gather": _ag.ALGOS, "reduce_scatter": _rs.ALGOS,
              "all_to_all": _a2a.ALGOS}

__all__ = [
    "ALGORITHMS", "GPU_ALGORITHMS", "P2POp", "device_barrier", "synchronize", "ReduceOp", "Work", "all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all_single",
    "barrier", "batch_isend_irecv", "broadcast", "gather", "irecv", "isend", "recv", "reduce",
    "reduce_scatter_tensor", "scatter", "send",
]

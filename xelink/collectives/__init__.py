"""Collectives with torch.distributed's names and semantics, on CPU tensors (and numpy arrays) and CUDA tensors.

- ``api``: the front doors (validate once, resolve the group, pick the backend by device).
- ``registry``: the one table of op x algorithm x backend; ``dispatch``: ``algo=`` and the one ``auto``.
- ``cpu/``, ``gpu/``: the backends (schedules over the host transports; peer-memory kernels and NCCL).
- ``p2p``: point-to-point; ``compiled``: the custom ops ``torch.compile`` traces.
"""
from . import cpu as _cpu, gpu as _gpu  # noqa: F401 (registers the backends' algorithms)
from . import registry
from .api import (all_gather, all_gather_into_tensor, all_gather_object, all_gather_single, all_reduce, all_to_all,
                  all_to_all_single, barrier, broadcast, broadcast_object_list, device_barrier, gather, gather_object,
                  monitored_barrier, reduce, reduce_scatter, reduce_scatter_single, reduce_scatter_tensor, scatter,
                  scatter_object_list, synchronize)
from .checks import ReduceOp
from ..work import Work  # every handle's base: torch.distributed's Work protocol
from .gpu import GpuWork
from .p2p import (P2POp, batch_isend_irecv, cuda_p2p_unsupported, irecv, isend, recv, recv_object_list, send,
                  send_object_list)

# The algorithms each op accepts as ``algo=`` (besides "auto"): on CPU tensors, and on CUDA tensors.
ALGORITHMS = registry.names("cpu")
GPU_ALGORITHMS = registry.names("cuda")

__all__ = [
    "ALGORITHMS", "GPU_ALGORITHMS", "GpuWork", "P2POp", "ReduceOp", "Work", "all_gather", "all_gather_into_tensor",
    "all_gather_object", "all_gather_single", "all_reduce", "all_to_all", "all_to_all_single", "barrier",
    "batch_isend_irecv", "broadcast", "cuda_p2p_unsupported", "broadcast_object_list", "device_barrier", "gather", "gather_object", "irecv",
    "isend", "monitored_barrier", "recv", "recv_object_list", "reduce", "reduce_scatter", "reduce_scatter_single",
    "reduce_scatter_tensor", "registry", "scatter", "scatter_object_list", "send", "send_object_list", "synchronize",
]

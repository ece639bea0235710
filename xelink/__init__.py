"""xelink: topology-aware collectives and fast local kernels for multi-GPU jobs."""
from .collectives import (P2POp, ReduceOp, Work, all_gather, all_gather_into_tensor, all_gather_object,
                          all_gather_single, all_reduce, all_to_all, all_to_all_single, barrier, batch_isend_irecv,
                          broadcast, broadcast_object_list, device_barrier, gather, gather_object, irecv, isend,
                          monitored_barrier, recv, recv_object_list, reduce, reduce_scatter, reduce_scatter_single,
                          reduce_scatter_tensor, scatter, scatter_object_list, send, send_object_list, synchronize)
from .comm import (NON_GROUP_MEMBER, Backend, Communicator, GroupMember, get_backend, get_global_rank, get_group_rank,
                   get_process_group_ranks, get_rank, get_world_size, group, new_group, new_subgroups,
                   new_subgroups_by_enumeration, split_group)
from .dist import (CP_ALGOS, CP_LAYOUTS, DIST_GEMM_ALGOS, all_gather_matmul, cp_attention, cp_attention_varlen,
                   cp_positions, cp_shard, cp_unshard, matmul_all_reduce, matmul_reduce_scatter)
from .errors import ConfigError, LaunchError, NotInitializedError, TimeoutError, XelinkError
from .mesh import DeviceMesh, init_device_mesh
from .runtime import (destroy_process_group, finalize, get_node_local_rank, get_world, init, init_process_group,
                      is_available, is_initialized)
from .symm import empty

__version__ = "0.1.0"

__all__ = [
    "P2POp", "ReduceOp", "Work", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_single",
    "all_reduce",
    "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list",
    "gather", "gather_object", "irecv", "isend", "recv", "reduce", "reduce_scatter", "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter", "scatter_object_list", "send", "device_barrier", "synchronize", "empty", "monitored_barrier",
    "send_object_list", "recv_object_list",
    "Backend",
    "Communicator",
    "GroupMember",
    "group",
    "DeviceMesh",
    "init_device_mesh",
    "DIST_GEMM_ALGOS", "all_gather_matmul", "matmul_all_reduce", "matmul_reduce_scatter",
    "CP_ALGOS", "CP_LAYOUTS", "cp_attention", "cp_attention_varlen", "cp_positions", "cp_shard", "cp_unshard",
    "ConfigError",
    "LaunchError",
    "NotInitializedError",
    "TimeoutError",
    "XelinkError",
    "destroy_process_group",
    "finalize",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_node_local_rank",
    "get_process_group_ranks",
    "get_rank",
    "get_world",
    "get_world_size",
    "init",
    "init_process_group",
    "is_available",
    "is_initialized",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "NON_GROUP_MEMBER",
    "split_group",
    "__version__",
]

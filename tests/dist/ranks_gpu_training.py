"""The training client of ``ranks_training`` (a transformer block on CP x TP meshes of ranks, against one process)
on CUDA tensors in float32, ranks sharing one GPU: cp_attention's backward through point-to-point on CUDA (ring)
and the CUDA all-gather and reduce-scatter (all_gather), matmul_all_reduce's all-reduce of the output gradient on
the GPU. Skips without a GPU (CPU CI); run on a GPU machine, log committed."""
import torch

from ranks_training import train

WORLD_SIZES = (2, 4)
GPUS = 1
LAUNCH_TIMEOUT = 600
ENV = {"XELINK_RANKS_PER_DEVICE": "4", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def check_gradients_of_a_block_trained_on_a_tp_cp_mesh_on_cuda(world):
    for tp in sorted({1, 2}):
        for algo in ("ring", "all_gather"):
            train(world, tp, algo, device=world.device, dtype=torch.float32, tol=2e-4)
    torch.cuda.synchronize()

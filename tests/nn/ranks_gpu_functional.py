"""xelink.nn.functional on CUDA tensors (2 GPUs, or 2 ranks sharing one with XELINK_RANKS_PER_DEVICE=2): the
tensor- and sequence-parallel MLP training of ranks_functional.py, in float32, through the GPU collectives.
Skips on machines without the GPUs (CPU CI)."""
import os

import torch

from ranks_functional import tp_training

WORLD_SIZES = (2,)
GPUS = 1 if os.environ.get("XELINK_RANKS_PER_DEVICE") else 2
ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def check_tensor_parallel_training_on_cuda(world):
    tp_training(world, torch.device(world.device), torch.float32, tol=1e-4)

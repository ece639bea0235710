"""xelink.nn.functional on CUDA tensors (2 GPUs, or 2 ranks sharing one with XELINK_RANKS_PER_DEVICE=2): the
tensor- and sequence-parallel MLP training of ranks_functional.py, in float32, through the GPU collectives, and the
rooted ops' gradients (reduce, broadcast). Skips on machines without the GPUs (CPU CI)."""
import os

import torch

from ranks_functional import tp_training

WORLD_SIZES = (2,)
GPUS = 1 if os.environ.get("XELINK_RANKS_PER_DEVICE") else 2
ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def check_tensor_parallel_training_on_cuda(world):
    tp_training(world, torch.device(world.device), torch.float32, tol=1e-4)


def check_reduce_and_broadcast_gradients_on_cuda(world):
    # reduce (sum, avg) and broadcast on CUDA tensors: each rank's input gradient equals one process's autograd of
    # the same outputs (the root's reduction, the others' own inputs; the root's tensor everywhere)
    import xelink.nn.functional as XF
    from ranks_functional import _global, match_one_process

    n, r, dev = world.size, world.rank, torch.device(world.device)
    X, W = _global((n, 6), 1, dev, torch.float32), _global((n, 6), 2, dev, torch.float32)
    cases = {"reduce sum": (lambda x: XF.reduce(x, dst=n - 1),
                            lambda X: torch.stack([X.sum(0) if q == n - 1 else X[q] for q in range(n)])),
             "reduce avg": (lambda x: XF.reduce(x, op="avg", group_dst=0),
                            lambda X: torch.stack([X.mean(0) if q == 0 else X[q] for q in range(n)])),
             "broadcast": (lambda x: XF.broadcast(x, src=0), lambda X: X[0].expand(n, -1))}
    match_one_process(cases, X, W, r)

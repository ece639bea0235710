"""4 ranks on 2 GPUs (2 per GPU), described as 2 packages x 2 (and as 3 + 1): peer memory between ranks of one
GPU and across GPUs, and the hierarchical/topology-aware GPU algorithms on it. Skips without 2 GPUs."""
import torch

import xelink
from ranks_gpu_collectives import _data, _reduce, _same

WORLD_SIZES = (4,)
GPUS = 2
LAUNCH_TIMEOUT = 600
ENV = {"XELINK_RANKS_PER_DEVICE": "2", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def _packaged(world):
    comm = world.split(0)
    comm.packages = [[0, 1], [2, 3]]
    return comm


def check_two_ranks_share_each_gpu(world):
    devices = world.allgather_object(str(world.device))
    assert devices == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"], devices


def check_every_algorithm_on_packages(world):
    comm = _packaged(world)
    dev, w = torch.device(world.device), world.size
    for dtype in (torch.bfloat16, torch.float32):
        for n in (1, 1001, 1 << 16):
            want = _reduce([_data(r, n, dtype, "cpu") for r in range(w)], "sum", dtype)
            for algo in ("direct", "two_shot", "hierarchical", "auto"):
                x = _data(comm.rank, n, dtype, dev)
                xelink.all_reduce(x, group=comm, algo=algo)
                _same(f"all_reduce {algo} {dtype} n={n}", x, want)
            shards = [_data(r, n, dtype, "cpu") for r in range(w)]
            for algo in ("direct", "topo", "auto"):
                out = torch.zeros(w * n, dtype=dtype, device=dev)
                xelink.all_gather_into_tensor(out, shards[comm.rank].to(dev), group=comm, algo=algo)
                _same(f"all_gather {algo} {dtype} n={n}", out, torch.cat(shards))
            full = [_data(r, w * n, dtype, "cpu") for r in range(w)]
            out = torch.zeros(n, dtype=dtype, device=dev)
            xelink.reduce_scatter_tensor(out, full[comm.rank].to(dev), group=comm, algo="direct")
            _same(f"reduce_scatter {dtype} n={n}", out,
                  _reduce([f[comm.rank * n:(comm.rank + 1) * n] for f in full], "sum", dtype))
            out = torch.zeros(w * n, dtype=dtype, device=dev)
            xelink.all_to_all_single(out, full[comm.rank].to(dev), group=comm, algo="direct")
            _same(f"all_to_all {dtype} n={n}", out, torch.cat([full[p][comm.rank * n:(comm.rank + 1) * n]
                                                                for p in range(w)]))
    xelink.synchronize(comm)


def check_uneven_packages_run_hierarchical_and_topo(world):
    """Packages of 3 + 1 ranks over two GPUs (the package of three spans both): the uneven paths."""
    comm = world.split(0)
    comm.packages = [[0, 1, 2], [3]]
    dev, w = torch.device(world.device), world.size
    for dtype in (torch.bfloat16, torch.float32):
        for n in (1, 1001, 1 << 16):
            x = _data(comm.rank, n, dtype, dev)
            xelink.all_reduce(x, group=comm, algo="hierarchical")
            _same(f"hierarchical uneven {dtype} n={n}", x,
                  _reduce([_data(r, n, dtype, "cpu") for r in range(w)], "sum", dtype))
            shards = [_data(r, n, dtype, "cpu") for r in range(w)]
            out = torch.zeros(w * n, dtype=dtype, device=dev)
            xelink.all_gather_into_tensor(out, shards[comm.rank].to(dev), group=comm, algo="topo")
            _same(f"topo uneven {dtype} n={n}", out, torch.cat(shards))
    xelink.synchronize(comm)

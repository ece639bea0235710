"""Buffers reused across calls on CUDA tensors, with several ranks sharing one GPU: back-to-back calls
that change op, size, dtype and algorithm (xelink's peer-memory algorithms) with ranks delayed on the
host and on the GPU, CUDA-graph replays of mixed sequences with new inputs, and data-parallel training
against one process. Skips without a GPU (CPU CI); run on a GPU machine, log committed."""
import random
import time

import torch

import xelink
from collective_cases import assert_same, compare_training, data, expected_reduce, run_sequence
from xelink.collectives import GPU_ALGORITHMS

WORLD_SIZES = (2, 3, 4)
GPUS = 1
LAUNCH_TIMEOUT = 900
# Every rank of the launch on GPU 0 (peer memory between processes of one device works through IPC).
ENV = {"XELINK_RANKS_PER_DEVICE": "4", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}

# NCCL refuses two ranks of one GPU in a communicator, so these checks draw xelink's own algorithms.
PEER = {op: tuple(a for a in algos if a != "nccl") for op, algos in GPU_ALGORITHMS.items()}
FLAT = {op: tuple(a for a in algos if a not in ("hierarchical", "topo")) for op, algos in PEER.items()}
GPU_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _packaged(world):
    """The world as packages for hierarchical and topo: 2 x 2 at 4 ranks, 2 + 1 (uneven) at 3, else one rank
    each."""
    comm = world.split(0)
    comm.packages = {4: [[0, 1], [2, 3]], 3: [[0, 1], [2]]}.get(world.size, [[r] for r in range(world.size)])
    return comm


def _delay(rank):
    """Sleep on the host or on the GPU stream (torch.cuda._sleep spins the GPU ~2 GHz cycles)."""
    pick = random.Random(rank)

    def delay(seconds):
        if pick.random() < 0.5:
            time.sleep(seconds)
        else:
            torch.cuda._sleep(int(seconds * 2e9))
    return delay


def _pool(comm, nbytes=1 << 21, buffers=5):
    """Symmetric buffers (xelink.empty), handed out in turn: never one of the last four."""
    bufs = [xelink.empty(nbytes, dtype=torch.uint8, group=comm) for _ in range(buffers)]
    turn = [0]

    def symmetric(size):
        assert size <= nbytes, size
        turn[0] += 1
        return bufs[turn[0] % buffers]
    return symmetric


def check_back_to_back_calls(world):
    dev = torch.device(world.device)
    run_sequence(world, 120, seed=11, algos=FLAT, ops=GPU_OPS, device=dev, delay=_delay(world.rank),
                 symmetric=_pool(world), what="flat")
    comm = _packaged(world)
    run_sequence(comm, 60, seed=12, algos=PEER, ops=GPU_OPS, device=dev, delay=_delay(world.rank),
                 symmetric=_pool(comm), what=f"packages {comm.packages}")
    xelink.synchronize(comm)
    comm.free()
    xelink.synchronize()


def check_graph_replays_of_mixed_calls(world):
    """One graph holding calls of several sizes and algorithms (a two-shot followed by a one-shot
    on the same scratch buffer among them), replayed with new inputs each time."""
    dev, n, r = torch.device(world.device), world.size, world.rank
    plan = [("all_reduce", "two_shot", 70001, torch.bfloat16), ("all_reduce", "direct", 640, torch.float32),
            ("all_reduce", "direct", 2048, torch.float32), ("all_gather", "direct", 1009, torch.float16),
            ("reduce_scatter", "direct", 4099, torch.float32), ("all_reduce", "two_shot", 10, torch.int64),
            ("all_reduce", "direct", 64, torch.bfloat16)]
    bufs = []
    for name, algo, count, dtype in plan:
        src = torch.zeros(count * (n if name == "reduce_scatter" else 1), dtype=dtype, device=dev)
        out = torch.zeros(count * n, dtype=dtype, device=dev) if name == "all_gather" else (
            torch.zeros(count, dtype=dtype, device=dev) if name == "reduce_scatter" else src)
        bufs.append((src, out))

    def calls():
        for (name, algo, _, _), (src, out) in zip(plan, bufs):
            if name == "all_reduce":
                xelink.all_reduce(src, algo=algo)
            elif name == "all_gather":
                xelink.all_gather_into_tensor(out, src, algo=algo)
            else:
                xelink.reduce_scatter_tensor(out, src, algo=algo)

    calls()  # warm-up: peer memory, scratch and kernels are ready before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    for replay in range(6):
        if replay == 4:  # an eager call that grows the scratch buffer the graph's plans point into
            big = data(r, 999, 3 << 20, torch.bfloat16).to(dev)
            xelink.all_reduce(big, algo="direct")
            assert_same(big.cpu(), expected_reduce(n, 999, 3 << 20, torch.bfloat16, "sum"), "eager direct, 6 MiB")
        for i, ((name, _, count, dtype), (src, _)) in enumerate(zip(plan, bufs)):
            src.copy_(data(r, 100 * replay + i, src.numel(), dtype))
        if replay % 2:
            torch.cuda._sleep(int(1e6 * (r + 1)))  # ranks reach the graph at different times
        graph.replay()
        for i, ((name, algo, count, dtype), (src, out)) in enumerate(zip(plan, bufs)):
            case, what = 100 * replay + i, f"graph replay {replay}: {name} {algo} {dtype} count={count}"
            if name == "all_reduce":
                assert_same(src.cpu(), expected_reduce(n, case, count, dtype, "sum"), what)
            elif name == "all_gather":
                assert_same(out.cpu(), torch.cat([data(p, case, count, dtype) for p in range(n)]), what)
            else:
                want = expected_reduce(n, case, count, dtype, "sum", start=r * count)
                assert_same(out.cpu(), want, what)
    xelink.synchronize()


def check_data_parallel_training(world):
    dev = torch.device(world.device)
    compare_training(world, ("auto",) + FLAT["all_reduce"][:2], device=dev, steps=10)
    comm = _packaged(world)
    compare_training(comm, ("hierarchical",), device=dev, steps=10)
    xelink.synchronize(comm)
    comm.free()


def check_nccl_refuses_ranks_sharing_a_gpu_clearly(world):
    """The NCCL cases cannot run here: NCCL refuses two ranks of one GPU, and xelink says so first."""
    x = torch.ones(8, device=torch.device(world.device))
    try:
        xelink.all_reduce(x, algo="nccl")
    except xelink.XelinkError as e:
        assert "share GPU" in str(e) and "NCCL" in str(e), str(e)
    else:
        raise AssertionError("algo='nccl' ran with ranks sharing one GPU")

"""The CUDA topology-aware all-gather (``topo``) and hierarchical all-reduce on UNEVEN packages, with every
rank of the launch on GPU 0 (peer memory between processes of one device): 3 ranks as [[0, 1], [2]] and
[[0], [1, 2]], 4 ranks as [[0, 1, 2], [3]] and [[0, 1], [2], [3]]. Whole buffers, exact (small integers),
against torch.cat of the shards and the reduction computed on the host; sizes 1, odd and large; back-to-back
calls that change size and dtype with ranks delayed on the host and on the GPU (the staging buffer is
reused); calls cut in pieces (a small ``XELINK_GPU_SCRATCH``); a CUDA graph of both replayed with new
inputs; a rank that never arrives is named. The schedules themselves are also checked without a GPU
(``test_gpu_compose.py``). Skips without a GPU (CPU CI); run on a GPU machine, log committed."""
import os
import random
import time

import torch

import xelink
from collective_cases import assert_same, data, expected_reduce

WORLD_SIZES = (3, 4)
GPUS = 1
LAUNCH_TIMEOUT = 900
# The same environment as ranks_gpu_reuse.py, so that a session collecting both shares its launches.
ENV = {"XELINK_RANKS_PER_DEVICE": "4", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}

LAYOUTS = {3: ([[0, 1], [2]], [[0], [1, 2]]), 4: ([[0, 1, 2], [3]], [[0, 1], [2], [3]])}
SIZES = (1, 1023, 1 << 20)
DTYPES = (torch.float32, torch.bfloat16)


def _uneven(world, layout=0):
    comm = world.split(0)
    comm.packages = LAYOUTS[world.size][layout]
    return comm


def _gather(comm, case, count, dtype, **kw):
    dev = torch.device(comm.device)
    out = torch.full((comm.size * count,), 99, dtype=dtype, device=dev)
    work = xelink.all_gather_into_tensor(out, data(comm.rank, case, count, dtype).to(dev), group=comm, algo="topo",
                                         **kw)
    return out, work, torch.cat([data(p, case, count, dtype) for p in range(comm.size)])


def _reduce(comm, case, count, dtype, op="sum", **kw):
    x = data(comm.rank, case, count, dtype, op).to(torch.device(comm.device))
    work = xelink.all_reduce(x, op=op, group=comm, algo="hierarchical", **kw)
    return x, work, expected_reduce(comm.size, case, count, dtype, op)


def check_topo_uneven_packages(world):
    for layout in range(2):
        comm = _uneven(world, layout)
        case = 0
        for dtype in DTYPES:
            for count in SIZES:
                case += 1
                out, _, want = _gather(comm, case, count, dtype)
                assert_same(out.cpu(), want, f"topo {comm.packages} {dtype} count={count}")
        # in place (the input is this rank's block of the output), and asynchronous
        r, count = comm.rank, 4099
        out = torch.full((comm.size * count,), 99, dtype=torch.float32, device=torch.device(comm.device))
        out[r * count:(r + 1) * count] = data(r, 77, count, torch.float32).to(out.device)
        xelink.all_gather_into_tensor(out, out[r * count:(r + 1) * count], group=comm, algo="topo")
        assert_same(out.cpu(), torch.cat([data(p, 77, count, torch.float32) for p in range(comm.size)]),
                    f"topo in place {comm.packages}")
        out, work, want = _gather(comm, 78, 1001, torch.bfloat16, async_op=True)
        work.wait()
        assert_same(out.cpu(), want, f"topo async {comm.packages}")
        xelink.synchronize(comm)
        comm.free()


def check_hierarchical_uneven_packages(world):
    for layout in range(2):
        comm = _uneven(world, layout)
        case = 0
        for dtype in DTYPES:
            for count in SIZES:
                case += 1
                x, _, want = _reduce(comm, case, count, dtype)
                assert_same(x.cpu(), want, f"hierarchical {comm.packages} {dtype} count={count}")
            for op in ("avg", "max", "min", "prod"):
                case += 1
                x, _, want = _reduce(comm, case, 1023, dtype, op)
                assert_same(x.cpu(), want, f"hierarchical {comm.packages} {dtype} {op}")
        for dtype in (torch.float16, torch.int32, torch.int64, torch.float64):
            case += 1
            x, _, want = _reduce(comm, case, 4099, dtype)
            assert_same(x.cpu(), want, f"hierarchical {comm.packages} {dtype}")
        x, work, want = _reduce(comm, 99, 70001, torch.bfloat16, async_op=True)
        work.wait()
        assert_same(x.cpu(), want, f"hierarchical async {comm.packages}")
        xelink.synchronize(comm)
        comm.free()


def _delay(rank):
    pick = random.Random(rank)

    def delay():
        if pick.random() < 0.4:
            if pick.random() < 0.5:
                time.sleep(pick.uniform(0, 0.003))
            else:
                torch.cuda._sleep(int(pick.uniform(0, 0.003) * 2e9))  # the GPU spins ~2 GHz cycles
    return delay


def check_uneven_back_to_back_reusing_buffers(world):
    """Calls of both algorithms, sizes and dtypes changing every call, no host synchronization between
    them (results checked at the end): a fast rank's next call must not overwrite a staging buffer a
    slow rank still reads. Then the same with calls cut in pieces (``XELINK_GPU_SCRATCH`` of 1 MiB)."""
    comm = _uneven(world)
    draw, delay = random.Random(5), _delay(world.rank)
    counts = (1, 3, 1023, 4099, 65537, 1 << 20, 17)
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.int64)
    for phase in ("whole", "pieces"):
        if phase == "pieces":
            os.environ["XELINK_GPU_SCRATCH"] = str(1 << 20)  # every rank: the same piece size
        try:
            pending = []
            for case in range(200, 240):
                count, dtype = draw.choice(counts), draw.choice(dtypes)
                delay()
                if draw.random() < 0.5:
                    got, _, want = _gather(comm, case, count, dtype)
                    what = "topo"
                else:
                    op = draw.choice(("sum", "max") + (("avg",) if dtype.is_floating_point else ()))
                    got, _, want = _reduce(comm, case, count, dtype, op)
                    what = f"hierarchical {op}"
                pending.append((got, want, f"{phase} call {case}: {what} {dtype} count={count}"))
            for got, want, what in pending:
                assert_same(got.cpu(), want, what)
        finally:
            os.environ.pop("XELINK_GPU_SCRATCH", None)
    xelink.synchronize(comm)
    comm.free()


def check_uneven_cuda_graph_replays(world):
    """One graph holding a topo all-gather and a hierarchical all-reduce on uneven packages, captured after a
    warm-up call and replayed 3 times with new inputs (ranks arriving at different times)."""
    comm = _uneven(world)
    dev, n, r = torch.device(world.device), comm.size, comm.rank
    g_in = torch.zeros(1023, dtype=torch.float32, device=dev)
    g_out = torch.zeros(n * 1023, dtype=torch.float32, device=dev)
    x = torch.zeros(70001, dtype=torch.bfloat16, device=dev)

    def calls():
        xelink.all_gather_into_tensor(g_out, g_in, group=comm, algo="topo")
        xelink.all_reduce(x, group=comm, algo="hierarchical")

    calls()  # warm-up: peer memory, the staging buffer and the barrier kernel are ready before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    for replay in range(3):
        case = 300 + 2 * replay
        g_in.copy_(data(r, case, 1023, torch.float32).to(dev))
        x.copy_(data(r, case + 1, 70001, torch.bfloat16).to(dev))
        if replay % 2:
            torch.cuda._sleep(int(1e6 * (r + 1)))
        graph.replay()
        assert_same(g_out.cpu(), torch.cat([data(p, case, 1023, torch.float32) for p in range(n)]),
                    f"graph replay {replay}: topo")
        assert_same(x.cpu(), expected_reduce(n, case + 1, 70001, torch.bfloat16, "sum"),
                    f"graph replay {replay}: hierarchical")
    xelink.synchronize(comm)
    del graph
    comm.free()


def check_uneven_topo_names_a_rank_that_never_arrives(world):
    """The last rank skips a call: the others' device barriers give up at the deadline, and the host
    names that rank."""
    comm = _uneven(world)
    dev, last = torch.device(world.device), comm.size - 1
    inp = torch.ones(1024, device=dev)
    out = torch.empty(comm.size * 1024, device=dev)
    xelink.all_gather_into_tensor(out, inp, group=comm, algo="topo")  # every rank: set-up is collective
    torch.cuda.synchronize()
    if comm.rank != last:
        xelink.all_gather_into_tensor(out, inp, group=comm, algo="topo", timeout=2)
        try:
            xelink.synchronize(comm)
        except xelink.TimeoutError as e:
            assert last in e.missing, e.missing
        else:
            raise AssertionError(f"no TimeoutError after rank {last} skipped the all-gather")
    world.barrier()

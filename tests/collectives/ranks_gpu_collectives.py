"""GPU collectives on 2 GPUs (one rank each): every op x algorithm x dtype x size class, whole buffer, exact.

Data are small integers, exact in every dtype and summation order, so results must equal the
reference bit for bit (and NCCL's, which ``check_equal_to_nccl_every_size`` compares directly).
Skips on machines with fewer than 2 GPUs (CPU CI); run on a GPU machine, log committed.
"""
import os

import pytest
import torch

import xelink
from xelink.collectives import GPU_ALGORITHMS as ALGOS
from collective_cases import ddp_training

WORLD_SIZES = (2,)
# One rank per GPU; with XELINK_RANKS_PER_DEVICE=2 in the environment both ranks share one GPU (peer
# memory between processes of one device), and the checks against NCCL skip: NCCL refuses that.
SHARED = bool(os.environ.get("XELINK_RANKS_PER_DEVICE"))
GPUS = 1 if SHARED else 2
LAUNCH_TIMEOUT = 900
ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64, torch.float64)
OPS = ("sum", "avg", "max", "min", "prod")
# Size classes: empty, one element, odd tails, a vector-width boundary, one tile, many tiles, and
# more than one scratch piece would hold for small slots (aligned and not).
SIZES = (0, 1, 7, 8, 4095, 4096, 65537, 1 << 20, (1 << 22) + 3)
# The flat peer-memory algorithms that take any tensor (copy_engine all-reduce needs xelink.empty input:
# tested with symmetric tensors below).
PEER_ALGOS = {op: tuple(a for a in algos if a not in ("nccl", "hierarchical", "topo")
                        and (op, a) != ("all_reduce", "copy_engine")) for op, algos in ALGOS.items()}


def _data(rank, n, dtype, device, op="sum", salt=0):
    g = torch.Generator().manual_seed(1000 * rank + 7 * n + salt)
    lo, hi = (1, 3) if op == "prod" else (-8, 9)
    x = torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64)
    if op == "prod":
        x = torch.where(torch.rand(n, generator=g) < 0.5, x, -x)
    return x.to(dtype).to(device)


def _reduce(parts, op, dtype):
    acc = torch.stack([p.double().cpu() for p in parts])
    if op in ("sum", "avg"):
        out = acc.sum(0)
        if op == "avg":
            out = out / len(parts)
    elif op == "max":
        out = acc.max(0).values
    elif op == "min":
        out = acc.min(0).values
    else:
        out = acc.prod(0)
    return out.to(dtype)


def _same(fn, got, want):
    got = got.cpu()
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        i = int(bad[0]) if bad.numel() else -1
        raise AssertionError(f"{fn}: {bad.numel()} of {want.numel()} elements differ; first at {i}: "
                             f"got {got.view(-1)[i].item()} want {want.view(-1)[i].item()}")


def _dev(world):
    return torch.device(world.device)


def _sizes(dtype):
    return SIZES if dtype in (torch.bfloat16, torch.float32) else SIZES[:7]


def check_all_reduce_every_algo_dtype_op_size(world):
    dev = _dev(world)
    for dtype in DTYPES:
        for op in OPS:
            if op == "avg" and not dtype.is_floating_point:
                continue
            for n in _sizes(dtype) if op == "sum" else (1, 4099):
                want = _reduce([_data(r, n, dtype, "cpu", op) for r in range(world.size)], op, dtype)
                for algo in PEER_ALGOS["all_reduce"] + ("auto",):
                    x = _data(world.rank, n, dtype, dev, op)
                    xelink.all_reduce(x, op=op, algo=algo)
                    _same(f"all_reduce {algo} {dtype} {op} n={n}", x, want)


def check_all_gather_reduce_scatter_all_to_all(world):
    dev, w = _dev(world), world.size
    for dtype in DTYPES:
        for n in _sizes(dtype):
            shards = [_data(r, n, dtype, "cpu") for r in range(w)]
            for algo in PEER_ALGOS["all_gather"] + ("auto",):
                out = torch.full((w * n,), 99, dtype=dtype, device=dev)
                xelink.all_gather_into_tensor(out, shards[world.rank].to(dev), algo=algo)
                _same(f"all_gather {algo} {dtype} n={n}", out, torch.cat(shards))
            full = [_data(r, w * n, dtype, "cpu") for r in range(w)]
            for op in ("sum", "max") if n > 1 else OPS:
                if op == "avg" and not dtype.is_floating_point:
                    continue
                want = _reduce([f[world.rank * n:(world.rank + 1) * n] for f in full], op, dtype)
                for algo in PEER_ALGOS["reduce_scatter"] + ("auto",):
                    out = torch.full((n,), 99, dtype=dtype, device=dev)
                    xelink.reduce_scatter_tensor(out, full[world.rank].to(dev), op=op, algo=algo)
                    _same(f"reduce_scatter {algo} {dtype} {op} n={n}", out, want)
            want = torch.cat([full[p][world.rank * n:(world.rank + 1) * n] for p in range(w)])
            for algo in PEER_ALGOS["all_to_all"] + ("auto",):
                out = torch.full((w * n,), 99, dtype=dtype, device=dev)
                xelink.all_to_all_single(out, full[world.rank].to(dev), algo=algo)
                _same(f"all_to_all {algo} {dtype} n={n}", out, want)


def check_symmetric_tensors_take_the_zero_copy_path(world):
    dev, w = _dev(world), world.size
    for n in (1, 4097, 1 << 20):
        want = _reduce([_data(r, n, torch.bfloat16, "cpu") for r in range(w)], "sum", torch.bfloat16)
        for algo in ("two_shot", "direct", "copy_engine"):
            x = xelink.empty(n, dtype=torch.bfloat16)
            assert world.resource("cuda.team").peer_addresses(x) is not None, "xelink.empty tensor is not registered"
            x.copy_(_data(world.rank, n, torch.bfloat16, dev))
            xelink.all_reduce(x, algo=algo)
            _same(f"all_reduce {algo} symmetric n={n}", x, want)
        inp = xelink.empty(n, dtype=torch.float32)
        inp.copy_(_data(world.rank, n, torch.float32, dev))
        shards = [_data(r, n, torch.float32, "cpu") for r in range(w)]
        for algo in ("direct", "copy_engine"):
            out = torch.zeros(w * n, dtype=torch.float32, device=dev)
            xelink.all_gather_into_tensor(out, inp, algo=algo)
            _same(f"all_gather {algo} symmetric n={n}", out, torch.cat(shards))
        full = xelink.empty(w * n, dtype=torch.float32)
        full.copy_(_data(world.rank, w * n, torch.float32, dev))
        fulls = [_data(r, w * n, torch.float32, "cpu") for r in range(w)]
        out = torch.zeros(n, dtype=torch.float32, device=dev)
        xelink.reduce_scatter_tensor(out, full, algo="direct")
        _same(f"reduce_scatter symmetric n={n}", out,
              _reduce([f[world.rank * n:(world.rank + 1) * n] for f in fulls], "sum", torch.float32))
        out = torch.zeros(w * n, dtype=torch.float32, device=dev)
        xelink.all_to_all_single(out, full, algo="direct")
        _same(f"all_to_all symmetric n={n}", out,
              torch.cat([fulls[p][world.rank * n:(world.rank + 1) * n] for p in range(w)]))


def check_equal_to_nccl_every_size(world):
    """Whole-buffer results equal NCCL's, 1 element to 256 MiB (bf16), every xelink all-reduce path."""
    if SHARED:
        pytest.skip("NCCL refuses two ranks of one GPU (XELINK_RANKS_PER_DEVICE is set)")
    dev = _dev(world)
    n = 1
    while n * 2 <= 128 << 20:
        for m in {n, n + 1, 3 * n // 2 + 1}:
            x = _data(world.rank, m, torch.bfloat16, dev)
            ref = x.clone()
            xelink.all_reduce(ref, algo="nccl")
            for algo in ("direct", "two_shot"):
                y = x.clone()
                xelink.all_reduce(y, algo=algo)
                _same(f"all_reduce {algo} vs nccl n={m}", y, ref.cpu())
            s = xelink.empty(m, dtype=torch.bfloat16)
            s.copy_(x)
            xelink.all_reduce(s, algo="copy_engine")
            _same(f"all_reduce copy_engine (symmetric) vs nccl n={m}", s, ref.cpu())
        n *= 4


def check_stream_semantics_and_async(world):
    dev = _dev(world)
    n = 1 << 16
    want = _reduce([_data(r, n, torch.float32, "cpu") for r in range(world.size)], "sum", torch.float32)
    side = torch.cuda.Stream(dev)
    x = _data(world.rank, n, torch.float32, dev)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        work = xelink.all_reduce(x, algo="two_shot", async_op=True)
    assert isinstance(work, xelink.collectives.GpuWork), type(work)
    work.wait()  # the current stream now waits for the side stream's all-reduce
    y = x * 1
    _same("all_reduce async on a side stream", y, want)
    # torch's Work protocol on a CUDA handle: the future (CUDA-aware) holds the reduced tensor itself, ready on
    # the stream that waits on it; a then() callback reads it as DDP's hooks do
    x = _data(world.rank, n, torch.float32, dev)
    with torch.cuda.stream(side):
        work = xelink.all_reduce(x, algo="two_shot", async_op=True)
    future = work.get_future()
    got = future.wait()
    assert isinstance(work, xelink.Work) and len(got) == 1 and got[0] is x and work.result()[0] is x
    _same("all_reduce async, the future's value", got[0] * 1, want)
    half = xelink.all_reduce(_data(world.rank, n, torch.float32, dev), async_op=True).get_future().then(
        lambda f: f.value()[0] / 2)
    _same("all_reduce async, a then() callback", half.wait() * 2, want)
    assert work.synchronize() is None and work.exception() is None and work.is_completed()


def check_tensors_that_require_grad_are_moved_by_their_data(world):
    # As torch.distributed: a leaf that requires grad is reduced in place (no autograd record), every
    # peer-memory algorithm; the communicator stays usable.
    dev, n = _dev(world), 4099
    want = _reduce([_data(r, n, torch.float32, "cpu") for r in range(world.size)], "sum", torch.float32)
    for algo in PEER_ALGOS["all_reduce"]:
        x = _data(world.rank, n, torch.float32, dev).requires_grad_()
        xelink.all_reduce(x, algo=algo)
        assert x.requires_grad and x.grad_fn is None, algo
        _same(f"all_reduce {algo} of a leaf that requires grad", x.detach(), want)
    out = torch.zeros(world.size * n, device=dev, requires_grad=True)
    xelink.all_gather_into_tensor(out, _data(world.rank, n, torch.float32, dev).requires_grad_())
    _same("all_gather of tensors that require grad", out.detach(),
          torch.cat([_data(r, n, torch.float32, "cpu") for r in range(world.size)]))


def check_rooted_ops_on_cuda_tensors(world):
    """broadcast, reduce, gather and scatter of CUDA tensors from every root, bit for bit, across sizes past
    the peer inbox (4 MiB) and an odd tail; eager and async; the result visible to the next kernel on the
    current stream without a host synchronization."""
    dev, n, r = _dev(world), world.size, world.rank
    for count in (1, 4099, (5 << 20) // 4 + 3):
        for root in range(n):
            x = _data(r, count, torch.float32, dev, salt=root)
            xelink.broadcast(x, root)
            _same(f"broadcast from {root} count={count}", x * 1, _data(root, count, torch.float32, "cpu", salt=root))
            x = _data(r, count, torch.int32, dev, salt=root)
            work = xelink.reduce(x, root, op="max", async_op=True)
            work.wait()
            want = _data(r, count, torch.int32, "cpu", salt=root)  # other ranks keep theirs
            if r == root:
                want = _reduce([_data(p, count, torch.int32, "cpu", salt=root) for p in range(n)], "max", torch.int32)
            _same(f"reduce to {root} count={count}", x + 0, want)
            outs = [torch.full((count,), -1.0, device=dev) for _ in range(n)] if r == root else None
            xelink.gather(_data(r, count, torch.float32, dev, salt=7), outs, dst=root)
            if r == root:
                for p in range(n):
                    _same(f"gather to {root} from {p}", outs[p] * 1, _data(p, count, torch.float32, "cpu", salt=7))
            ins = [_data(p, count, torch.bfloat16, dev, salt=9) for p in range(n)] if r == root else None
            got = torch.zeros(count, dtype=torch.bfloat16, device=dev)
            xelink.scatter(got, ins, src=root)
            _same(f"scatter from {root}", got * 1, _data(r, count, torch.bfloat16, "cpu", salt=9))


def check_inputs_that_share_memory_with_outputs_are_read_first(world):
    """CUDA tensors whose input shares memory with the output, on every peer algorithm: the input this rank's or
    another rank's block of the output (all_gather), the output a block of the input (reduce_scatter),
    all_to_all_single in place and shifted, a root's output one of its list entries (scatter) and its input one of
    its list entries (gather): each as if the input had been copied first."""
    dev, w, r = _dev(world), world.size, world.rank
    for n in (1, 4099, 65537):
        def block(q, k):
            return _data(q, n, torch.float32, "cpu", salt=k)

        for j in (r, (r + 1) % w):
            for algo in PEER_ALGOS["all_gather"] + ("auto",):
                out = torch.full((w * n,), -1.0, device=dev)
                out[j * n:(j + 1) * n] = block(r, 0).to(dev)
                xelink.all_gather_into_tensor(out, out[j * n:(j + 1) * n], algo=algo)
                _same(f"all_gather {algo} from block {j} n={n}", out, torch.cat([block(q, 0) for q in range(w)]))
            for algo in PEER_ALGOS["reduce_scatter"] + ("auto",):
                inp = torch.cat([block(r, k) for k in range(w)]).to(dev)
                xelink.reduce_scatter_tensor(inp[j * n:(j + 1) * n], inp, algo=algo)
                _same(f"reduce_scatter {algo} into block {j} n={n}", inp[j * n:(j + 1) * n],
                      _reduce([block(q, r) for q in range(w)], "sum", torch.float32))
        for shift in (0, n // 2 + 1):
            for algo in PEER_ALGOS["all_to_all"] + ("auto",):
                buf = torch.zeros(w * n + shift, device=dev)
                buf[:w * n] = torch.cat([block(r, k) for k in range(w)]).to(dev)
                out = buf[shift:shift + w * n]
                xelink.all_to_all_single(out, buf[:w * n], algo=algo)
                _same(f"all_to_all {algo} +{shift} n={n}", out, torch.cat([block(q, r) for q in range(w)]))
        for entry in (0, 1):
            lst = [block(0, k).to(dev) for k in range(w)] if r == 0 else None
            out = lst[entry] if r == 0 else torch.zeros(n, device=dev)
            xelink.scatter(out, lst, src=0)
            _same(f"scatter into the root's entry {entry} n={n}", out * 1, block(0, r))
            lst = [torch.full((n,), -1.0, device=dev) for _ in range(w)] if r == 0 else None
            inp = lst[entry] if r == 0 else block(r, 0).to(dev)
            inp.copy_(block(r, 0).to(dev))
            xelink.gather(inp, lst, dst=0)
            if r == 0:
                _same(f"gather from the root's entry {entry} n={n}", torch.cat(lst), torch.cat([block(q, 0)
                                                                                             for q in range(w)]))


def check_ddp_style_training_on_cuda(world):
    # The CPU ranks' real client on CUDA tensors: parameters broadcast (the rooted ops), gradients all-reduced
    # after backward, then in backward (each as its gradient is ready, the step reading the handles' futures).
    ddp_training(world, _dev(world), tol=1e-4)
    ddp_training(world, _dev(world), tol=1e-4, hooks=True)


def check_cuda_graph_replays(world):
    dev = _dev(world)
    for algo, n in (("direct", 4096), ("two_shot", 1 << 18), ("direct", 1 << 16)):
        x = torch.empty(n, dtype=torch.bfloat16, device=dev)
        x.copy_(_data(world.rank, n, torch.bfloat16, dev))
        xelink.all_reduce(x, algo=algo)  # warm-up: sets up peer memory and compiles
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(3):
                xelink.all_reduce(x, algo=algo)
        for salt in range(4):
            start = _data(world.rank, n, torch.bfloat16, dev, salt=salt)
            x.copy_(start)
            g.replay()
            parts = [_data(r, n, torch.bfloat16, "cpu", salt=salt) for r in range(world.size)]
            want = _reduce(parts, "sum", torch.float64) * world.size ** 2
            _same(f"graph {algo} n={n} replay {salt}", x, want.to(torch.bfloat16))


def check_torch_compile(world):
    dev = _dev(world)
    n = 4096

    @torch.compile(fullgraph=True)
    def step(x):
        y = x * 2
        xelink.all_reduce(y, algo="direct")
        return y + 1

    x = _data(world.rank, n, torch.float32, dev)
    want = _reduce([_data(r, n, torch.float32, "cpu") * 2 for r in range(world.size)], "sum", torch.float32) + 1
    _same("torch.compile all_reduce", step(x), want)


def check_device_barrier_orders_peer_writes(world):
    for _ in range(3):
        xelink.device_barrier()
    xelink.synchronize()


def check_bad_arguments(world):
    dev = _dev(world)
    x = torch.ones(8, device=dev)
    cases = [
        (lambda: xelink.all_reduce(x, algo="ring"), ValueError, "algo='ring'"),
        (lambda: xelink.all_reduce(torch.ones(4, 4, device=dev).t(), algo="direct"), ValueError, "contiguous"),
        (lambda: xelink.all_reduce(torch.ones(4, dtype=torch.bool, device=dev)), TypeError, "dtype"),
        (lambda: xelink.all_reduce(torch.ones(4, dtype=torch.int32, device=dev), op="avg"), TypeError, "avg"),
        (lambda: xelink.all_gather_into_tensor(torch.ones(5, device=dev), x), ValueError, "output.numel()=5"),
        (lambda: xelink.reduce_scatter_tensor(torch.ones(8, device=dev), x), ValueError, "input.numel()=8"),
        (lambda: xelink.all_gather_into_tensor(torch.ones(16, device=dev, dtype=torch.half), x), TypeError,
         "output.dtype"),
        (lambda: xelink.all_to_all_single(torch.ones(7, device=dev), torch.ones(7, device=dev)), ValueError,
         "divisible"),
        # split sizes (NCCL's path) checked before any byte moves, as on CPU ranks
        (lambda: xelink.all_to_all_single(torch.ones(8, device=dev), x, [8] + [0] * (world.size - 1), [1] * 8),
         ValueError, "input_split_sizes=[1, 1, 1, 1, 1, 1, 1, 1] must be"),
        (lambda: xelink.all_to_all_single(torch.ones(8, device=dev), x, [9] + [0] * (world.size - 1)), ValueError,
         "sum(output_split_sizes)=9 != dim 0"),
        (lambda: xelink.all_to_all_single(torch.ones(8, 2, device=dev), x.view(8, 1), [8] + [0] * (world.size - 1),
                                          [8] + [0] * (world.size - 1)), ValueError, "trailing dims differ"),
        (lambda: xelink.all_to_all_single(x, x, [8] + [0] * (world.size - 1), algo="direct"), ValueError,
         "run on NCCL only"),
        (lambda: xelink.all_reduce(x, algo="copy_engine"), ValueError, "xelink.empty"),
        (lambda: xelink.recv(x, None), ValueError, "recv: src=None (any source) needs a CPU tensor"),
        (lambda: xelink.all_reduce(torch.ones(4, dtype=torch.int32, device=dev), op="bor"), ValueError,
         "op='bor' runs on CPU ranks only"),
    ]
    for call, exc, text in cases:
        try:
            call()
        except exc as e:
            assert text in str(e), f"message {e!r} lacks {text!r}"
        else:
            raise AssertionError(f"no {exc.__name__} for the case expecting {text!r}")


def check_a_rank_that_stops_answering_is_named(world):
    """Rank 1 skips the call: rank 0's kernel gives up at the deadline, and the host names rank 1."""
    comm = world.split(0)
    dev = _dev(world)
    x = torch.ones(1024, device=dev)
    xelink.all_reduce(x, group=comm, algo="direct")  # both ranks: peer memory is set up
    torch.cuda.synchronize()
    if world.rank == 0:
        xelink.all_reduce(x, group=comm, algo="direct", timeout=2)
        try:
            xelink.synchronize(comm)
        except xelink.TimeoutError as e:
            assert e.missing == [1], e.missing
        else:
            raise AssertionError("no TimeoutError after rank 1 skipped the all-reduce")
        try:
            xelink.all_reduce(x, group=comm, algo="direct")
        except xelink.XelinkError:
            pass
        else:
            raise AssertionError("a communicator that timed out accepted another call")
    world.barrier()

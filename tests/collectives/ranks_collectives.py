"""Every collective x algorithm x dtype, whole buffer, exact, at world sizes 1-8 and package layouts."""
import datetime
import math
import re
import time
import numpy as np
import pytest
import torch
import torch.distributed

import xelink
from ranks import only
from collective_cases import DTYPES, assert_same, ddp_training, run_all, run_all_to_all, run_rooted

WORLD_SIZES = (1, 2, 3, 4, 5, 6, 8)
LAUNCH_TIMEOUT = 600

# Package layouts that fit each world size: flat (one package), even, and uneven.
LAYOUTS = {
    2: [[[0], [1]]],
    3: [[[0, 1], [2]]],
    4: [[[0, 1], [2, 3]]],
    5: [[[0, 1, 2], [3, 4]]],
    6: [[[0, 1], [2, 3], [4, 5]], [[0, 1, 2], [3, 4, 5]]],
    8: [[[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 1, 2, 3], [4, 5, 6, 7]]],
}


def _with_layout(world, packages):
    sub = world.split(0)
    sub.packages = packages
    return sub


# Above 4 ranks (more ranks than the CI machine has cores, 4x over at 8) every algorithm still runs
# on every dtype with op "sum", but sizes 0 and 1 and the other ops run on a subset of dtypes, so
# that CI stays short.
SMALL_GRID_DTYPES = (torch.float32, torch.bfloat16, torch.int64)
LARGE_DTYPES = (torch.float32, torch.bfloat16)


def check_flat_small_sizes(world):
    odd = 2 * world.size + 1
    if world.size <= 4:
        run_all(world, [0, 1, odd], tag="flat")
        return
    run_all(world, [0, 1], dtypes=(torch.float32, torch.int64), ops=("sum",), tag="flat tiny")
    run_all(world, [odd], ops=("sum",), tag="flat")
    run_all(world, [odd], dtypes=SMALL_GRID_DTYPES, tag="flat all ops")


def check_package_layouts(world):
    """The layout-dependent algorithms (and auto) on every layout that fits, uneven ones included."""
    for packages in LAYOUTS.get(world.size, []):
        sub = _with_layout(world, packages)
        run_all(sub, [1, 3 * world.size + 2], algos=("auto", "hierarchical", "topo"), tag=f"layout {packages}",
                dtypes=SMALL_GRID_DTYPES if world.size > 4 else DTYPES)
        sub.free()


def check_large_messages(world):
    """>= 1 M elements for every algorithm (float32, and bfloat16 reduced in float32); flat and layered."""
    layouts = [None] + LAYOUTS.get(world.size, [])[:1]
    for packages in layouts:
        comm = world if packages is None else _with_layout(world, packages)
        run_all(comm, [(1 << 20) + 3], dtypes=LARGE_DTYPES, ops=("sum",), tag=f"large {packages}", inplace=False,
                algos=None if packages is None else ("hierarchical", "topo"))
        if packages is not None:
            comm.free()


def check_all_to_all_and_rooted(world):
    run_all_to_all(world)
    run_rooted(world)


def check_small_integers_and_bool(world):
    # The dtypes CPU ranks reduce beyond the GPU's, as gloo: int16, int8 and uint8 wrap, bool is or / and.
    small = (torch.int16, torch.int8, torch.uint8, torch.bool)
    run_all(world, [1009 + 5], dtypes=small, ops=("sum", "max", "min", "prod"), tag="small")
    done = torch.tensor([world.rank == 0])  # the usual use: did any rank finish?
    xelink.all_reduce(done, op="max")
    assert done.item()


def check_rank_size_and_object_collectives(world):
    # torch.distributed's names: get_rank / get_world_size (-1 off the group), the object collectives.
    n, r = world.size, world.rank
    assert (xelink.get_rank(), xelink.get_world_size()) == (r, n)
    evens = xelink.new_group(list(range(0, n, 2)))
    if r % 2 == 0:
        assert (xelink.get_rank(evens), xelink.get_world_size(evens)) == (r // 2, (n + 1) // 2)
    else:
        assert (xelink.get_rank(evens), xelink.get_world_size(evens)) == (-1, -1)
    got = [None] * n
    xelink.all_gather_object(got, {"rank": r, "tag": "x" * r})
    assert got == [{"rank": p, "tag": "x" * p} for p in range(n)]
    src = n - 1
    objs = [r, {"seed": 1234 + r}, None] if r == src else ["stale", 0, 0]
    xelink.broadcast_object_list(objs, src=src)
    assert objs == [src, {"seed": 1234 + src}, None]
    with pytest.raises(ValueError, match=rf"all_gather_object: object_list must be a list of world_size={n} entries, "
                                         rf"got {n + 1}"):
        xelink.all_gather_object([None] * (n + 1), r)
    with pytest.raises(ValueError, match=rf"broadcast_object_list: src={n} is out of range"):
        xelink.broadcast_object_list([1], src=n)
    if evens:
        evens.free()


def check_list_forms_and_object_scatter_gather(world):
    """torch.distributed's list forms (reduce_scatter, all_to_all with sizes that differ per pair, blocking and
    async) and gather_object / scatter_object_list; bad lists refused by name; gather / scatter given an empty list
    off the root, as torch code passes it (``[...] if rank == 0 else []``)."""
    n, r = world.size, world.rank
    got = [torch.empty(2) for _ in range(n)] if r == 0 else []
    xelink.gather(torch.full((2,), float(r)), got, dst=0)
    assert r or all(torch.equal(t, torch.full((2,), float(p))) for p, t in enumerate(got)), got
    mine = torch.empty(2)
    xelink.scatter(mine, [torch.full((2,), 5.0 * p) for p in range(n)] if r == 0 else [], src=0)
    assert torch.equal(mine, torch.full((2,), 5.0 * r)), mine
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        out = torch.empty(3, 2, dtype=dtype)
        xelink.reduce_scatter(out, [torch.full((3, 2), 10 * r + j, dtype=dtype) for j in range(n)])
        assert torch.equal(out, torch.full((3, 2), sum(10 * p + r for p in range(n)), dtype=dtype)), (dtype, out)
    out = torch.empty(4)
    h = xelink.reduce_scatter(out, [torch.arange(4.0) + r * j for j in range(n)], op="max", async_op=True)
    h.wait()
    assert torch.equal(out, torch.arange(4.0) + (n - 1) * r), out
    for async_op in (False, True):
        for even in (False, True):
            size = (lambda i, j: 3) if even else (lambda i, j: i + 2 * j + 1)  # rank i sends rank j size(i, j)
            ins = [torch.full((size(r, j),), 100.0 * r + j) for j in range(n)]
            outs = [torch.full((size(i, r),), -1.0) for i in range(n)]
            h = xelink.all_to_all(outs, ins, async_op=async_op)
            if async_op:
                while not h.is_completed():
                    pass
                h.wait()
            for i, t in enumerate(outs):
                assert torch.equal(t, torch.full((size(i, r),), 100.0 * i + r)), (async_op, even, i, t)
    grid = [torch.full((2, 3), float(r * n + j)) for j in range(n)]
    got = [torch.empty(2, 3) for _ in range(n)]
    xelink.all_to_all(got, grid)
    assert all(torch.equal(t, torch.full((2, 3), float(i * n + r))) for i, t in enumerate(got))
    dst = n - 1
    gathered = [None] * n if r == dst else None
    xelink.gather_object({"from": r}, gathered, dst=dst)
    assert gathered is None or gathered == [{"from": p} for p in range(n)]
    mine = [None]
    xelink.scatter_object_list(mine, [("for", j) for j in range(n)] if r == 0 else None, src=0)
    assert mine == [("for", r)], mine
    with pytest.raises(ValueError, match=rf"scatter_object_list: the root's \(group_src=0\) scatter_object_input_list "
                                         rf"must be a list of world_size={n} entries, got {n + 1} entries"):
        xelink.scatter_object_list(mine, [0] * (n + 1), src=0)
    with pytest.raises(ValueError, match=rf"all_to_all: output_tensor_list must be a list of world_size={n} tensors"):
        xelink.all_to_all([torch.empty(1)] * (n + 1), [torch.empty(1)] * n)
    with pytest.raises(ValueError, match=r"reduce_scatter: input_list\[0\] has 5 x torch.float32 on cpu, expected 4 x"):
        xelink.reduce_scatter(torch.empty(4), [torch.empty(5)] * n)
    with pytest.raises(ValueError, match=r"gather_object: object_gather_list must be a list of world_size"):
        xelink.gather_object(1, [None], dst=r) if n > 1 else xelink.gather_object(1, [], dst=r)


def check_ddp_style_training_matches_one_process(world):
    ddp_training(world, "cpu")
    ddp_training(world, "cpu", hooks=True)  # the all-reduces started in backward, read from their futures


def check_numpy_inputs(world):
    n, r = world.size, world.rank
    x = np.full(10, r + 1, dtype=np.float32)
    xelink.all_reduce(x)
    assert (x == n * (n + 1) / 2).all()
    out = np.empty(3 * n, dtype=np.int32)
    xelink.all_gather_into_tensor(out, np.full(3, r, dtype=np.int32))
    assert (out == np.repeat(np.arange(n), 3)).all()
    # the in-place forms torch allows, on numpy arrays (the output this rank's block of the input): a view of a
    # numpy array wrapped as a tensor has a storage of its own, so dest_split (auto's choice for small calls) took
    # the block for separate memory and wrote the sum over it while it still read it (rank 2 up: wrong sums)
    m = 4
    for algo in ("auto", *xelink.collectives.registry.names("cpu")["reduce_scatter"]):
        for op in ("sum", "max"):
            a = np.arange(n * m, dtype=np.float32) + 100 * r
            mine = a[r * m:(r + 1) * m]
            xelink.reduce_scatter_tensor(mine, a, op=op, algo=algo)
            base = np.arange(r * m, (r + 1) * m, dtype=np.float32)
            want = n * base + 100 * n * (n - 1) / 2 if op == "sum" else base + 100 * (n - 1)
            assert np.array_equal(mine, want), (algo, op, mine, want)


def check_tensors_that_require_grad_are_moved_by_their_data(world):
    """As torch.distributed's collectives: a leaf that requires grad is written in place (no autograd record,
    requires_grad kept), a non-leaf keeps its grad_fn; the communicator stays usable (the leaf's in-place
    write used to fail mid-call and break it)."""
    n, r = world.size, world.rank
    leaf = torch.full((5,), float(r + 1), requires_grad=True)
    xelink.all_reduce(leaf)
    assert leaf.requires_grad and leaf.grad_fn is None and torch.equal(leaf.detach(), torch.full((5,), n * (n + 1) / 2))
    for algo in xelink.collectives.ALGORITHMS["all_reduce"]:
        x = (torch.full((3,), float(r)) + torch.zeros(3, requires_grad=True))  # a non-leaf
        xelink.all_reduce(x, algo=algo)
        assert x.grad_fn is not None and torch.equal(x.detach(), torch.full((3,), n * (n - 1) / 2)), algo
    out = torch.zeros(2 * n, requires_grad=True)
    xelink.all_gather_into_tensor(out, torch.full((2,), float(r), requires_grad=True))
    assert torch.equal(out.detach(), torch.arange(n).float().repeat_interleave(2))
    mine = torch.zeros(2, requires_grad=True)
    xelink.reduce_scatter_tensor(mine, torch.ones(2 * n, requires_grad=True))
    assert torch.equal(mine.detach(), torch.full((2,), float(n)))
    b = torch.full((4,), float(r), requires_grad=True)
    xelink.broadcast(b, 0)
    assert torch.equal(b.detach(), torch.zeros(4))
    if n > 1:
        got = torch.zeros(3, requires_grad=True)
        ops = [xelink.P2POp(xelink.isend, torch.full((3,), float(r), requires_grad=True), (r + 1) % n),
               xelink.P2POp(xelink.irecv, got, (r - 1) % n)]
        for h in xelink.batch_isend_irecv(ops):
            h.wait()
        assert torch.equal(got.detach(), torch.full((3,), float((r - 1) % n)))
    world.barrier()


def check_async_handles_keep_order(world):
    n = world.size
    xs = [torch.full((1000,), float(world.rank + i)) for i in range(5)]
    works = [xelink.all_reduce(x, async_op=True, algo="ring") for x in xs]
    y = torch.ones(10)
    xelink.all_reduce(y)  # a synchronous call queues behind the asynchronous ones
    for i, (x, w) in enumerate(zip(xs, works)):
        assert w.wait() and w.is_completed()
        assert torch.equal(x, torch.full((1000,), float(n * (n - 1) / 2 + n * i)))
    assert torch.equal(y, torch.full((10,), float(n)))
    w = xelink.barrier(async_op=True)
    w.wait()


def check_work_protocol(world):
    """Every async_op=True handle has torch.distributed's Work protocol: result() and its future's value are the
    objects the call wrote (the same objects, numpy arrays too), exception() None and synchronize() once done, the
    future's then() chains as DDP's hooks do; wait() takes a timedelta and refuses a bad timeout by name."""
    n, r = world.size, world.rank
    x = torch.full((4,), float(r + 1))
    total = float(n * (n + 1) // 2)
    outs = {"all_reduce": x.clone(), "all_gather_into_tensor": torch.empty(4 * n),
            "all_gather": [torch.empty(4) for _ in range(n)], "reduce_scatter_tensor": torch.empty(4),
            "reduce_scatter": torch.empty(4), "all_to_all_single": torch.empty(4 * n),
            "all_to_all": [torch.empty(4) for _ in range(n)], "broadcast": x.clone(), "reduce": x.clone(),
            "gather": [torch.empty(4) for _ in range(n)] if r == 0 else None, "scatter": torch.empty(4),
            "numpy": np.full(4, r + 1.0, dtype=np.float32)}
    calls = {
        "all_reduce": lambda o: xelink.all_reduce(o, async_op=True),
        "all_gather_into_tensor": lambda o: xelink.all_gather_into_tensor(o, x, async_op=True),
        "all_gather": lambda o: xelink.all_gather(o, x, async_op=True),
        "reduce_scatter_tensor": lambda o: xelink.reduce_scatter_tensor(o, x.repeat(n), async_op=True),
        "reduce_scatter": lambda o: xelink.reduce_scatter(o, [x] * n, async_op=True),
        "all_to_all_single": lambda o: xelink.all_to_all_single(o, x.repeat(n), async_op=True),
        "all_to_all": lambda o: xelink.all_to_all(o, [x] * n, async_op=True),
        "broadcast": lambda o: xelink.broadcast(o, src=0, async_op=True),
        "reduce": lambda o: xelink.reduce(o, dst=0, async_op=True),
        "gather": lambda o: xelink.gather(x, o, dst=0, async_op=True),
        "scatter": lambda o: xelink.scatter(o, [x * (q + 1) for q in range(n)] if r == 0 else None, src=0,
                                            async_op=True),
        "numpy": lambda o: xelink.all_reduce(o, async_op=True),
    }
    for name, call in calls.items():
        out = outs[name]
        work = call(out)
        want = out if isinstance(out, list) else [] if out is None else [out]
        value = work.get_future().wait()
        assert isinstance(work, xelink.Work) and work.is_completed(), name
        for got in (value, work.result()):
            assert len(got) == len(want) and all(a is b for a, b in zip(got, want)), (name, got)
        assert work.exception() is None and work.synchronize() is None and work.wait() is True, name
    full = torch.arange(n, dtype=torch.float32).add(1).repeat_interleave(4)
    assert torch.equal(outs["all_reduce"], torch.full((4,), total))
    assert torch.equal(outs["all_gather_into_tensor"], full)
    assert torch.equal(torch.cat(outs["all_gather"]), full) and torch.equal(torch.cat(outs["all_to_all"]), full)
    for name in ("reduce_scatter", "reduce_scatter_tensor"):
        assert torch.equal(outs[name], torch.full((4,), total)), name
    assert torch.equal(outs["all_to_all_single"], full) and torch.equal(outs["broadcast"], torch.ones(4))
    assert torch.equal(outs["scatter"], torch.full((4,), float(r + 1)))
    assert np.array_equal(outs["numpy"], np.full(4, total, dtype=np.float32))
    # DDP's allreduce hook: the mean, computed by a callback on the future
    mean = xelink.all_reduce(x.clone(), async_op=True).get_future().then(lambda f: f.value()[0] / n)
    assert torch.allclose(mean.wait(), torch.full((4,), total / n))
    futures = [xelink.all_reduce(torch.full((2,), float(i)), async_op=True).get_future() for i in range(3)]
    assert [float(v[0][0]) for v in torch.futures.wait_all(futures)] == [0.0, n, 2.0 * n]
    work = xelink.all_reduce(x.clone(), async_op=True)
    assert work.wait(timeout=datetime.timedelta(seconds=60)) is True
    for bad, kind in ((-1, ValueError), ("soon", TypeError)):
        with pytest.raises(kind, match=rf"Work.wait of all_reduce: timeout={bad!r} must be a"):
            work.wait(timeout=bad)
    if n > 1:  # a receive's future holds the receive buffer; a send's holds nothing
        got = torch.empty(3)
        works = [xelink.irecv(got, (r - 1) % n), xelink.isend(torch.full((3,), float(r)), (r + 1) % n)]
        values = [w.get_future().wait() for w in works]
        assert values[0][0] is got and values[1] == [] and torch.equal(got, torch.full((3,), float((r - 1) % n)))
    world.barrier()


@only(sizes=(2, 4))
def check_torch_ddp_with_an_xelink_comm_hook_matches_one_process(world):
    """torch's DistributedDataParallel (over the world's torch group) with a communication hook that all-reduces
    each gradient bucket with xelink and hands DDP the handle's future, as DDP's allreduce hook does with
    torch.distributed: 5 SGD steps on each rank's rows of every batch equal one process's on the whole batches."""
    import copy

    from collective_cases import mlp

    n, r = world.size, world.rank
    model = mlp((8, 16, 4), torch.Generator().manual_seed(1), 0.5).double()
    ref = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=world.process_group(), bucket_cap_mb=1e-4)
    buckets = []

    def hook(state, bucket):  # the mean of the ranks' gradients, through xelink
        buckets.append(bucket.index())
        work = xelink.all_reduce(bucket.buffer().div_(n), async_op=True)
        return work.get_future().then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, hook)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.2) for m in (ddp, ref))
    data = torch.Generator().manual_seed(2)
    B = 6 * n
    for _ in range(5):
        x, y = torch.randn(B, 8, generator=data, dtype=torch.float64), torch.randn(B, 4, generator=data,
                                                                                   dtype=torch.float64)
        rows = slice(r * B // n, (r + 1) * B // n)
        for m, o, xs, ys in ((ddp, opt, x[rows], y[rows]), (ref, ref_opt, x, y)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(xs), ys).backward()
            o.step()
    assert len(set(buckets)) > 1, buckets  # several buckets, each through the hook
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.detach(), b.detach())


def check_blocking_calls_return_none(world):
    # torch.distributed's contract: a blocking collective returns None (only async_op=True returns a handle),
    # at every world size (a world of one once returned False from all_reduce)
    n, r = world.size, world.rank
    x = torch.ones(4)
    calls = {
        "all_reduce": lambda: xelink.all_reduce(x.clone()),
        "all_gather_into_tensor": lambda: xelink.all_gather_into_tensor(torch.empty(4 * n), x),
        "all_gather": lambda: xelink.all_gather([torch.empty(4) for _ in range(n)], x),
        "reduce_scatter_tensor": lambda: xelink.reduce_scatter_tensor(torch.empty(4), torch.ones(4 * n)),
        "all_to_all_single": lambda: xelink.all_to_all_single(torch.empty(4 * n), torch.ones(4 * n)),
        "broadcast": lambda: xelink.broadcast(x.clone(), src=0),
        "reduce": lambda: xelink.reduce(x.clone(), dst=0),
        "gather": lambda: xelink.gather(x, [torch.empty(4) for _ in range(n)] if r == 0 else None, dst=0),
        "scatter": lambda: xelink.scatter(torch.empty(4), [x] * n if r == 0 else None, src=0),
        "barrier": lambda: xelink.barrier(),
    }
    for name, call in calls.items():
        got = call()
        assert got is None, f"{name} returned {got!r}, not None"
    w = xelink.all_reduce(x.clone(), async_op=True)
    assert w is not None and w.wait() is True
    # all_gather_into_tensor under torch's keyword names too (output_tensor, input_tensor), one name of each
    out = torch.empty(4 * n)
    assert xelink.all_gather_into_tensor(output_tensor=out, input_tensor=x + r) is None
    assert torch.equal(out, torch.arange(n).repeat_interleave(4) + 1.0)
    for kw, why in ((dict(output=out, output_tensor=out, input=x), "pass output= or output_tensor= .*not both"),
                    (dict(output=out), "pass input= or input_tensor= .*one is required")):
        with pytest.raises(TypeError, match=f"all_gather_into_tensor: {why}"):
            xelink.all_gather_into_tensor(**kw)
    world.barrier()  # the refused calls sent nothing


def check_bitwise_reductions(world):
    """band / bor / bxor (as gloo's) on integer and bool tensors, every all-reduce and reduce-scatter algorithm,
    reduce, and torch's ReduceOp spellings: each rank's bit r of a pattern, so that every op has a distinct
    answer; float and CUDA tensors are refused by name."""
    n, r = world.size, world.rank
    ops = torch.distributed.ReduceOp
    base = torch.arange(24, dtype=torch.int64) * 37 + 5
    mine = base ^ (1 << (r % 8)) | (r << 12)
    ranks = [base ^ (1 << (q % 8)) | (q << 12) for q in range(n)]
    want = {"band": ranks[0].clone(), "bor": ranks[0].clone(), "bxor": ranks[0].clone()}
    for q in range(1, n):
        want["band"] &= ranks[q]
        want["bor"] |= ranks[q]
        want["bxor"] ^= ranks[q]
    for op, spelled in (("band", ops.BAND), ("bor", "bor"), ("bxor", ops.BXOR)):
        for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
            for algo in xelink.collectives.ALGORITHMS["all_reduce"]:
                x = mine.to(dtype, copy=True)
                xelink.all_reduce(x, op=spelled, algo=algo)
                assert torch.equal(x, want[op].to(dtype)), (op, dtype, algo, x)
        for algo in xelink.collectives.ALGORITHMS["reduce_scatter"]:
            out = torch.empty(4, dtype=torch.int32)
            xelink.reduce_scatter_tensor(out, mine.repeat(n)[: 4 * n].to(torch.int32), op=op, algo=algo)
            full = want[op].repeat(n)[: 4 * n].to(torch.int32)
            assert torch.equal(out, full[4 * r: 4 * r + 4]), (op, algo, out)
        x = mine.clone()
        xelink.reduce(x, dst=n - 1, op=op)
        assert r != n - 1 or torch.equal(x, want[op]), (op, x)
    flags = torch.tensor([r == 0, True, r % 2 == 1])
    xelink.all_reduce(flags, op="bor")
    assert flags.tolist() == [True, True, n > 1], flags
    with pytest.raises(TypeError, match=r"all_reduce: op='band' needs an integer or bool dtype, got torch.float32"):
        xelink.all_reduce(torch.ones(3), op=ops.BAND)
    world.barrier()


def check_torch_reduce_op_accepted(world):
    x = torch.full((4,), float(world.rank))
    xelink.all_reduce(x, op=torch.distributed.ReduceOp.MAX)
    assert torch.equal(x, torch.full((4,), float(world.size - 1)))
    ops = torch.distributed.ReduceOp
    for op, want in ((ops.SUM, sum(range(1, world.size + 1))), (ops.PRODUCT, math.factorial(world.size)),
                     (ops.MIN, 1), (ops.AVG, (world.size + 1) / 2)):
        x = torch.full((4,), float(world.rank + 1))
        xelink.all_reduce(x, op=op)
        assert torch.equal(x, torch.full((4,), float(want))), op
        y = torch.full((4,), float(world.rank + 1))  # xelink.ReduceOp spells every one of torch's names
        xelink.all_reduce(y, op=getattr(xelink.ReduceOp, str(op).rsplit(".", 1)[-1]))
        assert torch.equal(y, x), op


def check_point_to_point(world):
    n, r = world.size, world.rank
    if n == 1:
        return
    right, left = (r + 1) % n, (r - 1) % n
    got = torch.empty(6, dtype=torch.bfloat16)
    ops = [xelink.P2POp(xelink.isend, torch.full((6,), r, dtype=torch.bfloat16), right, tag=5),
           xelink.P2POp(xelink.irecv, got, left, tag=5)]
    for h in xelink.batch_isend_irecv(ops):
        h.wait()
    assert torch.equal(got, torch.full((6,), left, dtype=torch.bfloat16))
    if r == 0:
        xelink.send(torch.arange(4), 1)
    elif r == 1:
        buf = torch.empty(4, dtype=torch.int64)
        assert xelink.recv(buf, 0) == 0
        assert torch.equal(buf, torch.arange(4))


@only(launchers=("mpi",), sizes=(2,))
def check_point_to_point_buffers_outlive_dropped_and_timed_out_transfers(world):
    """MPI reads a send's buffer (and writes a receive's) by its address until the transfer completes: an isend
    whose handle (and tensor) the caller drops, and a send that timed out (MPICH cannot cancel it), keep their
    buffers until MPI is done, so the late receiver gets the values sent. Before, the freed memory was reused
    and the receiver got its new contents (an eager message's, 16384 floats) or MPICH failed reading it (a
    large one). A receive of another size than was sent raises on every wait() and is_completed() is True, as
    torch's Work (before: the error once, then wait() returned True on a half-filled buffer); irecv's result()
    gives the numpy array it was given."""
    r = world.rank
    for n in (16384, 1 << 20):
        if r == 0:
            xelink.isend(torch.full((n,), 7.0), 1, tag=3)  # handle and tensor dropped at once
            work = xelink.isend(torch.full((n,), 8.0), 1, tag=4)
            with pytest.raises(xelink.TimeoutError, match=r"^isend: timed out after 0.5 s waiting for rank\(s\) 1"):
                work.wait(timeout=0.5)  # (both sizes are past MPI's eager limit: the send waits for the receive)
            del work
            junk = [torch.full((n,), -1.0) for _ in range(8)]  # the allocator would hand the freed memory out
            world.barrier()
            junk.clear()
        else:
            world.barrier()  # (after rank 0 dropped the first and gave up on the second)
            for tag, value in ((3, 7.0), (4, 8.0)):
                got = torch.zeros(n)
                xelink.recv(got, 0, tag=tag)
                assert torch.equal(got, torch.full((n,), value)), (n, tag, got.unique()[:4])
    world.barrier()
    if r == 0:
        xelink.send(torch.ones(2), 1, tag=5)
        xelink.send(np.arange(3.0), 1, tag=6)
    else:
        work = xelink.irecv(torch.zeros(4), 0, tag=5)
        while not work.is_completed():
            time.sleep(0.001)
        for _ in range(2):
            assert isinstance(work.exception(), ValueError), work.exception()
            with pytest.raises(ValueError, match=r"^irecv: rank 0 sent 8 bytes where this rank expected 16"):
                work.wait()
        arr = np.zeros(3)
        work = xelink.irecv(arr, 0, tag=6)
        assert work.result()[0] is arr and (arr == np.arange(3.0)).all()
    world.barrier()


@only(sizes=(2,))
def check_a_batch_whose_receive_shares_memory_is_refused(world):
    """batch_isend_irecv runs its transfers at once: a receive into memory another op of the list sends or
    receives is refused before anything is posted (naming both ops); sends of one tensor, and disjoint halves of
    one buffer, go."""
    peer, buf = 1 - world.rank, torch.zeros(8)
    bad = ([xelink.P2POp(xelink.isend, buf, peer), xelink.P2POp(xelink.irecv, buf, peer)],
           [xelink.P2POp(xelink.irecv, buf[:5], peer), xelink.P2POp(xelink.isend, torch.ones(3), peer),
            xelink.P2POp(xelink.irecv, buf[4:], peer)],
           [xelink.P2POp(xelink.isend, buf[2:6], peer), xelink.P2POp(xelink.irecv, buf[:3], peer)])
    for ops, pair in zip(bad, ("0 and 1", "0 and 2", "0 and 1")):
        with pytest.raises(ValueError, match=f"batch_isend_irecv: ops {pair} of the list share memory"):
            xelink.batch_isend_irecv(ops)
    buf[:4] = torch.arange(4.0) + 10 * world.rank
    got = [torch.zeros(8), torch.zeros(8)]
    ops = [xelink.P2POp(xelink.isend, buf, peer, tag=1), xelink.P2POp(xelink.isend, buf, peer, tag=2),
           xelink.P2POp(xelink.irecv, got[0], peer, tag=1), xelink.P2POp(xelink.irecv, got[1], peer, tag=2)]
    for h in xelink.batch_isend_irecv(ops):
        h.wait()
    want = torch.cat([torch.arange(4.0) + 10 * peer, torch.zeros(4)])
    assert torch.equal(got[0], want) and torch.equal(got[1], want), got
    for h in xelink.batch_isend_irecv([xelink.P2POp(xelink.isend, buf[:4], peer),
                                       xelink.P2POp(xelink.irecv, buf[4:], peer)]):
        h.wait()
    assert torch.equal(buf[4:], torch.arange(4.0) + 10 * peer), buf


def check_receive_from_any_source(world):
    """recv / irecv with src=None (CPU) take whichever rank's message of that tag comes first and name its
    sender (recv's return, the handle's source_rank()), as torch.distributed's; a wait no rank answers names
    every other rank."""
    n, r = world.size, world.rank
    if n == 1:
        with pytest.raises(ValueError, match=r"recv: src=None \(any source\) in a group of one rank"):
            xelink.recv(torch.zeros(2), None)
        return
    if r == 0:
        seen = []
        for _ in range(n - 1):
            buf = torch.empty(3, dtype=torch.int64)
            src = xelink.recv(buf, tag=7)
            assert torch.equal(buf, torch.full((3,), 10 * src)), (src, buf)
            seen.append(src)
        assert sorted(seen) == list(range(1, n)), seen
        arr = np.zeros(2)
        work = xelink.irecv(arr, None, tag=8)
        work.wait()
        assert work.source_rank() == n - 1 and (arr == n - 1).all(), (work.source_rank(), arr)
    else:
        xelink.send(torch.full((3,), 10 * r, dtype=torch.int64), 0, tag=7)
        if r == n - 1:
            xelink.send(np.full(2, float(r)), 0, tag=8)
    if world.transport.name == "mpi":  # (a gloo receive that times out closes its pairs: fatal by design)
        sub = world.split(0)
        if r == 0:
            work = xelink.irecv(torch.zeros(2), None, group=sub, tag=9)
            with pytest.raises(xelink.TimeoutError) as info:
                work.wait(timeout=0.2)
            assert info.value.missing == list(range(1, n)), info.value.missing
            with pytest.raises(RuntimeError, match=r"irecv: source_rank\(\) of an any-source receive that has not"):
                work.source_rank()
        sub.barrier()
        sub.free()
    world.barrier()


def check_objects_point_to_point(world):
    """send_object_list / recv_object_list as torch.distributed's: a ring of lists whose size changes from call
    to call (one past MPI's eager limit), tensor messages of tag 0 to the same peer in between that neither
    takes, any-source receives that name their sender, group ranks, a length that differs (refused once the
    message came: the next exchange is intact); get_process_group_ranks and monitored_barrier."""
    n, r = world.size, world.rank
    assert xelink.get_process_group_ranks(None) == list(range(n))
    backwards = xelink.new_group(list(range(n - 1, -1, -1)), sort_ranks=False)
    assert xelink.get_process_group_ranks(backwards) == list(range(n - 1, -1, -1))
    xelink.monitored_barrier(timeout=30, wait_all_ranks=True)
    if n == 1:
        with pytest.raises(ValueError, match=r"send_object_list: dst=0 is this rank itself"):
            xelink.send_object_list([1], 0)
        with pytest.raises(ValueError, match=r"recv_object_list: src=None \(any source\) in a group of one rank"):
            xelink.recv_object_list([None])
        return
    right, left = (r + 1) % n, (r - 1) % n
    for size in (1, 3000, 300_000):  # bytes of the payload: the last one leaves MPI's eager protocol
        sent = [{"from": r, "size": size}, b"x" * size, torch.arange(3) * r]
        got = [None] * 3
        tensor = torch.empty(2)

        def give():
            xelink.send(torch.full((2,), float(r)), right)
            xelink.send_object_list(sent, right)

        def take():  # (the tensor's receive is posted first: a gloo send waits for its receive)
            work = xelink.irecv(tensor, left)
            assert xelink.recv_object_list(got, left) == left
            work.wait()

        for step in (give, take) if r % 2 == 0 else (take, give):  # no two ranks wait on each other's receive
            step()
        assert got[0] == {"from": left, "size": size} and got[1] == b"x" * size, got[0]
        assert torch.equal(got[2], torch.arange(3) * left) and torch.equal(tensor, torch.full((2,), float(left)))
    # any source, through a group that lists the world backwards (group_dst 0 is world rank n - 1)
    if r == n - 1:
        senders = []
        for _ in range(n - 1):
            box = [None, None]
            senders.append(xelink.recv_object_list(box, group=backwards))
            assert box == [senders[-1], "hello"], box
        assert sorted(senders) == list(range(n - 1)), senders
    else:
        xelink.send_object_list([r, "hello"], group_dst=0, group=backwards)
    world.barrier()  # (rank 0's next lists must not meet the any-source receives above)
    if r == n - 1:
        box = [None]  # a length that differs: refused once the message came
        with pytest.raises(ValueError, match=r"recv_object_list: object_list has 1 entries on rank \d+; world rank 0 "
                                             r"sent 2"):
            xelink.recv_object_list(box, group_src=n - 1, group=backwards)
        assert box == [None]
        box = [None, None]
        assert xelink.recv_object_list(box, 0) == 0 and box == ["next", 0]
    elif r == 0:
        xelink.send_object_list(("short", 1), group_dst=0, group=backwards)
        xelink.send_object_list(["next", 0], n - 1)
    with pytest.raises(TypeError, match=r"send_object_list: object_list must be a list, got int"):
        xelink.send_object_list(3, right)
    sub = world.split(None if r == 0 else 0)
    if r:
        with pytest.raises(ValueError, match=r"recv_object_list: src=0 is a world rank outside"):
            xelink.recv_object_list([None], 0, group=sub)
        sub.free()
    with pytest.raises(TypeError, match=r"monitored_barrier: wait_all_ranks=1 must be a bool"):
        xelink.monitored_barrier(wait_all_ranks=1)
    backwards.free()
    world.barrier()


def check_bad_inputs_raise_before_sending(world):
    n = world.size
    x = torch.zeros(4)
    with pytest.raises(ValueError, match=r"all_reduce: op='mean' is not one of sum, avg, max, min, prod, band, bor, "
                                         r"bxor"):
        xelink.all_reduce(x, op="mean")
    with pytest.raises(ValueError, match=r"all_reduce: algo='tree' is not one of auto, ring, direct"):
        xelink.all_reduce(x, algo="tree")
    with pytest.raises(TypeError, match=r"all_reduce: op='avg' needs a floating dtype, got torch.int32"):
        xelink.all_reduce(torch.zeros(3, dtype=torch.int32), op="avg")
    with pytest.raises(TypeError, match=r"all_reduce: tensor.dtype=torch.complex64 is not reducible here"):
        xelink.all_reduce(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"all_reduce: tensor must be contiguous"):
        xelink.all_reduce(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match=r"all_reduce: tensor is on meta"):
        xelink.all_reduce(torch.zeros(4, device="meta"))
    with pytest.raises(TypeError, match=r"all_reduce: tensor must be a torch.Tensor or numpy.ndarray, got list"):
        xelink.all_reduce([1.0, 2.0])
    with pytest.raises(ValueError, match=rf"all_gather_into_tensor: output.numel\(\)=5 != world_size\*input.numel\(\)={2 * n}"):
        xelink.all_gather_into_tensor(torch.zeros(5), torch.zeros(2))
    with pytest.raises(TypeError, match=r"all_gather_into_tensor: output.dtype=torch.float64 != input.dtype=torch.float32"):
        xelink.all_gather_into_tensor(torch.zeros(2 * n, dtype=torch.float64), torch.zeros(2))
    with pytest.raises(ValueError, match=rf"reduce_scatter_tensor: input.numel\(\)=3 != world_size\*output.numel\(\)={2 * n}"):
        xelink.reduce_scatter_tensor(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match=r"all_to_all_single: sum\(input_split_sizes\)=.* != dim 0 of the tensor"):
        xelink.all_to_all_single(torch.zeros(n), torch.zeros(n), [1] * n, [2] * n)
    with pytest.raises(ValueError, match=rf"broadcast: src={n} is out of range for a group of size {n}"):
        xelink.broadcast(x, src=n)
    with pytest.raises(ValueError, match=r"send: tag=-1 must be an int in \[0, 16384\)"):
        xelink.send(x, 0, tag=-1)
    with pytest.raises(ValueError, match=r"send: dst= \(a world rank\) or group_dst= \(a rank of the group\) is required"):
        xelink.send(x, None)
    with pytest.raises(ValueError, match=rf"^send: dst={n} is out of range for a group of size {n}"):
        xelink.send(x, n)
    with pytest.raises(ValueError, match=rf"^batch_isend_irecv: dst={n} is out of range for a group of size {n}"):
        xelink.batch_isend_irecv([xelink.P2POp(xelink.isend, x, n)])
    with pytest.raises(ValueError, match=rf"all_gather: tensor_list must be a list of world_size={n} tensors, got {n + 1}"):
        xelink.all_gather([x] * (n + 1), x)
    with pytest.raises(TypeError, match=r"barrier: device_ids='0' must be a list of ints"):
        xelink.barrier(device_ids="0")
    xelink.barrier(device_ids=[0])  # NCCL code's barrier(device_ids=[local_rank]): a host barrier here
    with pytest.raises(ValueError, match=r"^all_reduce: tensor has numpy dtype >f4, not in this machine's byte order"):
        xelink.all_reduce(np.ones(3, dtype=">f4"))  # (torch's own error named neither)
    world.barrier()  # nothing was sent: the world still works
    y = torch.ones(3)
    xelink.all_reduce(y)
    assert torch.equal(y, torch.full((3,), float(n)))
    y = torch.full((3,), float(world.rank))  # a torch ReduceOp instance, as gloo takes it
    xelink.all_reduce(y, op=torch.distributed.ReduceOp(torch.distributed.ReduceOp.MAX))
    assert torch.equal(y, torch.full((3,), float(n - 1)))


@only(sizes=(2, 3, 5))
def check_inputs_that_share_memory_with_outputs_are_read_first(world):
    """An input that shares memory with the call's output is read as if copied first (torch's in-place forms, the
    input this rank's block of the output or the output its block of the input, among them), on every algorithm:
    all_to_all_single in place or shifted by part of a block had returned other ranks' blocks or failed part way
    (a copy torch refused, the communicator then unusable); a scatter root whose output was another rank's entry
    sent it its own. Output lists that reuse one tensor are refused before anything is sent."""
    n, r = world.size, world.rank
    comm = world.split(0)
    algos = xelink.collectives.ALGORITHMS

    def block(q, c, k):  # rank q's k-th block of c elements
        return torch.arange(c, dtype=torch.float32) + 1000 * q + 100000 * k

    def blocks(q, c, ks):
        return torch.cat([block(q, c, k) for k in ks])

    for c in (1, 7, 3000):
        for algo in ("auto",) + algos["all_gather"]:
            for j in (r, (r + 1) % n):  # the input is block j of the output
                out = torch.full((n * c,), -1.0)
                out[j * c:(j + 1) * c] = block(r, c, 0)
                xelink.all_gather_into_tensor(out, out[j * c:(j + 1) * c], group=comm, algo=algo)
                assert_same(out, torch.cat([block(q, c, 0) for q in range(n)]), f"all_gather {algo} block {j} c={c}")
        for algo in ("auto",) + algos["reduce_scatter"]:
            for j in (r, (r + 1) % n):  # the output is block j of the input
                inp = blocks(r, c, range(n))
                xelink.reduce_scatter_tensor(inp[j * c:(j + 1) * c], inp, group=comm, algo=algo)
                assert_same(inp[j * c:(j + 1) * c], sum(block(q, c, r) for q in range(n)),
                            f"reduce_scatter {algo} into block {j} c={c}")
        for algo in ("auto",) + algos["all_to_all"]:
            for shift in (0, c // 2 + 1, c):  # the output starts `shift` elements into the input
                buf = torch.zeros(n * c + shift)
                buf[:n * c] = blocks(r, c, range(n))
                out = buf[shift:shift + n * c]
                xelink.all_to_all_single(out, buf[:n * c], group=comm, algo=algo)
                assert_same(out, torch.cat([block(q, c, r) for q in range(n)]), f"all_to_all {algo} +{shift} c={c}")
        for j in (r, (r + 1) % n):
            outs = [torch.full((c,), -1.0) for _ in range(n)]
            outs[j].copy_(block(r, c, 0))
            xelink.all_gather(outs, outs[j], group=comm)
            assert_same(torch.cat(outs), torch.cat([block(q, c, 0) for q in range(n)]), f"all_gather list {j}")
            lst = [block(0, c, k) for k in range(n)] if r == 0 else None
            out = lst[(j - r) % n] if r == 0 else torch.zeros(c)  # the root's output: entry 0 or 1 of its list
            xelink.scatter(out, lst, group_src=0, group=comm)
            assert_same(out, block(0, c, r), f"scatter into the root's entry {(j - r) % n}")
            lst = [torch.full((c,), -1.0) for _ in range(n)] if r == 0 else None
            inp = lst[(j - r) % n] if r == 0 else block(r, c, 0)
            inp.copy_(block(r, c, 0))
            xelink.gather(inp, lst, group_dst=0, group=comm)
            if r == 0:
                assert_same(torch.cat(lst), torch.cat([block(q, c, 0) for q in range(n)]), "gather from an entry")
    same = torch.zeros(2)
    refused = [(lambda: xelink.all_gather([same] * n, torch.ones(2), group=comm), "tensor_list"),
               (lambda: xelink.all_to_all([same] * n, [torch.ones(2)] * n, group=comm), "output_tensor_list")]
    if r == 0:  # (gather's list is the root's alone: the other ranks do not call it here)
        refused.append((lambda: xelink.gather(torch.ones(2), [same] * n, group_dst=0, group=comm), "gather_list"))
    for call, name in refused:
        with pytest.raises(ValueError, match=rf"{name}\[0\] and {name}\[1\] share memory"):
            call()
    xelink.all_reduce(torch.ones(1), group=comm)  # the communicator is still usable: nothing was sent
    comm.free()


def check_mismatched_calls_are_detected(world):
    """With call checking on, ranks that pass different shapes get an error instead of garbage."""
    if world.size == 1:
        return
    sub = world.split(0)
    sub.check_calls = True
    with pytest.raises(ValueError, match=r"all_reduce: ranks disagree about the call"):
        xelink.all_reduce(torch.zeros(4 + (world.rank == 1)), group=sub)
    sub.free()


@only(sizes=(2, 3, 5))
def check_different_sizes_without_checking_raise_instead_of_garbage(world):
    """Call checking off: rank 0 passes 12 elements, the others 10. The one-shot all-reduce compares the sizes
    the ranks announce with its barrier (every rank raises, naming a rank and both sizes); point-to-point
    schedules check each receive's byte count, so a rank that receives from a rank of another size raises
    naming the sender (the others' waits expire or also raise): nobody returns a buffer partly filled or read
    from a stale slot."""
    if world.size == 1:
        return
    count = 12 if world.rank == 0 else 10
    sub = world.split(0)
    if sub.transport.name == "mpi":
        with pytest.raises(ValueError, match=r"^all_reduce: rank \d passed (40|48) bytes and rank \d (40|48) \(every "
                                             r"rank must pass the same size\)"):
            xelink.all_reduce(torch.ones(count), group=sub, algo="direct")
        with pytest.raises(xelink.XelinkError, match="unusable after an earlier failure"):
            xelink.all_reduce(torch.ones(4), group=sub)  # messages of the failed call may be in flight
    sub.free()
    for op in ("all_reduce", "all_gather"):
        sub = world.split(0)
        with pytest.raises((ValueError, xelink.TimeoutError)) as info:
            if op == "all_reduce":
                xelink.all_reduce(torch.ones(count), group=sub, algo="ring", timeout=2)
            else:
                xelink.all_gather_into_tensor(torch.empty(world.size * count), torch.ones(count), group=sub,
                                              algo="ring", timeout=2)
        called = "all_gather_into_tensor" if op == "all_gather" else op  # (the errors name the call made)
        named = isinstance(info.value, ValueError) and str(info.value).startswith(f"{called}: rank") and \
            str(info.value).endswith("(the ranks passed different sizes)")
        if sub.transport.name == "mpi":
            assert any(world.allgather_object(named)), str(info.value)
        sub.free()
    world.barrier()


@only(sizes=(3, 4))
def check_a_root_refused_by_its_checks_leaves_no_message_for_a_later_call(world):
    """The root's gather / scatter list is refused by its checks (a ValueError there) while the other ranks,
    whose arguments are fine, go ahead: no rank returns data of another call. Before, the other ranks'
    gather returned as though it had worked (MPI buffered their sends), and the root's next gather took those
    messages (the first call's values), every later call one behind; a scatter's waiting ranks took the
    root's next call's values. Now the refused call still takes its tags on the root (``issued``), and under
    MPI a rank that only sends sends synchronously, so the others time out (1 s) and the root's next call
    times out or, where the others' sends completed (gloo has no synchronous mode), gets the next call's
    values."""
    first, second = float(100 + world.rank), float(world.rank)
    sub = world.split(0)
    got = []
    for value in (first, second):
        x = torch.full((2,), value)
        outs = [torch.zeros(2) for _ in range(world.size)]
        try:
            if world.rank == 0:
                xelink.gather(x, outs if value == second else None, dst=0, group=sub, timeout=1)
            else:
                xelink.gather(x, None, dst=0, group=sub, timeout=1)
            got.append([o[0].item() for o in outs] if world.rank == 0 else "ok")
        except (ValueError, xelink.XelinkError) as exc:
            got.append(type(exc).__name__)
    if world.rank == 0:
        assert got[0] == "ValueError", got
        # never 101, 102, ...: the first call's values (gloo: a transfer failed, or the next call's values)
        assert got[1] in ("TimeoutError", "XelinkError", [float(r) for r in range(world.size)]), got
    elif sub.transport.name == "mpi":
        assert got[0] == "TimeoutError", got  # not "ok" with its message left queued
    world.barrier()  # (free drains what is queued: that would complete a peer's send still waiting)
    sub.free()
    sub = world.split(0)
    got = []
    for value in (1.0, 2.0):
        x = torch.zeros(2)
        ins = [torch.full((2,), value * 10 + r) for r in range(world.size)]
        try:
            if world.rank == 0:
                xelink.scatter(x, ins[:1] if value == 1.0 else ins, src=0, group=sub, timeout=1)
            else:
                xelink.scatter(x, None, src=0, group=sub, timeout=1)
            got.append(x[0].item())
        except (ValueError, xelink.XelinkError) as exc:
            got.append(type(exc).__name__)
    if world.rank == 0:
        assert got[0] == "ValueError", got
    else:  # never 20 + rank: the next call's value (gloo: where the gather's timeout closed the pair to the root,
        # the transfer fails at once, as after any gloo timeout)
        assert got[0] == "TimeoutError" or (sub.transport.name != "mpi" and got[0] == "XelinkError"), got
    world.barrier()
    sub.free()
    # gather_object: the root's list is checked after the exchange, which every rank completes
    sub = world.split(0)
    for objs in (None, [None] * world.size):
        mine = [] if objs is None else objs
        if world.rank == 0 and objs is None:
            with pytest.raises(ValueError, match=r"^gather_object: object_gather_list must be a list of "
                                                 rf"world_size={world.size} entries, got 0"):
                xelink.gather_object(("first", world.rank), mine, dst=0, group=sub)
        else:
            xelink.gather_object(("second" if objs else "first", world.rank), mine if world.rank == 0 else None,
                                 dst=0, group=sub)
    if world.rank == 0:
        assert mine == [("second", r) for r in range(world.size)], mine
    sub.free()
    world.barrier()


@only(launchers=("mpi",), sizes=(3,))
def check_ranks_that_disagree_on_a_root_or_a_block_raise(world):
    """Every rank names itself the broadcast's root: each only sends, synchronously, so each times out
    (before, each returned its own data and its messages stayed queued, to be taken 16384 calls later, when
    the tags came round); later calls on the group raise. all_to_all_single where rank 1 expects nothing from
    rank 0, which sends it a row: rank 1 raises naming rank 0 (before, the row stayed queued and rank 1
    returned as though nothing had been sent)."""
    sub = world.split(0)
    with pytest.raises(xelink.TimeoutError, match=r"^broadcast: timed out after 1 s waiting for rank"):
        xelink.broadcast(torch.full((4,), float(world.rank)), src=world.rank, group=sub, timeout=1)
    with pytest.raises(xelink.XelinkError, match="unusable after an earlier failure"):
        xelink.broadcast(torch.zeros(4), src=0, group=sub)
    world.barrier()
    sub.free()
    sub = world.split(0)
    n = world.size
    out_splits = [0] + [1] * (n - 1) if world.rank == 1 else [1] * n
    out = torch.zeros(sum(out_splits))
    try:
        xelink.all_to_all_single(out, torch.full((n,), float(world.rank)), out_splits, [1] * n, group=sub,
                                 timeout=1)
        outcome = "ok"
    except (ValueError, xelink.XelinkError) as exc:
        outcome = str(exc)
    if world.rank == 1:
        assert re.match(r"all_to_all_single: rank 0 sent (more|4) bytes where this rank expected 0", outcome), outcome
    sub.free()
    world.barrier()


@only(launchers=("mpi",))
def check_rank_late_to_a_first_window_times_out_too(world):
    # A rank that arrives after its peers gave up on the first peer-memory all_reduce of a communicator (which
    # makes the window: MPI calls without a deadline, after a rendezvous) raises under its own deadline, naming
    # the call, instead of waiting in MPI for peers that left; the peers name it and the call. (MPI only: over
    # torchrun's transport there is no window, and the late rank may well find its peers' messages there.)
    if world.size == 1:
        return
    late = world.size - 1
    sub = world.split(0)
    if world.rank == late:
        time.sleep(1.5)
    t0 = time.monotonic()
    with pytest.raises(xelink.TimeoutError, match=r"^all_reduce: timed out after (1|0\.9\d*) s waiting for") as info:
        xelink.all_reduce(torch.ones(8), group=sub, algo="direct", timeout=1.0)
    assert time.monotonic() - t0 < 3.0, time.monotonic() - t0
    if world.rank != late:
        assert info.value.missing == [late], str(info.value)
    sub.free()
    world.barrier()


def check_rank_that_never_calls_is_named(world):
    # Algorithms whose first step waits on every peer name the absent rank on every rank; in a ring
    # only its neighbours can, the others name the neighbour that stopped forwarding.
    if world.size == 1:
        return
    sub = world.split(0)
    late = world.size - 1
    if world.rank != late:
        with pytest.raises(xelink.TimeoutError, match=rf"all_reduce: timed out after 1 s waiting for rank\(s\) {late}"):
            xelink.all_reduce(torch.ones(8), group=sub, algo="two_shot", timeout=1.0)
    sub.free()
    # The same through a handle: its future (asked for at once) fails with that error, exception() gives it
    sub = world.split(0)
    if world.rank != late:
        work = xelink.all_reduce(torch.ones(8), group=sub, algo="two_shot", timeout=1.0, async_op=True)
        future = work.get_future()
        with pytest.raises(xelink.TimeoutError, match=rf"all_reduce: timed out after 1 s waiting for rank\(s\) {late}"):
            future.wait()
        assert isinstance(work.exception(), xelink.TimeoutError) and work.is_completed()
        with pytest.raises(xelink.TimeoutError, match=rf"waiting for rank\(s\) {late}"):  # the call's, not "unknown"
            work.wait()
    sub.free()
    # wait() alone, with the communicator's deadline: it gave up at that deadline counted from the call, before
    # the operation's own (which starts when the worker starts it), and named no rank
    world.barrier()  # (the late rank is ahead: new_group's split waits 1 s too)
    sub = xelink.new_group(timeout=1.0)  # (the group's own deadline, as torch's)
    if world.rank != late:
        work = xelink.all_reduce(torch.ones(8), group=sub, algo="two_shot", async_op=True)
        with pytest.raises(xelink.TimeoutError, match=rf"all_reduce: timed out after 1 s waiting for rank\(s\) {late}"):
            work.wait()
    sub.free()
    # The peer-memory path (one host, MPI) sets up its window under the same deadline.
    sub = world.split(0)
    if world.rank != late:
        with pytest.raises(xelink.TimeoutError, match=r"timed out after 1(\.0+)? s|timed out after 0\.9\d* s") as info:
            xelink.all_reduce(torch.ones(8), group=sub, algo="direct", timeout=1.0)
        assert info.value.missing == [late]
    sub.free()
    world.barrier()

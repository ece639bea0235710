"""Whole-buffer exact checks of every collective, algorithm and dtype on a communicator.

Imported by tests/ranks_collectives*.py. Inputs are small integers (exact in every dtype and every
summation order), generated from (rank, case) seeds so every rank can compute the expected result.
"""
import torch

import xelink
from xelink.collectives import ALGORITHMS

DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64)
OPS = ("sum", "avg", "max", "min", "prod")


_PERIOD = 1009  # prime, so no chunk boundary of an algorithm lines up with the pattern


def _block(rank, case, op):
    x = (torch.arange(_PERIOD, dtype=torch.int64) * (2 * rank + 3) + case * 13 + rank * 5) % 7
    if op == "prod":  # products of +-1 and 2 stay exact (powers of two)
        return torch.tensor([1, 2, -1, 1, 2, -1, 1], dtype=torch.int64)[x]
    return x - 3


def data(rank, case, count, dtype, op="sum", start=0):
    """Small integers in [-3, 3] (for prod: 1, 2, -1), different per rank, case and position: positions
    [start, start + count) of the rank's endless pattern."""
    block = _block(rank, case, op).roll(-(start % _PERIOD))
    return block.repeat(count // _PERIOD + 1)[:count].to(dtype)


def expected_reduce(n, case, count, dtype, op, start=0):
    """op over the n ranks' inputs as ``dtype`` holds them (uint8 wraps the negatives, bool keeps nonzero), exact
    in int64, then rounded (avg from float64, like float32 accumulation) or wrapped (narrow integers) into
    ``dtype``: sums and products modulo 2^bits as the narrow types compute them, bool's sum and max "or".
    ``start``: positions [start, start + count) only (a reduce-scatter's block, without the whole input's sum)."""
    acc = data(0, case, count, dtype, op, start).to(torch.int64)
    for p in range(1, n):
        x = data(p, case, count, dtype, op, start).to(torch.int64)
        if op in ("sum", "avg"):
            acc += x
        elif op == "max":
            torch.maximum(acc, x, out=acc)
        elif op == "min":
            torch.minimum(acc, x, out=acc)
        else:
            acc *= x
    if op == "avg":  # the sum is exact; divide once in the accumulation type, as the algorithms do
        wd = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        return (acc.to(wd) / n).to(dtype)
    return acc.to(dtype)


def assert_same(got, want, what):
    if not torch.equal(got, want):
        bad = (got != want).nonzero().flatten()[:5].tolist()
        raise AssertionError(f"{what}: {int((got != want).sum())} wrong elements, first at {bad}: "
                             f"got {got.flatten()[bad].tolist()} want {want.flatten()[bad].tolist()}")


def run_all(comm, counts, dtypes=DTYPES, ops=OPS, algos=None, tag="", inplace=True):
    """Every algorithm x dtype at every count with op "sum"; every op (and in place) at the last count.

    ``algos`` limits the algorithms (e.g. to the layout-dependent ones); default: all plus "auto".
    """
    n, r = comm.size, comm.rank
    pick = lambda op_name: ("auto",) + ALGORITHMS[op_name] if algos is None else tuple(  # noqa: E731
        a for a in algos if a in ALGORITHMS[op_name] or a == "auto")
    case = 0
    for ci, count in enumerate(counts):
        last = ci == len(counts) - 1
        for dtype in dtypes:
            floating = dtype.is_floating_point
            for algo in pick("all_reduce"):
                for op in (ops if last else ("sum",)):
                    if op == "avg" and not floating:
                        continue
                    case += 1
                    x = data(r, case, count, dtype, op)
                    xelink.all_reduce(x, op=op, group=comm, algo=algo)
                    assert_same(x, expected_reduce(n, case, count, dtype, op), f"{tag} all_reduce {algo} {op} "
                                f"{dtype} count={count}")
            for algo in pick("all_gather"):
                case += 1
                want = torch.cat([data(p, case, count, dtype) for p in range(n)])
                out = torch.full((n * count,), 99, dtype=dtype)
                xelink.all_gather_into_tensor(out, data(r, case, count, dtype), group=comm, algo=algo)
                assert_same(out, want, f"{tag} all_gather {algo} {dtype} count={count}")
                if last and inplace:  # in place: the input is this rank's block of the output
                    out = torch.full((n * count,), 99, dtype=dtype)
                    out[r * count:(r + 1) * count] = data(r, case, count, dtype)
                    xelink.all_gather_into_tensor(out, out[r * count:(r + 1) * count], group=comm, algo=algo)
                    assert_same(out, want, f"{tag} all_gather in-place {algo} {dtype} count={count}")
            for algo in pick("reduce_scatter"):
                for op in (tuple(o for o in ops if floating or o != "avg") if last else ("sum",)):
                    case += 1
                    want = expected_reduce(n, case, count, dtype, op, start=r * count)
                    out = torch.full((count,), 99, dtype=dtype)
                    xelink.reduce_scatter_tensor(out, data(r, case, n * count, dtype, op), op=op, group=comm, algo=algo)
                    assert_same(out, want, f"{tag} reduce_scatter {algo} {op} {dtype} count={count}")
                    if last and inplace and op == "sum":  # in place: output is this rank's block of the input
                        inp = data(r, case, n * count, dtype, op)
                        xelink.reduce_scatter_tensor(inp[r * count:(r + 1) * count], inp, op=op, group=comm,
                                                     algo=algo)
                        assert_same(inp[r * count:(r + 1) * count], want, f"{tag} reduce_scatter in-place {algo} "
                                    f"{dtype} count={count}")
    return case


def run_all_to_all(comm, dtypes=DTYPES):
    n, r = comm.size, comm.rank
    # Uneven splits: rank i sends (i + j) % 3 rows of width 5 to rank j.
    rows = lambda i, j: (i + j) % 3  # noqa: E731
    for dtype in dtypes:
        ins = [rows(r, j) for j in range(n)]
        outs = [rows(i, r) for i in range(n)]
        inp = torch.cat([torch.full((rows(r, j), 5), r * 10 + j, dtype=torch.int64) for j in range(n)]).to(dtype)
        out = torch.full((sum(outs), 5), -1, dtype=dtype)
        xelink.all_to_all_single(out, inp, outs, ins, group=comm)
        want = torch.cat([torch.full((rows(i, r), 5), i * 10 + r, dtype=torch.int64) for i in range(n)]).to(dtype)
        assert_same(out, want, f"all_to_all_single uneven {dtype}")
        even_in = torch.arange(n * 4, dtype=torch.int64).to(dtype) + 100 * r
        even_out = torch.empty(n * 4, dtype=dtype)
        xelink.all_to_all_single(even_out, even_in, group=comm)
        want = torch.cat([torch.arange(r * 4, r * 4 + 4) + 100 * i for i in range(n)]).to(dtype)
        assert_same(even_out, want, f"all_to_all_single even {dtype}")


def run_rooted(comm, dtypes=DTYPES):
    n, r = comm.size, comm.rank
    for dtype in dtypes:
        for root in sorted({0, n - 1}):
            x = torch.full((7,), r, dtype=torch.int64).to(dtype)
            xelink.broadcast(x, group=comm, group_src=root)
            assert_same(x, torch.full((7,), root, dtype=torch.int64).to(dtype), f"broadcast {dtype} root={root}")
            x = torch.full((7,), r + 1, dtype=torch.int64).to(dtype)
            xelink.reduce(x, op="sum", group=comm, group_dst=root)
            if r == root:
                assert_same(x, torch.full((7,), n * (n + 1) // 2, dtype=torch.int64).to(dtype), f"reduce {dtype}")
            lst = [torch.empty(3, dtype=dtype) for _ in range(n)] if r == root else None
            xelink.gather(torch.full((3,), r, dtype=torch.int64).to(dtype), lst, group=comm, group_dst=root)
            if r == root:
                assert_same(torch.stack(lst), torch.arange(n).repeat_interleave(3).view(n, 3).to(dtype), "gather")
            lst = [torch.full((3,), p * 2, dtype=torch.int64).to(dtype) for p in range(n)] if r == root else None
            y = torch.empty(3, dtype=dtype)
            xelink.scatter(y, lst, group=comm, group_src=root)
            assert_same(y, torch.full((3,), 2 * r, dtype=torch.int64).to(dtype), "scatter")
            outs = [torch.empty(2, dtype=dtype) for _ in range(n)]
            xelink.all_gather(outs, torch.full((2,), r, dtype=torch.int64).to(dtype), group=comm)
            assert_same(torch.stack(outs), torch.arange(n).repeat_interleave(2).view(n, 2).to(dtype), "all_gather list")


# -- back-to-back calls, the way real jobs make them -------------------------------------------------

# Element counts a sequence draws from: empty, tiny, odd, the parameter sizes of a small MLP (64x32,
# 64, 10x64, 10), and a few larger ones, so that consecutive calls differ in size by up to 3000x.
SEQUENCE_COUNTS = (0, 1, 3, 10, 17, 64, 640, 1009, 2048, 4099, 32773)
SEQUENCE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def run_sequence(comm, steps, *, seed, algos=ALGORITHMS, ops=SEQUENCE_OPS, dtypes=DTYPES, device="cpu",
                 delay=None, symmetric=None, symmetric_only=(("all_reduce", "copy_engine"),), what="sequence"):
    """``steps`` back-to-back collectives drawn at random, every result checked element by element.

    Every rank draws the same sequence (op, count, dtype, reduction, algorithm, sync or async) from
    ``seed``; each rank also draws its own delays (``delay(seconds)`` before about a third of the calls:
    a sleep on the host, or one on the GPU stream), so ranks arrive at each call in a different order.
    Up to three asynchronous calls are in flight before their handles are waited on and checked.

    Args:
        algos: op -> algorithm names to draw from (besides "auto").
        symmetric: ``symmetric(nbytes) -> uint8 tensor`` of peer memory (``xelink.empty``) to place the
            inputs of about half the calls in (GPU), never one of the last four it handed out (up to
            three calls are in flight, and their checks read their buffers later); None: ordinary tensors.
        symmetric_only: (op, algo) pairs whose input must be symmetric (with ``symmetric``).
    """
    import random

    n, r = comm.size, comm.rank
    draw, late = random.Random(seed), random.Random(seed * 7919 + r)
    pending = []

    def flush():
        for work, check in pending:
            work.wait()
            check()
        pending.clear()

    def place(t, must=False):
        if symmetric is None or t.numel() == 0 or (not must and draw.random() < 0.5):
            return t.to(device)
        buf = symmetric(t.numel() * t.element_size())[: t.numel() * t.element_size()].view(t.dtype)
        buf.copy_(t)
        return buf

    for case in range(seed * 1000, seed * 1000 + steps):
        name, count, dtype = draw.choice(ops), draw.choice(SEQUENCE_COUNTS), draw.choice(dtypes)
        algo = draw.choice(("auto",) + tuple(algos.get(name, ())))
        rop = draw.choice([o for o in OPS if o != "avg" or dtype.is_floating_point])
        async_op = draw.random() < 0.25
        if symmetric is None and (name, algo) in symmetric_only:
            algo = "auto"
        must = (name, algo) in symmetric_only
        label = f"{what} call {case - seed * 1000}: {name} algo={algo} op={rop} {dtype} count={count}"
        if late.random() < 0.35 and delay is not None:
            delay(late.uniform(0, 0.003))
        if name == "all_reduce":
            x = place(data(r, case, count, dtype, rop), must)
            work = xelink.all_reduce(x, op=rop, group=comm, algo=algo, async_op=async_op)
            want = expected_reduce(n, case, count, dtype, rop)
            check = lambda x=x, want=want, label=label: assert_same(x.cpu(), want, label)  # noqa: E731
        elif name == "all_gather":
            out = torch.full((n * count,), 99, dtype=dtype, device=device)
            work = xelink.all_gather_into_tensor(out, place(data(r, case, count, dtype)), group=comm, algo=algo,
                                                 async_op=async_op)
            want = torch.cat([data(p, case, count, dtype) for p in range(n)])
            check = lambda out=out, want=want, label=label: assert_same(out.cpu(), want, label)  # noqa: E731
        elif name == "reduce_scatter":
            out = torch.full((count,), 99, dtype=dtype, device=device)
            work = xelink.reduce_scatter_tensor(out, place(data(r, case, n * count, dtype, rop)), op=rop,
                                                group=comm, algo=algo, async_op=async_op)
            want = expected_reduce(n, case, count, dtype, rop, start=r * count)
            check = lambda out=out, want=want, label=label: assert_same(out.cpu(), want, label)  # noqa: E731
        elif name == "all_to_all":
            out = torch.full((n * count,), 99, dtype=dtype, device=device)
            work = xelink.all_to_all_single(out, place(data(r, case, n * count, dtype)), group=comm, algo=algo,
                                            async_op=async_op)
            want = torch.cat([data(p, case, count, dtype, start=r * count) for p in range(n)])
            check = lambda out=out, want=want, label=label: assert_same(out.cpu(), want, label)  # noqa: E731
        else:
            root = draw.randrange(n)
            x = data(r, case, count, dtype).to(device)
            work = xelink.broadcast(x, group=comm, async_op=async_op, group_src=root)
            want = data(root, case, count, dtype)
            check = lambda x=x, want=want, label=label: assert_same(x.cpu(), want, label)  # noqa: E731
        if async_op:
            pending.append((work, check))
            if len(pending) == 3 or draw.random() < 0.3:
                flush()
        else:
            check()
    flush()


# -- a real client: data-parallel training ----------------------------------------------------------

def mlp(sizes, g, scale):
    """Linear, Tanh, Linear of ``sizes`` (in, hidden, out), its parameters drawn from generator ``g`` times
    ``scale``."""
    model = torch.nn.Sequential(torch.nn.Linear(sizes[0], sizes[1]), torch.nn.Tanh(),
                                torch.nn.Linear(sizes[1], sizes[2]))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def train_mlp(steps, *, all_reduce=None, rank=0, size=1, device="cpu", seed=0):
    """SGD on a small MLP (32 -> 64 -> 10) for ``steps`` steps, float32; returns its parameters.

    With ``all_reduce(grad)`` (averaging over ``size`` ranks) rank ``rank`` trains on its
    1/size of every batch, data-parallel; without, one process trains on whole batches. The two give
    the same weights up to summation order.
    """
    g = torch.Generator().manual_seed(seed)
    model = mlp((32, 64, 10), g, 0.3).to(device)
    params = list(model.parameters())
    velocity = [torch.zeros_like(p) for p in params]
    batch = 60  # divisible by 1..6 ranks
    for _ in range(steps):
        x = torch.randn(batch, 32, generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)
        rows = slice(rank * batch // size, (rank + 1) * batch // size)
        loss = torch.nn.functional.cross_entropy(model(x[rows].to(device)), y[rows].to(device))
        for p in params:
            p.grad = None
        loss.backward()
        with torch.no_grad():
            for p, v in zip(params, velocity):
                if all_reduce is not None:
                    all_reduce(p.grad)
                v.mul_(0.9).add_(p.grad)  # SGD with momentum (torch.optim's first use costs a second)
                p.sub_(0.2 * v)
    return [p.detach().cpu() for p in params]


def compare_training(comm, algos, *, device="cpu", steps=30, tol=1e-5):
    """Data-parallel training with ``xelink.all_reduce(grad, op="avg", algo=a)`` for each ``a`` gives
    the weights of one process trained on the whole batches."""
    want = train_mlp(steps, device=device)
    for algo in algos:
        got = train_mlp(steps, rank=comm.rank, size=comm.size, device=device,
                        all_reduce=lambda t: xelink.all_reduce(t, op="avg", group=comm, algo=algo))
        err = max(float((a - b).abs().max()) for a, b in zip(got, want))
        assert err <= tol, f"data-parallel training with algo={algo!r} on {comm.size} ranks: weights differ " \
                           f"from one process's by {err:.3g} (> {tol:g})"


def ddp_training(world, device, tol=1e-5, hooks=False):
    """A data-parallel client written as a torch user writes one: every rank builds its own model, rank 0's
    parameters (leaves that require grad) are broadcast, each rank trains on its rows of every batch (shards of
    different sizes) with the gradients summed by all_reduce, and the loss is gathered as an object. The
    weights must equal one process's trained on whole batches from rank 0's start, up to summation order.
    ``device``: where the models and data live ("cpu" or this rank's CUDA device); ``tol``: on the weights;
    ``hooks``: each gradient's all-reduce starts in backward, as soon as the gradient is accumulated
    (``async_op=True``), and the step takes it from the handle's future, as DDP's communication hooks do."""
    n, r = xelink.get_world_size(world), xelink.get_rank(world)
    futures = {}

    def reduce_when_ready(p):  # backward still runs: the all-reduce of p.grad goes on beside it
        futures[p] = xelink.all_reduce(p.grad, async_op=True).get_future().then(lambda f: f.value()[0])

    def model(seed):
        return mlp((8, 16, 4), torch.Generator().manual_seed(seed), 0.5).to(device)

    ddp, ref = model(100 + r), model(100)  # each rank starts elsewhere until the broadcast
    for p in ddp.parameters():
        xelink.broadcast(p, 0)
        if hooks:
            p.register_post_accumulate_grad_hook(reduce_when_ready)
    assert all(p.requires_grad and p.grad_fn is None for p in ddp.parameters())
    data = torch.Generator().manual_seed(7)
    batch = 23  # a prime: the ranks' shards differ in size
    for _ in range(8):
        x = torch.randn(batch, 8, generator=data).to(device)
        y = torch.randint(0, 4, (batch,), generator=data).to(device)
        rows = slice(r * batch // n, (r + 1) * batch // n)
        for m, xs, ys, reduce in ((ddp, x[rows], y[rows], True), (ref, x, y, False)):
            loss = torch.nn.functional.cross_entropy(m(xs), ys, reduction="sum") / batch
            m.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in m.parameters():
                    if reduce and hooks:
                        grad = futures.pop(p).wait()
                        assert grad is p.grad  # the future's value: the tensor the call reduced in place
                    elif reduce:
                        xelink.all_reduce(p.grad)
                    p.sub_(0.5 * p.grad)
            if reduce:
                losses = [None] * n
                xelink.all_gather_object(losses, float(loss))
            else:
                assert abs(sum(losses) - float(loss)) < 1e-5, (sum(losses), float(loss))
    err = max(float((a - b).abs().max()) for a, b in zip(ddp.parameters(), ref.parameters()))
    assert err < tol, f"data-parallel weights on {device} differ from one process's by {err:.3g}"

"""Distributed GEMM on CPU ranks: every algorithm of all_gather_matmul, matmul_reduce_scatter and
matmul_all_reduce against all_gather + torch.matmul (computed on every rank from the same seeded shards),
exact on integer-valued float32 and bfloat16, close on random bfloat16; 2-D and 3-D, both gather/scatter
dims, lists of b, transposed b, tails of 0, 1 and 3 rows per rank, out=, return_gathered, back-to-back calls
that change shape, dtype and algorithm; flat and as packages (one rank each at 2, 2+1 at 3, 2x2 at 4).

Gradients (``gemm_grad``): real clients trained over the ranks against the same training in one process in
float64: a sequence-parallel MLP (all_gather_matmul of two weights sharing the gather, then
matmul_reduce_scatter; 3-D along the sequence and 2-D along the rows; nn.Linear-style transposed weights; every
algorithm and package layout; the gathered input in the loss; op="avg") and a tensor-parallel MLP
(matmul_all_reduce; the replicated loss divided by the ranks, the replicated input's gradient summed by the
user); and only some inputs requiring grad."""
import torch

import pytest

import xelink
from dist_cases import expect_errors, free, ints, layouts, weight
from ranks import only

WORLD_SIZES = (1, 2, 3, 4)
LAUNCH_TIMEOUT = 300
ALGOS = ("auto", "sequential", "pipelined", "topo")
LAYOUTS = {2: [[[0], [1]]], 3: [[[0, 1], [2]]], 4: [[[0, 1], [2, 3]]]}


def _same(got, want, what):
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{what}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}")
    if not torch.equal(got, want):
        bad = (got.float() != want.float()).nonzero()
        raise AssertionError(f"{what}: {bad.shape[0]} of {want.numel()} wrong, first at {bad[:3].tolist()}")


def _close(got, want, what, tol=2e-2):
    err = (got.double() - want.double()).norm() / max(want.double().norm().item(), 1e-30)
    if not err <= tol:
        raise AssertionError(f"{what}: relative error {err:.3g} > {tol}")


# -- all_gather_matmul ------------------------------------------------------------------------------

def _gather_case(comm, algo, shard_shape, dim, dtype, ns, transposed, salt, what):
    n, r = comm.size, comm.rank
    k = shard_shape[-1]
    shards = [ints(shard_shape, 100 * salt + q, dtype) for q in range(n)]
    weights = [weight(k, m, 7 + i + salt, dtype, transposed[i % len(transposed)]) for i, m in enumerate(ns)]
    a_full = torch.cat(shards, dim)
    many = len(ns) > 1
    got = xelink.all_gather_matmul(shards[r], weights if many else weights[0], group=comm, gather_dim=dim, algo=algo)
    got = got if many else [got]
    assert len(got) == len(ns), what
    for i, (c, w) in enumerate(zip(got, weights)):
        _same(c, a_full @ w, f"{what} b[{i}]")


def check_all_gather_matmul_every_algo(world):
    groups = layouts(world, LAYOUTS)
    for name, comm in groups:
        for algo in ALGOS:
            w = f"all_gather_matmul {name} {algo}"
            for rows in (1, 3, 0):
                _gather_case(comm, algo, (rows, 5), 0, torch.float32, [4], [False], rows, f"{w} 2-D rows={rows}")
            _gather_case(comm, algo, (3, 6), 0, torch.float32, [5], [True], 4, f"{w} transposed b")
            _gather_case(comm, algo, (2, 3, 5), 0, torch.float32, [4], [False], 5, f"{w} 3-D gather_dim=0")
            _gather_case(comm, algo, (2, 3, 5), 1, torch.float32, [4], [True], 6, f"{w} 3-D gather_dim=1")
            _gather_case(comm, algo, (2, 1, 5), -2, torch.float32, [3], [False], 7, f"{w} 3-D gather_dim=-2")
            _gather_case(comm, algo, (3, 8), 0, torch.float32, [4, 2, 6], [False, True], 8, f"{w} list of b")
            _gather_case(comm, algo, (2, 2, 8), 1, torch.bfloat16, [4, 3], [True, False], 9, f"{w} bf16 3-D list")
    free(groups)


def check_all_gather_matmul_random_bf16_and_float64(world):
    n, r = world.size, world.rank
    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float16, 5e-3), (torch.float64, 1e-12)):
        g = torch.Generator().manual_seed(11)
        shards = [torch.randn(5, 32, generator=g).to(dtype) for _ in range(n)]
        w = torch.randn(24, 32, generator=g).to(dtype).t()
        want = torch.cat(shards).double() @ w.double()
        for algo in ALGOS:
            _close(xelink.all_gather_matmul(shards[r], w, algo=algo), want, f"{dtype} {algo}", tol)


def check_all_gather_matmul_reference_is_the_gather(world):
    """The reference the other checks compute locally, built as the issue states it: xelink's all-gather,
    then torch.matmul, equal to every algorithm."""
    n = world.size
    a = ints((3, 5), 40 + world.rank)
    w = ints((5, 4), 41)
    full = torch.empty(3 * n, 5)
    xelink.all_gather_into_tensor(full, a)
    for algo in ALGOS:
        _same(xelink.all_gather_matmul(a, w, algo=algo), full @ w, f"vs all_gather {algo}")


def check_return_gathered_and_out(world):
    groups = layouts(world, LAYOUTS)
    n, r = world.size, world.rank
    for name, comm in groups:
        for algo in ALGOS:
            for dim, shape in ((0, (3, 4)), (1, (2, 3, 4))):
                shards = [ints(shape, 60 + q) for q in range(n)]
                ws = [ints((4, 5), 1), ints((2, 4), 2).t()]
                full = torch.cat(shards, dim)
                outs = [torch.full(tuple(full.shape[:-1]) + (m,), float("nan")) for m in (5, 2)]
                a_full, cs = xelink.all_gather_matmul(shards[r], ws, group=comm, gather_dim=dim, return_gathered=True,
                                                      algo=algo, out=outs)
                what = f"return_gathered/out {name} {algo} dim={dim}"
                _same(a_full, full, f"{what} a_full")
                assert all(c is o for c, o in zip(cs, outs)), f"{what}: out not returned"
                for c, w in zip(cs, ws):
                    _same(c, full @ w, what)
                # a strided out (a column block of a wider buffer)
                wide = torch.full(tuple(full.shape[:-1]) + (9,), float("nan"))
                c = xelink.all_gather_matmul(shards[r], ws[0], group=comm, gather_dim=dim, algo=algo,
                                             out=wide[..., 2:7])
                _same(wide[..., 2:7], full @ ws[0], f"{what} strided out")
                assert torch.isnan(wide[..., :2]).all() and torch.isnan(wide[..., 7:]).all(), what
    free(groups)


def check_back_to_back_calls_change_shape_dtype_and_algo(world):
    n, r = world.size, world.rank
    plan = [((4, 6), torch.float32, "pipelined"), ((1, 6), torch.bfloat16, "topo"), ((2, 3, 6), torch.float32, "auto"),
            ((5, 2), torch.float64, "sequential"), ((4, 6), torch.bfloat16, "pipelined"), ((3, 6), torch.float32, "topo")]
    for i, (shape, dtype, algo) in enumerate(plan):
        shards = [ints(shape, 80 + 10 * i + q, dtype) for q in range(n)]
        w = ints((shape[-1], 3), 90 + i, dtype)
        _same(xelink.all_gather_matmul(shards[r], w, algo=algo), torch.cat(shards) @ w, f"call {i} all_gather_matmul")
        a = ints(shape[:-1] + (shape[-1],), 200 + i + r, dtype)
        if a.shape[0] % n == 0:
            want = sum(ints(a.shape, 200 + i + q, dtype) @ w for q in range(n))
            _same(xelink.matmul_reduce_scatter(a, w, algo=algo), want.chunk(n)[r].contiguous(), f"call {i} rs")
        want = sum(ints(a.shape, 200 + i + q, dtype) @ w for q in range(n))
        _same(xelink.matmul_all_reduce(a, w, algo=algo), want, f"call {i} all_reduce")


# -- matmul_reduce_scatter / matmul_all_reduce --------------------------------------------------------

def _partials(n, shape, k, m, salt, dtype, transposed):
    aa = [ints(shape + (k,), 300 + 10 * salt + q, dtype) for q in range(n)]
    w = weight(k, m, 301 + salt, dtype, transposed)
    return aa, w, sum(x.float() @ w.float() for x in aa)


def check_matmul_reduce_scatter_every_algo(world):
    groups = layouts(world, LAYOUTS)
    n, r = world.size, world.rank
    for name, comm in groups:
        for algo in ALGOS:
            cases = [((n, ), 0, torch.float32, False, "sum"), ((3 * n,), 0, torch.float32, True, "sum"),
                     ((n, 3), 0, torch.float32, False, "sum"), ((2, 2 * n), 1, torch.float32, True, "sum"),
                     ((2, n), -2, torch.bfloat16, True, "sum"), ((2 * n,), 0, torch.bfloat16, False, "avg"),
                     ((0,), 0, torch.float32, False, "sum")]
            for salt, (shape, dim, dtype, transposed, op) in enumerate(cases):
                aa, w, total = _partials(n, shape, 5, 4, salt, dtype, transposed)
                what = f"matmul_reduce_scatter {name} {algo} {shape} dim={dim} {dtype} {op}"
                want = total.chunk(n, dim)[r] if total.shape[dim] else total
                if op == "avg":
                    want = want / n
                got = xelink.matmul_reduce_scatter(aa[r], w, group=comm, scatter_dim=dim, op=op, algo=algo)
                _same(got, want.to(dtype).contiguous(), what)
            aa, w, total = _partials(n, (2 * n,), 6, 3, 9, torch.float32, False)
            out = torch.full((2, 3), float("nan"))
            got = xelink.matmul_reduce_scatter(aa[r], w, group=comm, algo=algo, out=out)
            assert got is out
            _same(out, total.chunk(n)[r], f"matmul_reduce_scatter {name} {algo} out=")
    free(groups)


def check_matmul_all_reduce_every_algo(world):
    groups = layouts(world, LAYOUTS)
    n, r = world.size, world.rank
    for name, comm in groups:
        for algo in ALGOS:
            for salt, (shape, dtype, transposed) in enumerate((((7,), torch.float32, False), ((1,), torch.float32, True),
                                                               ((2, 5), torch.bfloat16, True), ((0,), torch.float32, False),
                                                               ((9,), torch.float64, False))):
                aa, w, total = _partials(n, shape, 5, 4, 20 + salt, dtype, transposed)
                got = xelink.matmul_all_reduce(aa[r], w, group=comm, algo=algo)
                _same(got, total.to(dtype), f"matmul_all_reduce {name} {algo} {shape} {dtype}")
            aa, w, total = _partials(n, (6,), 5, 4, 30, torch.float32, False)
            wide = torch.full((6, 8), float("nan"))
            got = xelink.matmul_all_reduce(aa[r], w, group=comm, algo=algo, out=wide[:, 1:5])
            _same(wide[:, 1:5], total, f"matmul_all_reduce {name} {algo} strided out")
    free(groups)


def check_calls_that_differ_are_refused_with_check_calls(world):
    """XELINK_CHECK's fingerprint: rank 0 passes another shard shape, or alone a weight that requires grad;
    every rank raises before any byte moves, and the group still works afterwards."""
    if world.size == 1:
        return
    sub = world.split(0)
    sub.check_calls = True
    w = torch.ones(4, 3)
    a = torch.ones(2 * sub.size, 4)
    odd = torch.ones(3 if sub.rank == 0 else 2, 4)
    # Only rank 0's weight requires grad: its backward would wait for collectives the others never make.
    wg = torch.ones(4, 3, requires_grad=sub.rank == 0)
    for what, call in (("shard shapes", lambda: xelink.all_gather_matmul(odd, w, group=sub)),
                       ("shard shapes", lambda: xelink.matmul_all_reduce(odd, w, group=sub)),
                       ("requires_grad", lambda: xelink.all_gather_matmul(a, wg, group=sub)),
                       ("requires_grad", lambda: xelink.matmul_reduce_scatter(a, wg, group=sub))):
        try:
            call()
        except ValueError as e:
            assert "ranks disagree about the call" in str(e), str(e)
        else:
            raise AssertionError(f"ranks that differ in {what} were not detected")
    _same(xelink.all_gather_matmul(a, w, group=sub), torch.full((2 * sub.size ** 2, 3), 4.0), "after the refusal")
    sub.free()


def check_bad_inputs_raise_before_sending(world):
    """A scatter dim that the group size does not divide, and the other refusals at this size: every rank
    raises the same error before anything is sent, and a correct call right after still matches."""
    n = world.size
    w = torch.ones(4, 3)
    cases = [(lambda: xelink.matmul_reduce_scatter(torch.ones(n + 1, 4), w), ValueError,
              f"matmul_reduce_scatter: a.shape[0]={n + 1} (scatter_dim=0) is not divisible by the group size {n}"),
             (lambda: xelink.matmul_reduce_scatter(torch.ones(2, 2 * n + 1, 4), w, scatter_dim=1), ValueError,
              f"a.shape[1]={2 * n + 1} (scatter_dim=1) is not divisible"),
             (lambda: xelink.all_gather_matmul(torch.ones(2, 4), torch.ones(3, 3)), ValueError, "b.shape[0]=3"),
             (lambda: xelink.all_gather_matmul(torch.ones(2, 4), w, out=torch.ones(2 * n + 1, 3)), ValueError,
              f"out.shape=({2 * n + 1}, 3) != ({2 * n}, 3)"),
             (lambda: xelink.matmul_all_reduce(torch.ones(2, 4), w, algo="fused"), ValueError,
              "matmul_all_reduce: algo='fused' is a GPU kernel and runs on CUDA tensors"),
             (lambda: xelink.matmul_reduce_scatter(torch.ones(2 * n, 4), w, algo="fused"), ValueError,
              "matmul_reduce_scatter: algo='fused' is a GPU kernel and runs on CUDA tensors"),
             (lambda: xelink.all_gather_matmul(torch.ones(2, 4), w, algo="fused"), ValueError,
              "algo='fused' is a GPU kernel and runs on CUDA tensors")]
    if n == 1:
        cases = cases[2:]  # every size divides by 1
    expect_errors(cases)
    a = ints((2 * n, 4), 500 + world.rank)
    want = sum(ints((2 * n, 4), 500 + q) @ w for q in range(n))
    _same(xelink.matmul_reduce_scatter(a, w), want.chunk(n)[world.rank].contiguous(), "after the refusals")


def check_grad_with_out_and_aliased_outputs_are_refused_before_sending(world):
    """out= with an input that requires grad (an nn.Linear's weight, in grad mode: out= is not differentiable)
    and an out= that shares memory with an input, with another out or with itself (expanded): refused by name on
    every rank before any message (an aliased out was written while still read: wrong sums); the same calls
    under no_grad or with a separate out work."""
    n = world.size
    lin = torch.nn.Linear(4, 3, bias=False)
    a = ints((2, 4), 800 + world.rank)
    sq = ints((2, 4), 810 + world.rank)
    w4 = ints((4, 4), 820)
    big = torch.zeros(4 + 2 * n, 4)
    cases = [(lambda: xelink.all_gather_matmul(a, lin.weight.t(), out=torch.empty(2 * n, 3)), ValueError,
              "all_gather_matmul: out= is not differentiable, and an input requires grad"),
             (lambda: xelink.matmul_all_reduce(a, lin.weight.t(), out=torch.empty(2, 3)), ValueError,
              "matmul_all_reduce: out= is not differentiable"),
             (lambda: xelink.matmul_reduce_scatter(a.repeat(n, 1).requires_grad_(), w4, out=torch.empty(2, 4)),
              ValueError, "matmul_reduce_scatter: out= is not differentiable"),
             (lambda: xelink.matmul_all_reduce(sq, w4, out=sq), ValueError,
              "matmul_all_reduce: out overlaps a in memory"),
             (lambda: xelink.all_gather_matmul(a, big[:4], out=big[2:2 + 2 * n]), ValueError,
              "all_gather_matmul: out overlaps b in memory"),
             (lambda: xelink.all_gather_matmul(a, [w4, w4], out=[big[4:4 + 2 * n]] * 2), ValueError,
              "all_gather_matmul: out overlaps out[1] in memory"),
             (lambda: xelink.matmul_all_reduce(a, w4, out=torch.zeros(1, 4).expand(2, 4)), ValueError,
              "matmul_all_reduce: out.stride()=(0, 1) for out.shape=(2, 4) puts several elements")]
    expect_errors(cases)
    with torch.no_grad():
        got = xelink.all_gather_matmul(a, lin.weight.t())
    want = torch.cat([ints((2, 4), 800 + q) for q in range(n)]) @ lin.weight.detach().t()
    _close(got, want, "all_gather_matmul of an nn.Linear weight under no_grad", tol=1e-5)
    out = torch.empty(2, 4)
    _same(xelink.matmul_all_reduce(sq, w4, out=out), sum(ints((2, 4), 810 + q) for q in range(n)) @ w4,
          "matmul_all_reduce into a separate out after the refusals")


@only(launchers=("mpi",), sizes=(2, 3))
def check_an_error_part_way_fails_the_group(world):
    """An error inside a CPU schedule after its messages were posted (rank 0's matmul raises): that rank's next
    call on the group raises at once (the group refuses further use) instead of waiting for messages that
    never come; the other ranks' waits expire naming a rank, or raise the same; a new group works."""
    import xelink.dist.host as host

    sub = world.split(0)
    sub.timeout = 2.0  # (read by the group's private duplicate, made on the first call)
    a, w = ints((2, 4), 900 + world.rank), ints((4, 3), 901)
    mm = host._mm_into

    def broken(x, y, dst):
        raise RuntimeError("injected")

    if world.rank == 0:
        host._mm_into = broken
    try:
        try:
            xelink.all_gather_matmul(a, w, group=sub, algo="pipelined")
            assert world.rank != 0, "the injected error did not surface"
        except xelink.TimeoutError:
            assert world.rank != 0  # a rank waiting on rank 0's forwards
        except RuntimeError as e:
            assert world.rank == 0 and "injected" in str(e), str(e)
    finally:
        host._mm_into = mm
    with pytest.raises((xelink.XelinkError, xelink.TimeoutError)) as info:
        xelink.all_gather_matmul(a, w, group=sub, algo="pipelined")
    if world.rank == 0:
        assert "unusable after an earlier failure" in str(info.value), str(info.value)
    sub.free()
    fresh = world.split(0)
    want = torch.cat([ints((2, 4), 900 + q) for q in range(world.size)]) @ w
    _same(xelink.all_gather_matmul(a, w, group=fresh, algo="pipelined"), want, "a new group after the failure")
    fresh.free()


# -- autograd ---------------------------------------------------------------------------------------

def _sgd(params, lr=0.05):
    with torch.no_grad():
        for p in params:
            p -= lr * p.grad
            p.grad = None


def _sp_mlp(comm, algo, dims3, use_gathered, op, steps=2):
    """Sequence-parallel MLP y = (relu(x W1) * (x W3)) W2, x split along the sequence (rows), W1/W3 by columns
    and W2 by rows (nn.Linear weights, used transposed), trained ``steps`` SGD steps on every rank's share of
    the loss, against one process: the rank's slices of the weights and of x's gradient must match."""
    n, r = comm.size, comm.rank
    g = torch.Generator().manual_seed(31 + 7 * n)
    S, H, F = 3 * n, 6, 2 * n
    x = torch.randn((2, S, H) if dims3 else (S, H), generator=g, dtype=torch.float64)
    lin = {name: torch.randn(shape, generator=g, dtype=torch.float64) * 0.5
           for name, shape in (("w1", (F, H)), ("w3", (F, H)), ("w2", (H, F)))}
    dim = x.dim() - 2
    cols = slice(r * (F // n), (r + 1) * (F // n))
    rows = slice(r * (S // n), (r + 1) * (S // n))
    one = {k: t.clone().requires_grad_() for k, t in lin.items()}
    ours = {"w1": lin["w1"][cols].clone().requires_grad_(), "w3": lin["w3"][cols].clone().requires_grad_(),
            "w2": lin["w2"][:, cols].clone().requires_grad_()}
    xo, xs = x.clone().requires_grad_(), x.narrow(dim, rows.start, S // n).clone().requires_grad_()
    scale = 1.0 / n if op == "avg" else 1.0
    for step in range(steps):
        y = (torch.relu(xo @ one["w1"].t()) * (xo @ one["w3"].t())) @ one["w2"].t() * scale
        loss = (y ** 2).sum() + (xo.pow(3).sum() if use_gathered else 0)
        loss.backward()
        got = xelink.all_gather_matmul(xs, [ours["w1"].t(), ours["w3"].t()], group=comm, gather_dim=dim,
                                       algo=algo, return_gathered=use_gathered)
        a_full, (h1, h3) = got if use_gathered else (None, got)
        ys = xelink.matmul_reduce_scatter(torch.relu(h1) * h3, ours["w2"].t(), group=comm, scatter_dim=dim, op=op,
                                          algo=algo)
        mine = (ys ** 2).sum()
        if use_gathered:  # every rank holds all of x: its share of the cube is 1/n of it
            mine = mine + a_full.pow(3).sum() / n
        mine.backward()
        what = f"{algo} 3-D={dims3} gathered={use_gathered} {op} step {step}"
        _close(xs.grad, xo.grad.narrow(dim, rows.start, S // n), f"{what} dx", 1e-10)
        for k, want in (("w1", one["w1"].grad[cols]), ("w3", one["w3"].grad[cols]), ("w2", one["w2"].grad[:, cols])):
            _close(ours[k].grad, want, f"{what} d{k}", 1e-10)
        _sgd(list(one.values()) + [xo])
        _sgd(list(ours.values()) + [xs])


def check_sequence_parallel_training_matches_one_process(world):
    groups = layouts(world, LAYOUTS)
    for name, comm in groups:
        for algo in ALGOS:
            try:
                _sp_mlp(comm, algo, True, False, "sum")
                _sp_mlp(comm, algo, False, True, "sum")
            except AssertionError as e:
                raise AssertionError(f"{name}: {e}") from None
    _sp_mlp(world, "auto", True, True, "avg")
    free(groups)


def check_tensor_parallel_training_matches_one_process(world):
    """A tensor-parallel MLP: x replicated, W1 split by columns, W2 by rows, the output summed by
    matmul_all_reduce (its backward an all_reduce of the output's gradient), the loss computed alike on every
    rank and so divided by their number (the sum of the ranks' losses is one loss); x's gradient, a replicated
    tensor's, summed by the user; weights after SGD steps equal one process's."""
    n, r = world.size, world.rank
    g = torch.Generator().manual_seed(77)
    H, F = 5, 3 * n
    x = torch.randn(2, 4, H, generator=g, dtype=torch.float64)
    w1, w2 = torch.randn(H, F, generator=g, dtype=torch.float64), torch.randn(F, H, generator=g, dtype=torch.float64)
    cols = slice(r * 3, r * 3 + 3)
    one = [t.clone().requires_grad_() for t in (x, w1, w2)]
    ours = [x.clone().requires_grad_(), w1[:, cols].clone().requires_grad_(), w2[cols].clone().requires_grad_()]
    for step, algo in enumerate(ALGOS):
        (torch.tanh(torch.tanh(one[0] @ one[1]) @ one[2]) ** 2).sum().backward()
        y = xelink.matmul_all_reduce(torch.tanh(ours[0] @ ours[1]), ours[2], algo=algo)
        ((torch.tanh(y) ** 2).sum() / n).backward()
        xelink.all_reduce(ours[0].grad)
        for what, got, want in (("dx", ours[0].grad, one[0].grad), ("dw1", ours[1].grad, one[1].grad[:, cols]),
                                ("dw2", ours[2].grad, one[2].grad[cols])):
            _close(got, want, f"{algo} step {step} {what}", 1e-10)
        _sgd(one)
        _sgd(ours)


def check_gradients_of_some_inputs_only(world):
    """Only the weight, or only the input, requires grad (a frozen layer; data that needs no gradient): the
    others get none, the ones asked for are right."""
    n, r = world.size, world.rank
    a = ints((2, 4), 900 + r, torch.float64)
    b = ints((4, 3), 901, torch.float64)
    a_all = torch.cat([ints((2, 4), 900 + q, torch.float64) for q in range(n)])
    bw = b.clone().requires_grad_()
    xelink.all_gather_matmul(a, bw).sum().backward()
    _same(bw.grad, a_all.t() @ torch.ones(2 * n, 3, dtype=torch.float64), "all_gather_matmul db alone")
    aw = a.clone().requires_grad_()
    c = xelink.all_gather_matmul(aw, b)
    assert c.requires_grad and c.grad_fn is not None
    c.sum().backward()
    _same(aw.grad, n * torch.ones(2, 3, dtype=torch.float64) @ b.t(), "all_gather_matmul da alone")
    parts = ints((2 * n, 4), 910 + r, torch.float64)
    bw = b.clone().requires_grad_()
    xelink.matmul_reduce_scatter(parts, bw).sum().backward()
    _same(bw.grad, parts.t() @ torch.ones(2 * n, 3, dtype=torch.float64), "matmul_reduce_scatter db alone")
    with torch.no_grad():
        c = xelink.matmul_reduce_scatter(parts, bw)
    assert c.grad_fn is None and not c.requires_grad

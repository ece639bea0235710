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


def data(rank, case, count, dtype, op="sum"):
    """Small integers in [-3, 3] (for prod: 1, 2, -1), different per rank, case and position."""
    block = _block(rank, case, op)
    return block.repeat(count // _PERIOD + 1)[:count].to(dtype)


def expected_reduce(n, case, count, dtype, op):
    """op over the n ranks' inputs, exact in int64 (avg rounded once from float64, like float32 accumulation)."""
    acc = data(0, case, count, torch.int64, op)
    for p in range(1, n):
        x = data(p, case, count, torch.int64, op)
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
                    full = expected_reduce(n, case, n * count, dtype, op)
                    want = full[r * count:(r + 1) * count]
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
            xelink.broadcast(x, src=root, group=comm)
            assert_same(x, torch.full((7,), root, dtype=torch.int64).to(dtype), f"broadcast {dtype} root={root}")
            x = torch.full((7,), r + 1, dtype=torch.int64).to(dtype)
            xelink.reduce(x, dst=root, op="sum", group=comm)
            if r == root:
                assert_same(x, torch.full((7,), n * (n + 1) // 2, dtype=torch.int64).to(dtype), f"reduce {dtype}")
            lst = [torch.empty(3, dtype=dtype) for _ in range(n)] if r == root else None
            xelink.gather(torch.full((3,), r, dtype=torch.int64).to(dtype), lst, dst=root, group=comm)
            if r == root:
                assert_same(torch.stack(lst), torch.arange(n).repeat_interleave(3).view(n, 3).to(dtype), "gather")
            lst = [torch.full((3,), p * 2, dtype=torch.int64).to(dtype) for p in range(n)] if r == root else None
            y = torch.empty(3, dtype=dtype)
            xelink.scatter(y, lst, src=root, group=comm)
            assert_same(y, torch.full((3,), 2 * r, dtype=torch.int64).to(dtype), "scatter")
            outs = [torch.empty(2, dtype=dtype) for _ in range(n)]
            xelink.all_gather(outs, torch.full((2,), r, dtype=torch.int64).to(dtype), group=comm)
            assert_same(torch.stack(outs), torch.arange(n).repeat_interleave(2).view(n, 2).to(dtype), "all_gather list")

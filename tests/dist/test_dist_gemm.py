"""Distributed GEMM without ranks: bad input is refused with the function and the value named (world size 1,
nothing is sent), the schedules' plans are sound on every layout, and auto's rule."""
import types

import pytest
import torch

import xelink
from xelink.dist import schedule
from xelink.dist.gemm import auto_algo


@pytest.fixture()
def world():
    w = xelink.init()
    yield w
    xelink.finalize()


A = torch.ones(4, 5)
B = torch.ones(5, 3)

BAD = [
    (lambda: xelink.all_gather_matmul(A, torch.ones(4, 3)), ValueError,
     r"all_gather_matmul: b.shape\[0\]=4 != a.shape\[-1\]=5"),
    (lambda: xelink.all_gather_matmul(A, B.double()), TypeError, r"all_gather_matmul: b.dtype=torch.float64 != a.dtype"),
    (lambda: xelink.all_gather_matmul(A.int(), B.int()), TypeError, r"a_shard.dtype=torch.int32 is not supported"),
    (lambda: xelink.all_gather_matmul(torch.ones(5), B), ValueError, r"a_shard must be 2-D or 3-D, got shape \(5,\)"),
    (lambda: xelink.all_gather_matmul(A, torch.ones(5, 3, 1)), ValueError, r"all_gather_matmul: b must be 2-D"),
    (lambda: xelink.all_gather_matmul(A, "b"), TypeError, r"all_gather_matmul: b must be a torch.Tensor, got str"),
    (lambda: xelink.all_gather_matmul(A, []), ValueError, r"all_gather_matmul: b is an empty list"),
    (lambda: xelink.all_gather_matmul(A, [B, torch.ones(4, 2)]), ValueError, r"b\[1\].shape\[0\]=4 != a.shape\[-1\]=5"),
    (lambda: xelink.all_gather_matmul(A, B, gather_dim=1), ValueError,
     r"all_gather_matmul: gather_dim=1 is not valid for a 2-D input of shape \(4, 5\) \(one of 0; the last dim is K\)"),
    (lambda: xelink.all_gather_matmul(torch.ones(2, 4, 5), B, gather_dim=2), ValueError, r"gather_dim=2 is not valid"),
    (lambda: xelink.all_gather_matmul(torch.ones(2, 4, 5), B, gather_dim=-1), ValueError, r"gather_dim=-1 is not valid"),
    (lambda: xelink.all_gather_matmul(A, B, gather_dim=True), TypeError, r"gather_dim=True must be an int"),
    (lambda: xelink.all_gather_matmul(A, B, algo="fused"), ValueError, r"all_gather_matmul: algo='fused' is a GPU kernel and runs on CUDA tensors"),
    (lambda: xelink.all_gather_matmul(A, B, algo="ring"), ValueError,
     r"all_gather_matmul: algo='ring' is not one of auto, sequential, pipelined, topo, fused"),
    (lambda: xelink.all_gather_matmul(A, B, out=torch.ones(4, 4)), ValueError,
     r"all_gather_matmul: out.shape=\(4, 4\) != \(4, 3\), the shape of the result"),
    (lambda: xelink.all_gather_matmul(A, B, out=torch.ones(4, 3, dtype=torch.bfloat16)), TypeError, r"out.dtype"),
    (lambda: xelink.all_gather_matmul(A, [B, B], out=torch.ones(4, 3)), ValueError,
     r"out must be a list of 2 tensors \(one per b\), got Tensor"),
    (lambda: xelink.all_gather_matmul(A, [B, B], out=[torch.ones(4, 3), torch.ones(3, 3)]), ValueError,
     r"out\[1\].shape=\(3, 3\) != \(4, 3\)"),
    (lambda: xelink.all_gather_matmul(A.to("meta"), B.to("meta")), ValueError, r"a_shard is on meta"),
    (lambda: xelink.all_gather_matmul(A, B.to("meta")), ValueError, r"b is on meta"),
    (lambda: xelink.all_gather_matmul(A, B, group="w"), TypeError, r"all_gather_matmul: group='w' is not an xelink"),
    (lambda: xelink.matmul_reduce_scatter(A, [B]), TypeError, r"matmul_reduce_scatter: b must be one \[K, N\] tensor"),
    (lambda: xelink.matmul_reduce_scatter(A, B, op="max"), ValueError,
     r"matmul_reduce_scatter: op='max' is not supported here; use 'sum' or 'avg'"),
    (lambda: xelink.matmul_reduce_scatter(A, B, op="median"), ValueError, r"matmul_reduce_scatter: op='median'"),
    (lambda: xelink.matmul_reduce_scatter(A, B, scatter_dim=1), ValueError, r"matmul_reduce_scatter: scatter_dim=1"),
    (lambda: xelink.matmul_reduce_scatter(A, B, out=torch.ones(2, 3)), ValueError, r"out.shape=\(2, 3\) != \(4, 3\)"),
    (lambda: xelink.matmul_reduce_scatter(A, B.half()), TypeError, r"matmul_reduce_scatter: b.dtype=torch.float16"),
    (lambda: xelink.matmul_all_reduce(A, B, algo="fused"), ValueError, r"matmul_all_reduce: algo='fused'"),
    (lambda: xelink.matmul_reduce_scatter(A, B, algo="fused"), ValueError,
     r"matmul_reduce_scatter: algo='fused' is a GPU kernel and runs on CUDA tensors"),
    (lambda: xelink.matmul_all_reduce(A, torch.ones(3, 3)), ValueError, r"matmul_all_reduce: b.shape\[0\]=3"),
    (lambda: xelink.matmul_all_reduce(torch.ones(2, 2, 2, 5), B), ValueError, r"matmul_all_reduce: a must be 2-D or 3-D"),
    (lambda: xelink.matmul_all_reduce(A, B, out=torch.ones(4, 3, 1)), ValueError, r"matmul_all_reduce: out.shape"),
]


@pytest.mark.parametrize("call,exc,match", BAD, ids=range(len(BAD)))
def test_bad_input_is_refused(world, call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_world_size_one_is_a_local_matmul(world):
    a, w = torch.randn(3, 2, 5), torch.randn(4, 5).t()
    for algo in ("auto", "sequential", "pipelined", "topo"):
        a_full, c = xelink.all_gather_matmul(a, [w], gather_dim=1, return_gathered=True, algo=algo)
        assert a_full is a and torch.equal(c[0], a @ w)
        assert torch.equal(xelink.matmul_reduce_scatter(a, w, scatter_dim=1, algo=algo), a @ w)
        out = torch.empty(3, 2, 4)
        assert xelink.matmul_all_reduce(a, w, algo=algo, out=out) is out and torch.equal(out, a @ w)
    assert xelink.DIST_GEMM_ALGOS == ("sequential", "pipelined", "topo", "fused")


LAYOUTS = [[[0]], [[0, 1]], [[0], [1]], [[0, 1], [2]], [[0], [1, 2]], [[0, 1], [2, 3]], [[0, 1, 2], [3, 4]],
           [[0, 1, 2], [3], [4, 5]], [[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 3], [1, 2]]]


@pytest.mark.parametrize("packages", LAYOUTS, ids=str)
def test_topo_plan_gets_every_shard_once_and_crosses_once_per_remote_package(packages):
    reads = schedule.topo_plan(packages)
    schedule.check_plan(reads)
    n = len(reads)
    for q in range(n):
        home, _ = schedule.package_index(packages, q)
        for p, members in enumerate(packages):
            if p == home:
                continue
            # shard q enters package p exactly once (from outside it), and every other member takes it inside
            crossings = [x for x in members if (q, q) in reads[x]]
            assert len(crossings) == 1, (q, p, crossings)
            for x in members:
                if x != crossings[0]:
                    assert (q, crossings[0]) in reads[x], (q, x)
    for x in range(n):  # own package first, then the remote ones
        p, _ = schedule.package_index(packages, x)
        kinds = [schedule.package_index(packages, q)[0] == p for q, _ in reads[x]]
        assert kinds == sorted(kinds, reverse=True), (x, reads[x])


@pytest.mark.parametrize("n", range(1, 9))
def test_ring_and_direct_plans_are_sound(n):
    schedule.check_plan(schedule.ring_plan(n))
    schedule.check_plan(schedule.direct_plan(n))
    assert all(src == (x - 1) % n for x, r in enumerate(schedule.ring_plan(n)) for _, src in r)


def test_check_plan_refuses_an_unsound_plan():
    with pytest.raises(ValueError, match="not every other shard"):
        schedule.check_plan([[(1, 1)], []])
    with pytest.raises(ValueError, match=r"takes \[2, 1\] from rank 1, which holds them in the order \[1, 0, 2\]"):
        schedule.check_plan([[(2, 1), (1, 1)], [(0, 0), (2, 2)], [(0, 0), (1, 1)]])


def test_aggregators_are_members_of_the_own_package():
    packages = [[0, 1, 2], [3], [4, 5]]
    for p, members in enumerate(packages):
        for dst in range(6):
            if dst not in members:
                assert schedule.aggregator(packages, p, dst) in members
    assert schedule.aggregator(packages, 0, 5) == 1 and schedule.aggregator(packages, 1, 5) == 3


def test_auto_picks_topo_only_for_packages_of_several_ranks():
    comm = lambda packages: types.SimpleNamespace(packages=packages)  # noqa: E731
    assert auto_algo(comm([[0, 1, 2, 3]])) == "pipelined"
    assert auto_algo(comm([[0], [1], [2]])) == "pipelined"
    assert auto_algo(comm([[0, 1], [2]])) == "topo"
    assert auto_algo(comm([[0, 1], [2, 3]])) == "topo"


def test_the_cuda_module_imports_without_a_gpu():
    import xelink.dist.device as device

    assert {device.READY, device.FREE, device.RS_READY, device.RS_FREE} <= set(range(xelink.symm.SIGNAL_SLOTS))


def test_fused_reduce_scatter_layout_and_reasons():
    from xelink.dist import device

    assert device._scatter_layout((8, 5), 0, 2) == (1, 4, 4, 0)           # 2-D: one row block per owner
    assert device._scatter_layout((4, 6, 5), 0, 2) == (1, 12, 12, 0)      # [B, S, K] along B: B/n * S rows
    assert device._scatter_layout((3, 6, 5), 1, 2) == (3, 3, 3, 6)        # along S: B sub-blocks of S/n rows
    assert "float16 or bfloat16" in device.fused_scatter_unmet(torch.ones(4, 4))
    assert device.fused_scatter_unmet(torch.ones(4, 4).half()) is None
    why = device.fused_all_reduce_unmet(torch.ones(3, 4).half(), 2)
    assert "rows (prod of a.shape[:-1] = 3) divisible by the group size 2" in why
    assert device.fused_all_reduce_unmet(torch.ones(2, 3, 4).half(), 2) is None

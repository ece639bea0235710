"""The one table of algorithms: every backend's algorithms priced by the cost model, the public views
derived from it, and auto choosing only what is registered and can run."""
import pytest
import torch

from xelink import cost
from xelink import topology as T
from xelink.collectives import ALGORITHMS, GPU_ALGORITHMS, registry


def test_every_registered_algorithm_is_priced_by_the_cost_model():
    t = T.load("cpu-2x2")
    for backend in registry.backends():
        for op in registry.OPS:
            for algo in registry.algorithms(op, backend):
                assert algo.schedule in cost.ALGOS[op], algo
                p = cost.predict(t, 4, op, algo.schedule, 1 << 20)
                assert p.time_s > 0, algo


def test_the_model_prices_no_schedule_that_nothing_runs():
    runs = {(a.op, a.schedule) for b in registry.backends() for op in registry.OPS for a in registry.algorithms(op, b)}
    for op, schedules in cost.ALGOS.items():
        for s in schedules:
            assert (op, s) in runs, f"the cost model prices {op} {s!r}, which no registered algorithm runs"


def test_public_lists_are_views_of_the_registry():
    assert ALGORITHMS == registry.names("cpu") and GPU_ALGORITHMS == registry.names("cuda")
    assert ALGORITHMS["all_reduce"] == ("ring", "direct", "two_shot", "hierarchical")
    assert set(registry.backends()) == {"cpu", "cuda"}


def test_one_name_one_schedule_across_backends():
    """Where both backends register a name, it runs the same schedule (hierarchical included)."""
    for op in registry.OPS:
        cpu = {a.name: a.schedule for a in registry.algorithms(op, "cpu")}
        cuda = {a.name: a.schedule for a in registry.algorithms(op, "cuda")}
        for name in set(cpu) & set(cuda):
            assert cpu[name] == cuda[name], (op, name, cpu[name], cuda[name])
    assert registry.get("t", "all_reduce", "hierarchical", "cuda").schedule == "hierarchical"


def test_aliases_and_unknown_names():
    assert registry.get("t", "reduce_scatter", "dest_split", "cuda").name == "direct"  # the CPU name of it
    with pytest.raises(ValueError, match=r"all_reduce: algo='tree' is not one of auto, ring, direct, two_shot, "
                                         r"hierarchical$"):
        registry.get("all_reduce", "all_reduce", "tree", "cpu")
    with pytest.raises(ValueError, match=r"for CUDA tensors"):
        registry.get("all_gather", "all_gather", "ring", "cuda")


def test_registration_is_checked():
    with pytest.raises(ValueError, match=r"register: cpu all_reduce 'ring' is registered already"):
        registry.register("all_reduce", "ring", "cpu", lambda *a: None)
    with pytest.raises(ValueError, match=r"runs schedule 'tree', which the cost model does not price"):
        registry.register("all_reduce", "tree", "cpu", lambda *a: None)
    with pytest.raises(ValueError, match=r"register: op='gossip'"):
        registry.register("gossip", "x", "cpu", lambda *a: None)
    with pytest.raises(ValueError, match=r"needs=\['fast'\]"):
        registry.register("all_reduce", "x", "cpu", lambda *a: None, schedule="ring", needs=("fast",))
    assert "x" not in registry.names("cpu")["all_reduce"] and "tree" not in registry.names("cpu")["all_reduce"]


def test_cpu_tensors_have_no_broadcast_on_cuda():
    from xelink.collectives import dispatch

    with pytest.raises(ValueError, match=r"broadcast: CUDA tensors are not supported by this op"):
        dispatch.resolve("broadcast", "broadcast", "auto", None, "cuda", 8, torch.float32)

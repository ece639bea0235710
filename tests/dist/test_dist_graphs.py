"""The policy of the remembered schedules (``xelink.dist.graphs``) on CPU, with a fake CUDA graph that records
what was captured and replayed: the first call of a key runs eagerly, the second captures and replays, later
ones replay; a capture that fails runs eagerly from then on; at most XELINK_DIST_GRAPHS graphs, a new key
taking the place of a stale one only (a loop over more keys than that never captures twice); 0 and a
capturing stream run eagerly. The real graphs run in tests/dist/ranks_gpu_dist_gemm.py."""
import contextlib

import pytest
import torch

from xelink.dist import graphs


class FakeGraph:
    capturing = False
    fail = False
    pool = 0  # bytes the next capture's pool takes
    reserved = 0  # what torch.cuda.memory_reserved says

    def __init__(self):
        self.replays = 0

    def capture_begin(self, capture_error_mode="global"):
        assert capture_error_mode == "thread_local"
        FakeGraph.capturing = True

    def capture_end(self):
        FakeGraph.capturing = False
        FakeGraph.reserved += FakeGraph.pool
        if FakeGraph.fail:
            raise RuntimeError("operation not permitted when stream is capturing")

    def replay(self):
        self.replays += 1


class FakeComm:
    def __init__(self):
        self.res = {}

    def resource(self, key, make=None):
        if key not in self.res and make is not None:
            self.res[key] = make()
        return self.res.get(key)


class FakeTeam:
    checked = 0

    def check(self, fn):
        FakeTeam.checked += 1


@pytest.fixture()
def fake(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: object())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: FakeGraph.capturing)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: FakeGraph.reserved)
    monkeypatch.setattr(graphs.symm, "team_of", lambda comm: FakeTeam())
    monkeypatch.delenv("XELINK_DIST_GRAPHS", raising=False)
    monkeypatch.delenv("XELINK_DIST_GRAPH_MB", raising=False)
    FakeGraph.fail, FakeGraph.pool = False, 0
    comm = FakeComm()
    runs = []

    def call(key):
        graphs.run(comm, "cuda:0", "op", key, lambda: runs.append((key, FakeGraph.capturing)))
        return comm.resource(("xelink.dist", "graphs", "cuda:0"))

    return call, runs


def test_first_call_eager_second_captures_and_replays_later_replay(fake):
    call, runs = fake
    gs = call("k")
    assert runs == [("k", False)] and not gs.graphs
    call("k")
    assert runs[1] == ("k", True) and gs.graphs["k"][0].replays == 1 and gs.replays == 1
    call("k")
    call("k")
    assert len(runs) == 2 and gs.graphs["k"][0].replays == 3 and gs.replays == 3
    call("other")
    assert runs[-1] == ("other", False) and list(gs.graphs) == ["k"]


def test_at_most_the_limit_and_only_a_stale_graph_gives_way(fake, monkeypatch):
    monkeypatch.setenv("XELINK_DIST_GRAPHS", "2")
    call, runs = fake
    for key in ("a", "a", "b", "b", "a", "c", "c"):
        gs = call(key)
    assert list(gs.graphs) == ["b", "a"] and runs[-1] == ("c", False)  # full, nothing stale: c runs eagerly
    monkeypatch.setattr(graphs, "STALE_CALLS", 3)
    gs = call("c")  # b was last used 4 calls ago: it gives way
    assert list(gs.graphs) == ["a", "c"] and runs[-1] == ("c", True)
    monkeypatch.setenv("XELINK_DIST_GRAPHS", "1")
    call("a")
    call("d")
    gs = call("d")  # the limit went down: the least recently used go first
    assert list(gs.graphs) == ["a"] and runs[-1] == ("d", False)


def test_a_loop_over_more_keys_than_the_limit_captures_once_each_kept_key(fake, monkeypatch):
    """The layers of a model, each with its own weight: the first graphs stay and replay, the rest run
    eagerly; nothing is captured twice."""
    monkeypatch.setenv("XELINK_DIST_GRAPHS", "2")
    call, runs = fake
    for _ in range(10):
        for layer in range(5):
            gs = call(f"layer {layer}")
    captured = [k for k, capturing in runs if capturing]
    assert captured == ["layer 0", "layer 1"]
    assert gs.graphs["layer 0"][0].replays == 9 and gs.replays == 18
    assert len(runs) == 50 - 18 + 2  # the bodies: every call but the replays, and the two captures


def test_a_model_with_hundreds_of_calls_a_step_replays_them_all(fake):
    """80 layers x 4 calls, each its own key, under the default limit: every key is captured on its second
    call (the keys seen once are not forgotten before that) and replayed from then on."""
    call, runs = fake
    keys = [f"layer {i} op {j}" for i in range(80) for j in range(4)]
    for _ in range(3):
        for key in keys:
            gs = call(key)
    assert len(gs.graphs) == len(keys) and gs.replays == 2 * len(keys) and len(runs) == 2 * len(keys)


def test_the_pools_stay_within_the_budget(fake, monkeypatch):
    """XELINK_DIST_GRAPH_MB: a graph whose temporaries do not fit next to the others that are in use is
    dropped (its key runs eagerly); a stale one gives way; one larger than the budget alone never stays."""
    monkeypatch.setenv("XELINK_DIST_GRAPH_MB", "1")
    call, runs = fake
    FakeGraph.pool = 600 << 10
    for key in ("a", "a", "b", "b", "b"):
        gs = call(key)
    assert list(gs.graphs) == ["a"] and "b" in gs.never and runs[-1] == ("b", False)
    monkeypatch.setattr(graphs, "STALE_CALLS", 2)
    call("c")
    gs = call("c")  # a was last used 5 calls ago: it gives way
    assert list(gs.graphs) == ["c"] and gs.graphs["c"][2] == 600 << 10
    FakeGraph.pool = 2 << 20
    call("d")
    gs = call("d")
    assert not gs.graphs and "d" in gs.never  # c (stale) went first, then d alone did not fit


def test_keys_refused_a_graph_are_remembered_up_to_a_bound(fake, monkeypatch):
    """Keys whose capture failed pile up as addresses change: they are forgotten past the bound, never grow."""
    monkeypatch.setattr(graphs, "_SEEN_MAX", 4)
    call, _ = fake
    FakeGraph.fail = True
    for i in range(10):
        call(f"k{i}")
        gs = call(f"k{i}")
        assert f"k{i}" in gs.never and len(gs.never) <= 4


def test_a_failed_capture_runs_eagerly_from_then_on(fake):
    call, runs = fake
    call("k")
    FakeGraph.fail = True
    gs = call("k")
    assert runs[-1] == ("k", False) and not gs.graphs and "k" in gs.never  # captured, then run eagerly
    FakeGraph.fail = False
    call("k")
    call("k")
    assert runs[-2:] == [("k", False), ("k", False)] and not gs.graphs


@pytest.mark.parametrize("why", ["off", "capturing"])
def test_off_and_under_a_users_capture_every_call_is_eager(fake, monkeypatch, why):
    call, runs = fake
    if why == "off":
        monkeypatch.setenv("XELINK_DIST_GRAPHS", "0")
    else:
        FakeGraph.capturing = True
    try:
        for _ in range(3):
            gs = call("k")
    finally:
        FakeGraph.capturing = False
    assert len(runs) == 3 and gs is None


def test_the_key_is_each_tensors_address_shape_and_strides():
    x = torch.zeros(4, 6)
    assert graphs.key_of(x) == graphs.key_of(x.view(4, 6))
    assert graphs.key_of(x) != graphs.key_of(x.t())  # same address, other strides
    assert graphs.key_of(x) != graphs.key_of(x[1:])  # another address
    assert graphs.key_of(x) != graphs.key_of(x.view(6, 4))  # another shape

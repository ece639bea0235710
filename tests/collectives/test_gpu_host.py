"""Host-side pieces of the GPU collectives that run without a GPU: piecing, the symmetric-tensor
registry, the measured tuning table auto reads, and import/collection without CUDA."""
import json
from pathlib import Path

import pytest
import torch

import xelink
from xelink.bench.families.gpu_collectives import tuning_table
from xelink.bench.harness import Row
from xelink.collectives import GPU_ALGORITHMS, dispatch, gpu, registry
from xelink.collectives.gpu.launch import kernel_module, pieces
from xelink.symm import cuda

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h200x2-gpu-collectives"


def test_pieces_cover_the_buffer_exactly():
    for count, per in [(0, 16), (1, 16), (16, 16), (17, 16), (1000, 48), (5, 1)]:
        got = pieces(count, per)
        assert all(0 < m <= per for _, m in got) or count == 0
        covered = [i for s, m in got for i in range(s, s + m)]
        assert covered == list(range(count))
    assert pieces(0, 16) == [(0, 0)]


class _At:
    """An address range that quacks like a tensor for the registry."""

    def __init__(self, ptr, nbytes):
        self._ptr, self._n = ptr, nbytes

    def data_ptr(self):
        return self._ptr

    def numel(self):
        return self._n

    def element_size(self):
        return 1


def test_registry_finds_views_and_forgets_freed_tensors():
    reg = cuda._Registry()
    assert not reg
    t = torch.zeros(100, dtype=torch.float32)
    reg.add(t, [t.data_ptr(), 1 << 40])
    assert reg.lookup(t) == [t.data_ptr(), 1 << 40]
    view = t[10:20]
    assert reg.lookup(view) == [view.data_ptr(), (1 << 40) + 40]
    start = t.data_ptr()
    assert reg.lookup(_At(start + 396, 8)) is None  # runs past the end of the registered tensor
    assert reg.lookup(_At(start - 8, 4)) is None  # before it
    del t, view
    import gc

    gc.collect()
    assert reg.lookup(_At(start, 4)) is None  # freed: the address may belong to anything now
    assert not reg


def test_empty_needs_a_cuda_device():
    class Comm:  # a CPU communicator as resolve_group returns it
        device = torch.device("cpu")
        name = "w"
    from xelink.errors import XelinkError

    import xelink.comm as comm_mod

    comm = Comm()
    original = comm_mod.resolve_group
    comm_mod.resolve_group = lambda group, fn: comm
    try:
        with pytest.raises(XelinkError, match="empty: symmetric memory needs a CUDA device"):
            cuda.empty(4)
        with pytest.raises(ValueError, match="empty: size"):
            cuda.empty(-1)
    finally:
        comm_mod.resolve_group = original


def test_measured_tuning_table_sends_small_calls_to_xelink_and_large_user_buffers_to_nccl():
    rows, manifest = [], None
    for line in (RESULTS / "gpu_collectives.jsonl").read_text().splitlines():
        data = json.loads(line)
        manifest = data["manifest"]
        rows.append(Row.from_dict(data))
    table = tuning_table(rows, manifest["topology"], manifest["hosts"], manifest)
    committed = json.loads((RESULTS / "tuning-h200x2.json").read_text())
    assert table.to_dict()["entries"] == committed["entries"]
    assert table.lookup("cuda:all_reduce", torch.bfloat16, 32 << 10) == "xelink:direct"
    assert table.lookup("cuda:all_reduce", torch.bfloat16, 256 << 20) == "baseline:nccl"
    assert table.lookup("all_reduce", torch.bfloat16, 1024) is None  # CPU entries are separate
    # only paths that take any tensor: no zero-copy rows
    for entry in committed["entries"]:
        for _, _, path in entry["ranges"]:
            assert "/symm" not in path and path in ("xelink:direct", "xelink:two_shot", "baseline:nccl")


def test_gpu_algorithms_are_listed_per_op():
    assert GPU_ALGORITHMS["all_reduce"] == ("direct", "two_shot", "copy_engine", "hierarchical", "nccl")
    assert "copy_engine" in GPU_ALGORITHMS["all_gather"] and "topo" in GPU_ALGORITHMS["all_gather"]


class _Comm:
    """What the GPU path reads of a communicator, on the CPU (world size and device set per test)."""

    def __init__(self, size=1, device="cpu", hosts=None):
        self.size, self.rank, self.device, self.name = size, 0, device, "stub"
        self.hosts = hosts or ["h"] * size
        self.timeout = 5.0
        self._resources, self._packages = {}, None
        self.packages = [list(range(size))]
        self.topology = self.world_placement = None

    def resource(self, key, make=None):
        return self._resources.setdefault(key, make()) if make else self._resources.get(key)


def test_one_rank_copies_its_own_data_and_checks_arguments_first():
    comm = _Comm()
    out, inp = torch.zeros(6), torch.arange(6.0)
    # (algo "nccl": the stub's CPU device has no peer memory; one rank never reaches the backend)
    nccl = {op: registry.get("test", op, "nccl", "cuda") for op in ("all_gather", "reduce_scatter")}
    assert gpu.all_gather_into_tensor(comm, out, inp, nccl["all_gather"], False, None) is None
    assert torch.equal(out, inp)
    out = torch.zeros(6)
    gpu.reduce_scatter_tensor(comm, out, inp, "sum", nccl["reduce_scatter"], False, None)
    assert torch.equal(out, inp)
    # The front door checks every argument before a backend sees the call.
    xelink.init()
    try:
        with pytest.raises(TypeError,
                           match="all_to_all_single: output.dtype=torch.float64 != input.dtype=torch.float32"):
            xelink.all_to_all_single(torch.zeros(6, dtype=torch.float64), inp)
        with pytest.raises(ValueError, match=r"all_gather_into_tensor: output.numel\(\)=5"):
            xelink.all_gather_into_tensor(torch.zeros(5), inp)
    finally:
        xelink.finalize()
    with pytest.raises(ValueError, match="all_reduce: algo='ring' is not one of auto, direct, two_shot"):
        registry.get("all_reduce", "all_reduce", "ring", "cuda")


def test_auto_takes_nccl_without_peer_memory_and_the_size_rule_with_it():
    two_hosts = _Comm(2, device="cuda:0", hosts=["a", "b"])
    assert dispatch.choose(two_hosts, "all_reduce", 1 << 20, torch.bfloat16, "cuda") == "nccl"
    with pytest.raises(ValueError, match="needs peer memory"):
        dispatch.resolve("all_reduce", "all_reduce", "direct", two_hosts, "cuda", 1024, torch.bfloat16)
    one_host = _Comm(4, device="cuda:0")
    one_host._resources["cuda.team"] = object()  # peer memory set up: the rule decides (no tuning table here)
    if kernel_module().available():
        assert dispatch.choose(one_host, "all_reduce", 1 << 10, torch.bfloat16, "cuda") == "direct"
        assert dispatch.choose(one_host, "all_reduce", 16 << 20, torch.bfloat16, "cuda") == "two_shot"


def test_an_ipc_failure_says_when_the_peers_gpus_are_hidden(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    hint = cuda._visibility_hint(2)
    assert "sees 1 GPU(s) (CUDA_VISIBLE_DEVICES=1)" in hint and "xelink-run --visible all" in hint
    assert cuda._visibility_hint(1) == ""  # as many GPUs as ranks: nothing hidden to blame
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert cuda._visibility_hint(2) == ""


def test_cuda_p2p_unsupported_says_why_before_any_transfer():
    # Without peer memory between the ranks and without NCCL (this CPU machine), CUDA point-to-point cannot run:
    # the predicate says why (what the first CUDA isend would raise), and names itself for a bad group.
    from xelink.collectives import cuda_p2p_unsupported

    xelink.init()
    try:
        why = cuda_p2p_unsupported()
        if torch.cuda.is_available():
            assert why is None or "point-to-point on CUDA tensors" in why
        else:
            assert why is not None and "needs peer memory" in why and "or NCCL" in why, why
        with pytest.raises(TypeError, match="^cuda_p2p_unsupported: group='w'"):
            cuda_p2p_unsupported("w")
    finally:
        xelink.finalize()

"""scatter_gemm / scatter_reduce (the fused GEMM + reduce-scatter's kernels): argument checks; under the
CPU interpreter (TRITON_INTERPRET=1) every rank of a simulated group in one process (the producers of all
ranks, then each owner's reduction), several calls in a row (epochs and the two-slot parity), 2-D and
batched sub-blocks, tails, both producers, the sum in rank order bit for bit, and a missing tile that the
deadline reports; on a GPU the same with real launches and a CUDA-graph replay."""
import importlib
import importlib.util
import os

import pytest
import torch

from xelink.kernels.common import TensorDescriptor

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON
TINY = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=1, num_stages=1)
sg = importlib.import_module("xelink.kernels.scatter_gemm")


class Group:
    """Every rank's buffers of one simulated group on one device."""

    def __init__(self, world, blocks, block_rows, n_cols, dtype, device, seen_len):
        self.world, self.blocks, self.block_rows = world, blocks, block_rows
        self.geo = sg.scatter_geometry(world, blocks, block_rows, n_cols)
        rows = blocks * block_rows
        self.inboxes = [torch.full((2, world, rows, n_cols), float("nan"), device=device).to(dtype)
                        for _ in range(world)]
        self.counters = [torch.zeros(world * self.geo.chunks, dtype=torch.int32, device=device) for _ in range(world)]
        self.seen = [torch.zeros(seen_len, dtype=torch.int32, device=device) for _ in range(world)]
        self.error = torch.zeros(1 + world, dtype=torch.int32, device=device)

    def produce(self, r, a, b, impl, batch=False, programs=None):
        w, br = self.world, self.block_rows
        stride, bstride = (br, w * br) if batch else (self.blocks * br, 0)
        sg.scatter_gemm(a, b, self.inboxes, self.counters, self.seen[r], rank=r, blocks=self.blocks, block_rows=br,
                        block_stride=stride, batch_stride=bstride, impl=impl, programs=programs)

    def reduce(self, j, out, avg=False, timeout_ns=10**9):
        parity = int(self.seen[j][0]) & 1
        slot = self.inboxes[j][parity].clone()
        sg.scatter_reduce(self.inboxes[j], self.counters[j], self.seen[j], out, error=self.error, blocks=self.blocks,
                          block_rows=self.block_rows, avg=avg, timeout_ns=timeout_ns)
        return slot


def _owner_rows(p, j, world, blocks, block_rows, batch):
    n_cols = p.shape[1]
    if batch:
        return p.view(blocks, world, block_rows, n_cols)[:, j].reshape(blocks * block_rows, n_cols)
    return p[j * blocks * block_rows:(j + 1) * blocks * block_rows]


def _run(world, blocks, block_rows, n_cols, k, impl, *, batch=False, avg=False, calls=3, device="cpu",
         dtype=torch.float16, layout="row", programs=3):
    g = torch.Generator(device=device).manual_seed(world * 100 + block_rows)
    grp = Group(world, blocks, block_rows, n_cols, dtype, device, sg.reduce_programs(torch.device(device)))
    m = world * blocks * block_rows
    for call in range(calls):
        a = [torch.randn(m, k, generator=g, device=device).to(dtype) for _ in range(world)]
        if layout == "col":
            a = [x.T.contiguous().T for x in a]
        b = torch.randn(k, n_cols, generator=g, device=device).to(dtype).T.contiguous().T  # nn.Linear's .t()
        for r in range(world):
            grp.produce(r, a[r], b, impl, batch, programs)
        for j in range(world):
            out = torch.full((blocks * block_rows, n_cols), float("nan"), device=device).to(dtype)
            slot = grp.reduce(j, out, avg)
            # the reduction: the partials in rank order, float32, rounded once: exact
            assert torch.equal(out, sg.reference_scatter_reduce(slot, "avg" if avg else "sum")), (call, j)
            # the partials: each rank's rows of owner j
            for r in range(world):
                want = _owner_rows(a[r].float() @ b.float(), j, world, blocks, block_rows, batch)
                rel = ((slot[r].float() - want).norm() / want.norm().clamp_min(1e-30)).item()
                assert rel < 1e-2, (call, j, r, rel)
        assert not grp.error.any()
    assert all(int(s[0]) == calls for s in grp.seen)


def test_geometry_depends_on_the_block_shape_only():
    geo = sg.scatter_geometry(2, 1, 4096, 8192)
    assert geo.chunk_rows == geo.config["BLOCK_M"] and geo.chunks == 4096 // geo.chunk_rows
    assert geo.tiles_per_chunk == -(-8192 // geo.config["BLOCK_N"])
    assert sg.scatter_geometry(2, 3, 100, 24).chunks == 3 * -(-100 // geo.chunk_rows)


def test_reference_sums_in_rank_order():
    p = torch.tensor([[[1.0, 2.0]], [[3.0, -2.0]], [[0.5, 0.25]]]).half()
    assert sg.reference_scatter_reduce(p).tolist() == [[4.5, 0.25]]
    assert sg.reference_scatter_reduce(p, "avg").tolist() == [[1.5, 0.08331298828125]]


def _bufs(world=2, rows=8, n=4, chunks=None):
    geo = sg.scatter_geometry(world, 1, rows, n)
    ib = [torch.zeros(2, world, rows, n).half() for _ in range(world)]
    ct = [torch.zeros(world * (chunks or geo.chunks), dtype=torch.int32) for _ in range(world)]
    return ib, ct, torch.zeros(8, dtype=torch.int32)


@pytest.mark.parametrize("kw, exc, text", [
    (dict(a=torch.ones(16, 4)), TypeError, "must both be bfloat16 or both float16"),
    (dict(b=torch.ones(3, 4).half()), ValueError, "a.shape[1]=4 != b.shape[0]=3"),
    (dict(rank=2), ValueError, "rank=2 is not below the world size 2"),
    (dict(block_rows=9), ValueError, "the last sub-block ends at row 17, past a.shape[0]=16"),
    (dict(block_rows=0), ValueError, "block_rows=0 must be an int >= 1"),
    (dict(impl="fast"), ValueError, "impl='fast' is not one of"),
    (dict(inboxes="bad"), ValueError, "lists of one tensor per rank"),
    (dict(inboxes=[torch.zeros(2, 2, 8, 5).half()] * 2), ValueError, "inboxes[0] must be a contiguous"),
    (dict(counters=[torch.zeros(0, dtype=torch.int32)] * 2), ValueError, "counters[0] must be contiguous int32"),
    (dict(seen=torch.zeros(2)), ValueError, "seen must be int32"),
])
def test_scatter_gemm_bad_arguments_are_named(kw, exc, text):
    ib, ct, seen = _bufs()
    args = dict(a=torch.ones(16, 4).half(), b=torch.ones(4, 4).half(), inboxes=ib, counters=ct, seen=seen, rank=0,
                block_rows=8, block_stride=8, impl="triton")
    args.update(kw)
    with pytest.raises(exc) as info:
        sg.scatter_gemm(args.pop("a"), args.pop("b"), args.pop("inboxes"), args.pop("counters"), args.pop("seen"),
                        **args)
    assert text in str(info.value)


@pytest.mark.parametrize("kw, text", [
    (dict(out=torch.zeros(8, 5).half()), "out must be torch.float16 [8, 4]"),
    (dict(seen=torch.zeros(1, dtype=torch.int32)), "seen must be contiguous int32 with at least"),
    (dict(error=torch.zeros(2, dtype=torch.int32)), "error must be a contiguous int32 tensor of at least 3"),
    (dict(block_rows=4), "inbox must be a contiguous half-precision [2, world<=8, 4, N]"),
    (dict(timeout_ns=0), "timeout_ns=0 must be an int >= 1"),
])
def test_scatter_reduce_bad_arguments_are_named(kw, text):
    ib, ct, seen = _bufs()
    args = dict(inbox=ib[0], counters=ct[0], seen=seen, out=torch.zeros(8, 4).half(),
                error=torch.zeros(3, dtype=torch.int32), block_rows=8)
    args.update(kw)
    with pytest.raises(ValueError) as info:
        sg.scatter_reduce(args.pop("inbox"), args.pop("counters"), args.pop("seen"), args.pop("out"), **args)
    assert text in str(info.value)


needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")


@needs_interpreter
@pytest.mark.parametrize("impl", ["triton", "cuda"])
@pytest.mark.parametrize("case", [
    dict(world=2, blocks=1, block_rows=24, n_cols=40, k=24),               # tails everywhere
    dict(world=3, blocks=1, block_rows=16, n_cols=32, k=32, avg=True),     # tiles that fit
    dict(world=2, blocks=2, block_rows=10, n_cols=24, k=16, batch=True),   # [B, S, K] scattered along S
    dict(world=1, blocks=1, block_rows=7, n_cols=8, k=8),
])
def test_interpreted_group(monkeypatch, impl, case):
    if impl == "cuda" and TensorDescriptor is None:
        pytest.skip("impl='cuda' needs host tensor descriptors (NVIDIA's Triton; Intel's 3.3 has none)")
    monkeypatch.setattr(sg, "_gemm_config", lambda M, N, K: dict(TINY))
    _run(impl=impl, **case)


@needs_interpreter
def test_interpreted_column_major_a(monkeypatch):
    monkeypatch.setattr(sg, "_gemm_config", lambda M, N, K: dict(TINY))
    _run(2, 1, 16, 16, 24, "triton", layout="col", calls=2)


@needs_interpreter
def test_interpreted_missing_tile_marks_the_error_word(monkeypatch):
    monkeypatch.setattr(sg, "_gemm_config", lambda M, N, K: dict(TINY))
    grp = Group(2, 1, 16, 16, torch.float16, "cpu", sg.reduce_programs(torch.device("cpu")))
    a, b = torch.ones(32, 16).half(), torch.ones(16, 16).half()
    grp.produce(0, a, b, "triton")  # rank 1 never computes: its tiles of owner 0 never land
    grp.reduce(0, torch.zeros(16, 16).half(), timeout_ns=2000)
    assert grp.error.tolist() == [1, 0, 1]


# -- GPU ------------------------------------------------------------------------------------------------

def _skip_unless(impl):
    if impl == "cuda" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("impl='cuda' needs compute capability 9.x")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_group_on_one_device(requires_gpus, impl, dtype):
    requires_gpus(1)
    _skip_unless(impl)
    for case in (dict(world=2, blocks=1, block_rows=512, n_cols=1024, k=512),
                 dict(world=3, blocks=1, block_rows=200, n_cols=264, k=136, avg=True),
                 dict(world=2, blocks=3, block_rows=96, n_cols=256, k=256, batch=True),
                 dict(world=4, blocks=1, block_rows=64, n_cols=72, k=40, layout="col")):
        _run(impl=impl, device="cuda", dtype=dtype, programs=None, **case)
        torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_gpu_graph_replays_are_new_calls(requires_gpus, impl):
    requires_gpus(1)
    _skip_unless(impl)
    world, rows, n, k = 2, 256, 512, 256
    grp = Group(world, 1, rows, n, torch.bfloat16, "cuda", sg.reduce_programs(torch.device("cuda")))
    a = [torch.zeros(world * rows, k, device="cuda").bfloat16() for _ in range(world)]
    b = torch.zeros(k, n, device="cuda").bfloat16()
    outs = [torch.zeros(rows, n, device="cuda").bfloat16() for _ in range(world)]

    def step():
        for r in range(world):
            grp.produce(r, a[r], b, impl)
        for j in range(world):
            sg.scatter_reduce(grp.inboxes[j], grp.counters[j], grp.seen[j], outs[j], error=grp.error,
                              block_rows=rows, timeout_ns=10**9)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    g = torch.Generator(device="cuda").manual_seed(5)
    for it in range(4):
        for x in a:
            x.copy_(torch.randn(x.shape, generator=g, device="cuda"))
        b.copy_(torch.randn(k, n, generator=g, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        full = sum((x.float() @ b.float()) for x in a)
        for j in range(world):
            want = full[j * rows:(j + 1) * rows]
            assert ((outs[j].float() - want).norm() / want.norm()).item() < 1e-2, (it, j)
        assert not grp.error.any()
        assert all(int(s[0]) == 2 + it for s in grp.seen)  # eager call + the replays: the epochs moved on device

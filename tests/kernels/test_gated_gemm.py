"""gated_gemm: the tile order, the column slices, argument checks, the portable kernel under the CPU
interpreter (TRITON_INTERPRET=1), and on a GPU both kernels against gemm's reference with every flag set,
with the flags set by a copy-engine stream as the chunks (or their column slices) land (in order and out of
order, chunk by chunk or slice by slice), a chunk or slice that never lands (the deadline marks the error
word), and CUDA-graph replays with the flags reset in the graph."""
import importlib
import importlib.util
import os

import pytest
import torch

from xelink.kernels.gated_gemm import block_order, column_slices, gated_gemm
from xelink.kernels.gemm import reference_gemm

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON
TINY = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=1, num_stages=1)


def _relerr(c, a, b):
    want = a.float() @ b.float()
    return ((c.float() - want).norm() / want.norm().clamp_min(1e-30)).item()


def test_block_order_follows_the_last_chunk_a_block_spans():
    assert block_order(40, 16, 8, [4, 3, 2, 1, 0]) == [2, 1, 0]
    assert block_order(40, 16, 10, [0, 1, 2, 3]) == [0, 1, 2]
    # block 1 (rows 16-31) spans chunks 1 and 2 (rows 10-19, 20-29): ready when the later of them lands
    assert block_order(40, 16, 10, [2, 0, 3, 1]) == [2, 0, 1]
    assert block_order(64, 16, 32, [1, 0]) == [2, 3, 0, 1]


def test_column_slices_cover_k_in_order():
    assert column_slices(10, 4) == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert column_slices(4096, 1) == [(0, 4096)]
    assert column_slices(2, 4) == [(0, 0), (0, 1), (1, 1), (1, 2)]  # more slices than columns: some empty
    for K, n in ((56, 3), (2056, 8), (7, 7)):
        # the kernels' inverse: the last slice a column c needs is ((c + 1) * n - 1) // K
        for c in range(K):
            lo, hi = column_slices(K, n)[((c + 1) * n - 1) // K]
            assert lo <= c < hi, (K, n, c)


def test_the_sliced_tma_tile_counts_slices_as_a_division_would():
    # The TMA tile carries the slices a load reaches into from load to load, CROSS steps a load (its Triton
    # integer arithmetic, replayed here), or divides where CROSS is 0; either way every load must wait for
    # exactly the slices that start before its end, ((end * S - 1) // K) + 1.
    gg = importlib.import_module("xelink.kernels.gated_gemm")
    for K, bk, S in ((4096, 64, 8), (2056, 64, 3), (2048, 64, 24), (2048, 64, 64), (4096, 64, 1000), (10, 64, 4),
                     (7, 16, 30), (136, 64, 5), (8192, 64, 1024), (100, 32, 7)):
        cross = gg._cross(K, bk, S)
        need = edge = 0
        for off in range(0, K, bk):
            end = min(off + bk, K)
            if cross == 0:
                need = (end * S - 1) // K + 1
            else:
                for _ in range(cross):
                    need += int(need < S and end > edge)
                    edge = need * K // S
            assert need == (end * S - 1) // K + 1, (K, bk, S, off)
            assert column_slices(K, S)[need - 1][0] < end, (K, bk, S, off)


@pytest.mark.parametrize("call, exc, text", [
    (lambda f, e: gated_gemm(torch.ones(4, 4).half(), torch.ones(4, 4).half(), f.float(), chunk_rows=2, error=e),
     ValueError, "flags must be int32 with at least 2 entries"),
    (lambda f, e: gated_gemm(torch.ones(4, 4).half(), torch.ones(4, 4).half(), f, chunk_rows=0, error=e),
     ValueError, "chunk_rows=0 must be a positive int"),
    (lambda f, e: gated_gemm(torch.ones(4, 4).half(), torch.ones(4, 4).half(), f, chunk_rows=2, order=[0, 0],
                             error=e), ValueError, "order=(0, 0) must list each of the 2 chunks once"),
    (lambda f, e: gated_gemm(torch.ones(4, 4).half(), torch.ones(4, 4).half(), f, chunk_rows=2, error=e[:2]),
     ValueError, "error must be a contiguous int32 tensor of at least 3 entries"),
    (lambda f, e: gated_gemm(torch.ones(4, 4), torch.ones(4, 4), f, chunk_rows=2, error=e), TypeError,
     "must both be bfloat16 or both float16"),
    (lambda f, e: gated_gemm(torch.ones(4, 4).half(), torch.ones(3, 4).half(), f, chunk_rows=2, error=e), ValueError,
     "a.shape[1]=4 != b.shape[0]=3"),
    (lambda f, e: gated_gemm(torch.ones(4, 4).half(), torch.ones(4, 4).half(), f, chunk_rows=2, error=e,
                             timeout_ns=-1), ValueError, "timeout_ns=-1 must be a positive int or None"),
    (lambda f, e: gated_gemm(torch.ones(4, 4).half(), torch.ones(4, 4).half(), f, chunk_rows=2, error=e,
                             config={"BLOCK_Q": 64}), ValueError, "config={'BLOCK_Q': 64} must be a dict of BLOCK_M"),
    (lambda f, e: gated_gemm(torch.ones(4, 4).half(), torch.ones(4, 4).half(), f, chunk_rows=2, error=e, k_slices=0),
     ValueError, "k_slices=0 must be an int in [1, 1024]"),
    (lambda f, e: gated_gemm(torch.ones(4, 4).half(), torch.ones(4, 4).half(), f, chunk_rows=2, error=e,
                             k_slices=True), ValueError, "k_slices=True must be an int"),
    (lambda f, e: gated_gemm(torch.ones(1, 2**21).half(), torch.ones(2**21, 1).half(), f, chunk_rows=2, error=e,
                             k_slices=1024), ValueError, "K * k_slices = 2097152 * 1024 must stay below 2**31"),
])
def test_bad_arguments_are_named(call, exc, text):
    with pytest.raises(exc) as info:
        call(torch.ones(8, dtype=torch.int32), torch.zeros(9, dtype=torch.int32))
    assert text in str(info.value)


@pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
def test_interpreted_portable_kernel(monkeypatch):
    gg = importlib.import_module("xelink.kernels.gated_gemm")  # (xelink.kernels.gated_gemm is also the function)

    monkeypatch.setattr(gg, "_gemm_config", lambda M, N, K: dict(TINY))
    a, b = torch.randn(40, 56).half(), torch.randn(56, 24).half()
    flags, err = torch.ones(8, dtype=torch.int32), torch.zeros(9, dtype=torch.int32)
    for rows in (8, 10, 16, 40, 64):
        chunks = -(-40 // rows)
        c = gated_gemm(a, b, flags, chunk_rows=rows, error=err, impl="triton", order=list(reversed(range(chunks))),
                       programs=3)
        assert _relerr(c, a, b) < 1e-3 and not err.any()
    # a tile override (config=) that spans other chunk boundaries: still every row read after its flag
    c = gated_gemm(a, b, flags, chunk_rows=10, error=err, impl="triton", config=dict(BLOCK_M=32, BLOCK_N=8), programs=2)
    assert _relerr(c, a, b) < 1e-3 and not err.any()
    # column slices (uneven: 56 columns in 3 and 5 slices, and more slices than a tile's K loop has blocks)
    for slices in (3, 5):
        flags.fill_(slices)
        for rows in (8, 10):
            c = gated_gemm(a, b, flags, chunk_rows=rows, error=err, impl="triton", k_slices=slices, programs=3)
            assert _relerr(c, a, b) < 1e-3 and not err.any()
    flags[1] = 2  # chunk 1 (rows 8-15) has 2 of its 3 slices: the third never lands
    gated_gemm(a, b, flags, chunk_rows=8, error=err, impl="triton", k_slices=3, timeout_ns=2000)
    assert err.tolist() == [1, 0, 1, 0, 0, 0, 0, 0, 0]
    err.zero_()
    flags.fill_(1)
    flags[2] = 0  # rows 16-23 never land: the deadline (counted polls here) marks chunk 2 and moves on
    gated_gemm(a, b, flags, chunk_rows=8, error=err, impl="triton", timeout_ns=2000)
    assert err.tolist() == [1, 0, 0, 1, 0, 0, 0, 0, 0]


# -- GPU ------------------------------------------------------------------------------------------------

IMPLS = ["triton", "cuda"]


def _skip_unless(impl):
    if impl == "cuda" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("impl='cuda' needs compute capability 9.x")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_every_flag_set_matches_gemm(requires_gpus, impl, dtype):
    requires_gpus(1)
    _skip_unless(impl)
    g = torch.Generator(device="cuda").manual_seed(1)
    err = torch.zeros(64, dtype=torch.int32, device="cuda")
    for (M, N, K), rows in (((1000, 136, 2056), 100), ((256, 512, 512), 128), ((2048, 1024, 4096), 256),
                            ((64, 64, 64), 7), ((200, 264, 136), 200)):
        a = torch.randn(M, K, generator=g, device="cuda").to(dtype)
        b = torch.randn(K, N, generator=g, device="cuda").to(dtype).T.contiguous().T  # an nn.Linear weight's .t()
        flags = torch.ones(-(-M // rows), dtype=torch.int32, device="cuda")
        out = torch.full((M + 8, N), 7.0, dtype=dtype, device="cuda")
        c = gated_gemm(a, b, flags, chunk_rows=rows, error=err, impl=impl, out=out[8:],
                       order=list(reversed(range(flags.numel()))), timeout_ns=10**9)
        assert c.data_ptr() == out[8:].data_ptr() and bool((out[:8] == 7).all())
        want = reference_gemm(a, b).float()
        assert ((c.float() - want).norm() / want.norm()).item() < 1e-2, (M, N, K, rows)
    torch.cuda.synchronize()
    assert not err.any()


def _arrivals(src, a, flags, rows, order, side, delay_cycles=0, k_slices=1, by_slice=False, late=None):
    """On ``side``: (a sleep, then) each chunk of ``src`` copied into ``a`` in ``order``, its flag set after
    it (a copy of a one: the copy engine). With ``k_slices``: each chunk in its column slices (strided
    copy-engine copies), its flag set to the slice's number + 1 after each; chunk by chunk, or slice by slice
    over the chunks (``by_slice``); ``late``: (chunk, slice) held back by a sleep of 50 ms before its copy."""
    from xelink import symm

    with torch.cuda.stream(side):
        counts = torch.arange(1, k_slices + 1, dtype=torch.int32, device="cuda")  # filled before the copies
        if delay_cycles:
            torch.cuda._sleep(delay_cycles)
        K, pitch, size = a.shape[1], a.stride(0) * a.element_size(), a.element_size()
        pieces = [(q, s) for s in range(k_slices) for q in order] if by_slice else \
            [(q, s) for q in order for s in range(k_slices)]
        for q, s in pieces:
            if (q, s) == late:
                torch.cuda._sleep(100_000_000)
            if k_slices == 1:
                a[q * rows:(q + 1) * rows].copy_(src[q * rows:(q + 1) * rows], non_blocking=True)
            else:
                lo, hi = column_slices(K, k_slices)[s]
                height = min(rows, a.shape[0] - q * rows)
                symm.copy_engine_2d(a[q * rows:, lo:].data_ptr(), pitch, src[q * rows:, lo:].data_ptr(), pitch,
                                    (hi - lo) * size, height, side.cuda_stream)
            flags[q:q + 1].copy_(counts[s:s + 1], non_blocking=True)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [None, dict(BLOCK_M=128, BLOCK_N=128, num_stages=4),
                                  dict(BLOCK_M=64, BLOCK_N=256, num_warps=4, num_stages=4)])
@pytest.mark.parametrize("impl", IMPLS)
def test_gpu_tiles_wait_for_chunks_a_copy_engine_stream_lands(requires_gpus, impl, tile):
    # (tile: the config= override gated_gemm_bench.py --tiles times; smaller tiles span other chunk boundaries)
    requires_gpus(1)
    _skip_unless(impl)
    g = torch.Generator(device="cuda").manual_seed(2)
    M, N, K, rows = 2048, 1024, 2048, 256
    src = torch.randn(M, K, generator=g, device="cuda").bfloat16()
    b = torch.randn(K, N, generator=g, device="cuda").bfloat16()
    want = reference_gemm(src, b).float()
    err = torch.zeros(16, dtype=torch.int32, device="cuda")
    side, main = torch.cuda.Stream(), torch.cuda.current_stream()
    for trial, order in enumerate(([0, 1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1, 0], [3, 0, 6, 1, 7, 2, 5, 4])):
        a = torch.full((M, K), float("nan"), device="cuda").bfloat16()  # a tile that reads early sees NaN
        flags = torch.zeros(8, dtype=torch.int32, device="cuda")
        side.wait_stream(main)
        _arrivals(src, a, flags, rows, order, side, delay_cycles=100_000_000 if trial != 1 else 0)
        # the kernel is told a different order than the real one in trial 2: still correct, only slower
        c = gated_gemm(a, b, flags, chunk_rows=rows, error=err, impl=impl,
                       order=order if trial < 2 else None, timeout_ns=10 * 10**9, config=tile)
        main.wait_stream(side)
        torch.cuda.synchronize()
        assert not err.any() and not c.isnan().any(), (order, err.tolist())
        assert ((c.float() - want).norm() / want.norm()).item() < 1e-2, order


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
def test_gpu_tiles_read_column_slices_as_they_land(requires_gpus, impl):
    # A tile that read a slice before its flag counted it would see NaN; chunks of 100 rows span tiles
    # unevenly, K = 2056 splits into uneven slices (not whole K blocks), 24 slices leave K blocks that reach
    # into two of them, 64 slices K blocks that enter two a load, 200 slices of ~5 columns many.
    requires_gpus(1)
    _skip_unless(impl)
    g = torch.Generator(device="cuda").manual_seed(5)
    err = torch.zeros(32, dtype=torch.int32, device="cuda")
    side, main = torch.cuda.Stream(), torch.cuda.current_stream()
    for (M, N, K), rows, slices, order, by_slice, late in (
            ((2048, 1024, 2048), 2048, 8, [0], False, None),
            ((2048, 1024, 2048), 256, 4, [0, 1, 2, 3, 4, 5, 6, 7], True, (3, 1)),
            ((2048, 1024, 2048), 256, 4, [5, 2, 7, 0, 3, 6, 1, 4], False, (2, 3)),
            ((1000, 264, 2056), 100, 3, [9, 0, 8, 1, 7, 2, 6, 3, 5, 4], True, None),
            ((512, 256, 2048), 512, 24, [0], False, (0, 13)),
            ((512, 256, 2048), 256, 64, [1, 0], True, (1, 40)),  # loads enter 2 slices (CROSS 2)
            ((256, 256, 1024), 256, 200, [0], False, (0, 150))):  # slices of ~5 columns: the tile divides
        src = torch.randn(M, K, generator=g, device="cuda").bfloat16()
        b = torch.randn(K, N, generator=g, device="cuda").bfloat16()
        want = reference_gemm(src, b).float()
        a = torch.full((M, K), float("nan"), device="cuda").bfloat16()
        flags = torch.zeros(-(-M // rows), dtype=torch.int32, device="cuda")
        side.wait_stream(main)
        _arrivals(src, a, flags, rows, order, side, delay_cycles=20_000_000, k_slices=slices, by_slice=by_slice,
                  late=late)
        c = gated_gemm(a, b, flags, chunk_rows=rows, k_slices=slices, error=err, impl=impl, order=order,
                       timeout_ns=10 * 10**9)
        main.wait_stream(side)
        torch.cuda.synchronize()
        case = (M, N, K, rows, slices, late)
        assert not err.any() and not c.isnan().any(), (case, err.tolist())
        assert ((c.float() - want).norm() / want.norm()).item() < 1e-2, case
        assert flags.tolist() == [slices] * flags.numel()


@pytest.mark.gpu
@pytest.mark.parametrize("slices, landed", [(1, [1, 1, 0, 1]), (3, [3, 3, 2, 3])])
@pytest.mark.parametrize("impl", IMPLS)
def test_gpu_a_chunk_or_slice_that_never_lands_marks_the_error_word(requires_gpus, impl, slices, landed):
    # (chunk 2 never lands, or its last slice never does)
    requires_gpus(1)
    _skip_unless(impl)
    a = torch.ones(512, 256, device="cuda").bfloat16()
    b = torch.ones(256, 256, device="cuda").bfloat16()
    flags = torch.tensor(landed, dtype=torch.int32, device="cuda")
    err = torch.zeros(5, dtype=torch.int32, pin_memory=True)  # pinned host memory, as xelink.symm's error word
    c = gated_gemm(a, b, flags, chunk_rows=128, k_slices=slices, error=err, impl=impl, timeout_ns=2_000_000)
    torch.cuda.synchronize()
    assert err.tolist() == [1, 0, 0, 1, 0]
    assert bool((c[:256] == 256).all()) and bool((c[384:] == 256).all())
    # the next call, everything there: right again (nothing of the late call left behind)
    flags.fill_(slices)
    err.zero_()
    c = gated_gemm(a, b, flags, chunk_rows=128, k_slices=slices, error=err, impl=impl, timeout_ns=2_000_000)
    torch.cuda.synchronize()
    assert not err.any() and bool((c == 256).all())


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
def test_gpu_capture_takes_flags_at_another_alignment(requires_gpus, impl):
    """Flags at another 16-byte alignment than the call before (a ring of flag sets of 4-byte flags) make a new
    plan, inside a CUDA graph capture too: it reuses the shape's tile order uploaded by the first call."""
    requires_gpus(1)
    _skip_unless(impl)
    M, N, K, rows = 512, 256, 256, 128
    g = torch.Generator(device="cuda").manual_seed(5)
    a = torch.randn(M, K, generator=g, device="cuda").bfloat16()
    b = torch.randn(K, N, generator=g, device="cuda").bfloat16()
    ring = torch.ones(2 * (M // rows) + 1, dtype=torch.int32, device="cuda")  # every chunk landed
    err = torch.zeros(16, dtype=torch.int32, device="cuda")
    gated_gemm(a, b, ring[:M // rows], chunk_rows=rows, error=err, impl=impl)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # flags 20 bytes further: 4 past a 16-byte boundary
        c = gated_gemm(a, b, ring[M // rows + 1:], chunk_rows=rows, error=err, impl=impl)
    c.zero_()
    graph.replay()
    torch.cuda.synchronize()
    want = reference_gemm(a, b).float()
    assert not err.any() and ((c.float() - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tile, slices", [(None, 1), (dict(BLOCK_M=128, BLOCK_N=128, num_stages=4), 1), (None, 4)])
@pytest.mark.parametrize("impl", IMPLS)
def test_gpu_graph_replays_with_flags_reset_in_the_graph(requires_gpus, impl, tile, slices):
    # (tile: a config= override, remembered by the first call like the default, so the capture can replay it)
    requires_gpus(1)
    _skip_unless(impl)
    M, N, K, rows = 1024, 512, 512, 128
    src = torch.zeros(M, K, device="cuda").bfloat16()
    a = torch.zeros(M, K, device="cuda").bfloat16()
    b = torch.zeros(K, N, device="cuda").bfloat16()
    flags = torch.zeros(M // rows, dtype=torch.int32, device="cuda")
    err = torch.zeros(16, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    order = [5, 1, 7, 0, 3, 2, 6, 4]

    def step():
        # The stream the call runs on, read at call time: torch.cuda.graph captures on a stream of its own,
        # so a `main` taken before the capture (the default stream) would leave the side stream outside the
        # graph, its copies and flags running once, eagerly, during the capture instead of in every replay.
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        _arrivals(src, a, flags, rows, order, side, delay_cycles=20_000_000, k_slices=slices, by_slice=True)
        c = gated_gemm(a, b, flags, chunk_rows=rows, k_slices=slices, error=err, impl=impl, order=order, config=tile)
        main.wait_stream(side)
        flags.zero_()
        return c

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        c = step()
    g = torch.Generator(device="cuda").manual_seed(3)
    for _ in range(3):
        src.copy_(torch.randn(M, K, generator=g, device="cuda"))
        b.copy_(torch.randn(K, N, generator=g, device="cuda"))
        a.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = reference_gemm(src, b).float()
        assert not c.isnan().any() and ((c.float() - want).norm() / want.norm()).item() < 1e-2
        assert not err.any() and not flags.any()

"""Context-parallel attention without ranks: bad input is refused with the function and the value named (world
size 1, nothing is sent), the layouts' blocks are numpy.array_split's, the causal decomposition equals the
global mask on every pair of ranges, the zigzag halving, and auto's memory rule."""
import importlib
import itertools
import types

import numpy as np
import pytest
import torch

import xelink
from xelink.dist import cp_engine, schedule
from xelink.kernels import reference_flash_attention

cpa = importlib.import_module("xelink.dist.cp_attention")  # the module (the package's name is the function)


@pytest.fixture()
def world():
    w = xelink.init()
    yield w
    xelink.finalize()


Q = torch.ones(1, 4, 8, 64)
K = torch.ones(1, 2, 8, 64)


def _req():
    return torch.ones(1, 2, 8, 64, requires_grad=True)


BAD = [
    (lambda: xelink.cp_attention("q", K, K), TypeError, r"cp_attention: q must be a torch.Tensor, got str"),
    (lambda: xelink.cp_attention(Q[0], K, K), ValueError, r"cp_attention: q must be 4-D .* got shape \(4, 8, 64\)"),
    (lambda: xelink.cp_attention(Q.int(), K.int(), K.int()), TypeError, r"cp_attention: q.dtype=torch.int32 is not"),
    (lambda: xelink.cp_attention(Q, K.double(), K), TypeError, r"cp_attention: dtypes differ: q.dtype=torch.float32, "
                                                               r"k.dtype=torch.float64"),
    (lambda: xelink.cp_attention(Q, K, K[:, :, :7]), ValueError, r"cp_attention: k.shape=\(1, 2, 8, 64\) != "
                                                                 r"v.shape=\(1, 2, 7, 64\)"),
    (lambda: xelink.cp_attention(Q, K[:, :, :7], K[:, :, :7]), ValueError,
     r"cp_attention: local lengths differ: q.shape\[2\]=8 != k.shape\[2\]=7"),
    (lambda: xelink.cp_attention(Q.expand(2, -1, -1, -1), K, K), ValueError, r"batch differs: q.shape\[0\]=2"),
    (lambda: xelink.cp_attention(Q, K[..., :32], K[..., :32]), ValueError,
     r"cp_attention: head_dim: q.shape\[3\]=64, k.shape\[3\]=32"),
    (lambda: xelink.cp_attention(Q[:, :3], K, K), ValueError, r"cp_attention: q heads 3 must be a multiple of k heads 2"),
    (lambda: xelink.cp_attention(Q, K.to("meta"), K.to("meta")), ValueError, r"cp_attention: k is on meta"),
    (lambda: xelink.cp_attention(Q, K, K, causal=1), TypeError, r"cp_attention: causal=1 must be a bool"),
    (lambda: xelink.cp_attention(Q, K, K, scale=-1.0), ValueError, r"cp_attention: scale=-1.0 must be finite and > 0"),
    (lambda: xelink.cp_attention(Q, K, K, return_lse="yes"), TypeError, r"return_lse='yes' must be a bool"),
    (lambda: xelink.cp_attention(Q, K, K, layout="striped"), ValueError,
     r"cp_attention: layout='striped' is not one of contiguous, zigzag"),
    (lambda: xelink.cp_attention(Q, K, K, algo="tree"), ValueError,
     r"cp_attention: algo='tree' is not one of auto, ring, all_gather"),
    (lambda: xelink.cp_attention(Q, K, K, seq_len=9), ValueError,
     r"cp_attention: q.shape\[2\]=8 but seq_len=9 on a group of one rank"),
    (lambda: xelink.cp_attention(Q, K, K, seq_len=8.0), TypeError, r"cp_attention: seq_len=8.0 must be an int"),
    (lambda: xelink.cp_attention(Q, K, K, group="w"), TypeError, r"cp_attention: group='w' is not an xelink"),
    (lambda: xelink.cp_shard([1, 2]), TypeError, r"cp_shard: x must be a torch.Tensor, got list"),
    (lambda: xelink.cp_shard(Q, dim=4), ValueError, r"cp_shard: dim=4 is not valid for a 4-D tensor"),
    (lambda: xelink.cp_shard(Q, layout="ring"), ValueError, r"cp_shard: layout='ring' is not one of"),
    (lambda: xelink.cp_unshard(Q, seq_len=9), ValueError,
     r"cp_unshard: x_local.shape\[2\]=8 on rank 0, but seq_len=9 with layout='zigzag' over 1 ranks gives rank 0 9"),
    (lambda: xelink.cp_unshard(Q, seq_len=-1), ValueError, r"cp_unshard: seq_len=-1 must be >= 0"),
    (lambda: xelink.cp_unshard(Q, seq_len=None), TypeError, r"cp_unshard: seq_len=None must be an int"),
    (lambda: xelink.cp_positions(True), TypeError, r"cp_positions: seq_len=True must be an int"),
    (lambda: xelink.cp_positions(4, layout=None), ValueError, r"cp_positions: layout=None is not one of"),
    (lambda: xelink.cp_attention(Q, K, K, window=0), ValueError,
     r"cp_attention: window=0 must be None or an int >= 1"),
    (lambda: xelink.cp_attention(Q, K, K, window=True), ValueError, r"cp_attention: window=True must be None"),
    (lambda: xelink.cp_attention(Q, K, K, window=2.0), ValueError, r"cp_attention: window=2.0 must be None"),
    (lambda: xelink.cp_shard(Q, dim=2, cu_seqlens=torch.tensor([0, 3, 9])), ValueError,
     r"cp_shard: cu_seqlens\[-1\]=9 != 8, the packed length"),
    (lambda: xelink.cp_shard(Q, dim=2, cu_seqlens=[0, 8]), TypeError, r"cp_shard: cu_seqlens must be a torch.Tensor"),
    (lambda: xelink.cp_unshard(Q, seq_len=8, cu_seqlens=torch.tensor([0, 5, 3, 8])), ValueError,
     r"cp_unshard: cu_seqlens=\[0, 5, 3, 8\] must start at 0 and never decrease"),
    (lambda: xelink.cp_positions(8, cu_seqlens=torch.tensor([[0, 8]])), ValueError,
     r"cp_positions: cu_seqlens must be a 1-D int32/int64 tensor"),
]


@pytest.mark.parametrize("call,exc,match", BAD, ids=range(len(BAD)))
def test_bad_input_is_refused(world, call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_no_grad_inputs_that_require_grad_are_taken(world):
    with torch.no_grad():
        out = xelink.cp_attention(Q, _req(), _req())
    assert out.shape == Q.shape


def test_world_size_one_gradients_are_those_of_attention(world):
    """One rank: the autograd node's backward (flash_attention_backward over the one block) against autograd of
    the reference, the LSE in the loss, GQA and causal."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, 9, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    dout, dlse = torch.randn(1, 4, 9, 16, generator=g, dtype=torch.float64), torch.randn(1, 4, 9, generator=g)
    for causal in (False, True):
        ours, ref = [[t.clone().requires_grad_() for t in (q, k, v)] for _ in range(2)]
        out, lse = xelink.cp_attention(*ours, causal=causal, return_lse=True)
        assert out.grad_fn is not None and lse.grad_fn is not None
        ((out * dout).sum() + (lse * dlse).sum()).backward()
        want, want_lse = reference_flash_attention(*ref, causal=causal, return_lse=True)
        ((want * dout).sum() + (want_lse * dlse).sum()).backward()
        for a, b in zip(ours, ref):
            assert a.grad.dtype == torch.float64, a.grad.dtype
            assert torch.allclose(a.grad, b.grad, atol=1e-5), (a.grad - b.grad).abs().max()


def test_world_size_one_is_flash_attention(world):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 11, 64, generator=g) for h in (4, 2, 2))
    for layout, algo, causal in itertools.product(cpa.CP_LAYOUTS, ("auto",) + cpa.CP_ALGOS, (False, True)):
        out, lse = xelink.cp_attention(q, k, v, causal=causal, layout=layout, algo=algo, return_lse=True)
        want, want_lse = reference_flash_attention(q, k, v, causal=causal, return_lse=True)
        assert torch.allclose(out, want, atol=1e-6) and torch.allclose(lse, want_lse, atol=1e-6)
        assert torch.equal(xelink.cp_shard(q, layout=layout), q)
        assert torch.equal(xelink.cp_unshard(q, seq_len=11, layout=layout), q)
        assert xelink.cp_positions(11, layout=layout).tolist() == list(range(11))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_blocks_are_array_splits_and_pieces_tile_the_sequence(n, layout):
    count = n if layout == "contiguous" else 2 * n
    for S in (0, 1, count - 1, count, 13, 40, 41):
        blocks = schedule.cp_blocks(S, n, layout)
        assert [length for _, length in blocks] == [len(a) for a in np.array_split(np.arange(S), count)]
        held = [p for r in range(n) for s, length in schedule.cp_pieces(S, n, layout, r) for p in range(s, s + length)]
        assert sorted(held) == list(range(S))
        assert schedule.cp_lengths(S, n, layout) == [sum(x for _, x in schedule.cp_pieces(S, n, layout, r))
                                                     for r in range(n)]
    if layout == "zigzag":
        assert schedule.cp_pieces(16, 4, layout, 1) == [(2, 2), (12, 2)]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_varlen_pieces_partition_the_packed_tokens(layout):
    """layout.varlen_pieces: over the ranks every packed token once, each piece inside one sequence; zigzag lays each
    sequence out as cp_pieces does one sequence, contiguous is the packed stream's cp_pieces cut at sequence ends."""
    from xelink.layout import varlen_pieces
    for n in (1, 2, 3, 4):
        for cu in ([0, 5, 5, 17, 18, 40], [0, 23], [0, 1, 2, 3], [0, 2], [0, 0], [0, 9, 30, 31]):
            held, per_rank = [], []
            for r in range(n):
                pieces = varlen_pieces(cu, n, layout, r)
                per_rank.append(pieces)
                for s, length in pieces:
                    assert length > 0 and any(a <= s and s + length <= b for a, b in zip(cu, cu[1:])), (cu, s, length)
                    held += range(s, s + length)
            assert sorted(held) == list(range(cu[-1])), (n, cu, per_rank)
            for r in range(n):
                if layout == "zigzag":
                    want = [(a + s, x) for a, b in zip(cu, cu[1:]) for s, x in schedule.cp_pieces(b - a, n, layout, r)
                            if x]
                else:
                    (lo, x), = schedule.cp_pieces(cu[-1], n, layout, r)
                    want = [(p, 1) for p in range(lo, lo + x)]
                    got = [(p, 1) for s, length in per_rank[r] for p in range(s, s + length)]
                    assert got == want, (n, cu, r)
                    continue
                assert per_rank[r] == want, (n, cu, r)


def _mask_of_parts(q_range, k_range, causal):
    """The visibility the kernel calls of attend_parts produce, as {(query, key)}, each pair at most once."""
    seen = []
    for (a, b), (ka, kb), c in schedule.attend_parts(q_range, k_range, causal):
        for i, p in enumerate(range(a, b)):
            for j, key in enumerate(range(ka, kb)):
                if not c or j <= i + (kb - ka) - (b - a):  # the kernel's end-aligned mask
                    seen.append((p, key))
    assert len(seen) == len(set(seen)), (q_range, k_range)
    return set(seen)


def test_attend_parts_is_the_global_mask_on_every_pair_of_ranges():
    spans = [(s, e) for s in range(0, 7) for e in range(s, 8)]
    for (qr, kr), causal in itertools.product(itertools.product(spans, spans), (False, True)):
        want = {(p, key) for p in range(*qr) for key in range(*kr) if not causal or key <= p}
        assert _mask_of_parts(qr, kr, causal) == want, (qr, kr, causal)
        assert len(schedule.attend_parts(qr, kr, causal)) <= 2


def test_zigzag_causal_takes_half_the_kv_or_half_the_queries():
    """The standard halving: from a rank before this one, all queries against the first block of its KV; from
    a rank after it, the second half of the queries against all of its KV; each one kernel call."""
    n, S = 4, 37
    calls = []

    class Acc:
        def add(self, lo, hi, out, lse):
            calls.append((lo, hi))

    r = 1
    q = torch.zeros(1, 1, schedule.cp_lengths(S, n, "zigzag")[r], 8)
    mine = schedule.local_pieces(schedule.cp_pieces(S, n, "zigzag", r))
    for src in range(n):
        theirs = schedule.local_pieces(schedule.cp_pieces(S, n, "zigzag", src))
        length = sum(x for _, x, _ in theirs)
        kv = torch.zeros(1, 1, length, 8)
        calls.clear()
        made = cp_engine.attend(Acc(), q, mine, theirs, kv, kv, True, None)
        la = mine[0][1]
        if src < r:
            assert made == 1 and calls == [(0, q.shape[2])], (src, calls)
        elif src > r:
            assert made == 1 and calls == [(la, q.shape[2])], (src, calls)
        else:
            assert made == 3, calls  # the two diagonals and the second half against the first block


def test_gathered_runs_leave_out_the_own_blocks():
    assert cp_engine.gathered_runs(3, 1, 12, "zigzag") == [[(0, 0, 2)], [(2, 0, 2), (2, 2, 2)], [(0, 2, 2)]]
    assert cp_engine.gathered_runs(3, 0, 7, "contiguous") == [[(1, 0, 2), (2, 0, 2)]]


def test_auto_is_all_gather_while_the_gathered_kv_fits():
    comm = types.SimpleNamespace(packages=[[0, 1]])
    assert cpa.auto_algo(comm, cpa.AUTO_GATHER_BYTES // 2) == "all_gather"
    assert cpa.auto_algo(comm, cpa.AUTO_GATHER_BYTES // 2 + 1) == "ring"


def test_topo_ring_keeps_packages_contiguous():
    assert schedule.topo_ring([[0, 2], [1, 3]]) == [0, 2, 1, 3]
    assert schedule.topo_ring([[0, 1, 2, 3]]) == [0, 1, 2, 3]


def test_the_cuda_module_imports_without_a_gpu():
    import xelink.dist.cp_device as cp_device
    import xelink.dist.device as device

    slots = {cp_device.CP_READY, cp_device.CP_FREE}
    assert slots <= set(range(xelink.symm.SIGNAL_SLOTS))
    assert not slots & {device.READY, device.FREE, device.RS_READY, device.RS_FREE}


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_window_spans_and_halos_are_what_the_windows_see(layout):
    """Under a sliding window every piece's span is exactly the keys its queries see (the first query's window
    start to the last query; without causal the sequence's last ``window``), and what a rank receives from each
    other rank (``halo_runs``) is exactly its spans' keys that that rank holds, at the right local offsets."""
    for n, S, window, causal in itertools.product((1, 2, 3, 4), (0, 1, 5, 13, 29), (1, 2, 4, 7, 30),
                                                  (True, False)):
        where = {}  # position -> (owner, local offset)
        for x in range(n):
            for start, length, off in schedule.rank_pieces(S, n, layout, x):
                where.update({start + i: (x, off + i) for i in range(length)})
        for r in range(n):
            pieces = schedule.rank_pieces(S, n, layout, r)
            spans = schedule.window_spans(S, window, causal, pieces)
            assert len(spans) == sum(1 for _, length, _ in pieces if length)
            seen = set()
            for (lo, hi, first, end), (start, length, off) in zip(spans, [p for p in pieces if p[1]]):
                assert (lo, hi) == (off, off + length)
                visible = {k for p in range(start, start + length) for k in range(S)
                           if (k <= p and k > p - window if causal else k >= S - window)}
                assert set(range(first, end)) == visible, (n, S, window, causal, r, start, length)
                seen |= visible
            for x in range(n):
                runs = schedule.halo_runs(S, n, layout, window, causal, r, x)
                got = [(p, where[p]) for start, length, _ in runs for p in range(start, start + length)]
                assert [pos for pos, _ in got] == sorted(pos for pos in seen if where[pos][0] == x and x != r)
                assert all(where[start + i] == (x, off + i) for start, length, off in runs for i in range(length))


def test_world_size_one_window_is_flash_attentions(world):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, 12, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    for causal, window in itertools.product((True, False), (1, 5, 12, 40)):
        out, lse = xelink.cp_attention(q, k, v, causal=causal, window=window, return_lse=True)
        want, want_lse = reference_flash_attention(q, k, v, causal=causal, window=window, return_lse=True)
        assert torch.allclose(out, want, atol=1e-12) and torch.allclose(lse, want_lse, atol=1e-12), (causal, window)

"""Context-parallel attention on CPU ranks: both algorithms, both layouts, causal and not, GQA (4 q heads over
2 KV heads) and MHA, head dims 64/128/256, lengths that the block count does not divide (and shorter than
it), float32 (1e-5, out and LSE) and bfloat16, against reference_flash_attention over the whole sequence
(computed on every rank from the same seed) sliced to the rank's positions; flat and as packages (one rank
each at 2, 2+1 at 3, 2x2 at 4: the ring then runs package after package); cp_shard/cp_unshard round trips,
cp_positions, seq_len= without the exchange, back-to-back calls that change shape and algorithm, ranks that
disagree (every rank raises the same error), and torch.compile through the custom op (2 ranks). Sliding windows
(``window=``, the halo exchange): every layout, mask and window length (1, shorter and longer than a block, the
whole sequence), short sequences, a named algorithm refused, back-to-back calls with and without a window.

Gradients (the backward, ``cp_backward``): dq, dk, dv of every algorithm, layout and mask, with the LSE in the
loss, against autograd of attention over the whole sequence written in plain torch float64 (no xelink code);
short sequences, bfloat16, ranks that disagree about grad, a rank late to the backward, activation
checkpointing, an error part way through the backward, the traced backward; and a real client: an attention
layer trained over context-parallel ranks (gradients summed with all_reduce) that ends with one process's
weights, with and without a sliding window.

Packed sequences (``cp_attention_varlen``): sequences inside and across the ranks' contiguous blocks, empty and
one-token sequences, ranks without a token, windows, GQA, dtypes and offset dtypes, against plain-torch attention
of each sequence (output, LSE, float64 gradients); a training client against one process; bad input and ranks
that disagree; a compiled function around it."""
import re
import time

import torch
from ranks import only

import xelink
from dist_cases import free, full_attention, layouts
from xelink.kernels import reference_flash_attention

WORLD_SIZES = (1, 2, 3, 4)
LAUNCH_TIMEOUT = 120
ALGOS = ("ring", "all_gather")
LAYOUTS = ("zigzag", "contiguous")
# 2x2 at 4 twice: in rank order, and interleaved (the ring's order is then 0, 2, 1, 3, not the ranks')
PACKAGES = {2: [[[0], [1]]], 3: [[[0, 1], [2]]], 4: [[[0, 1], [2, 3]], [[0, 2], [1, 3]]]}


def _qkv(B, hq, hkv, S, D, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, S, D, generator=g).to(dtype) for h in (hq, hkv, hkv))


def _check(got, want, what, tol):
    err = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
    if not err <= tol:
        raise AssertionError(f"{what}: max abs error {err:.3g} > {tol}")


def _case(comm, B, hq, hkv, S, D, causal, layout, algo, seed, dtype=torch.float32, tol=1e-5, scale=None,
          window=None):
    q, k, v = _qkv(B, hq, hkv, S, D, seed, dtype)
    want, want_lse = reference_flash_attention(q.float(), k.float(), v.float(), causal=causal, scale=scale,
                                               return_lse=True, window=window)
    pos = xelink.cp_positions(S, group=comm, layout=layout)
    shard = lambda x: xelink.cp_shard(x, group=comm, layout=layout)  # noqa: E731
    out, lse = xelink.cp_attention(shard(q), shard(k), shard(v), causal=causal, scale=scale, group=comm,
                                   layout=layout, algo=algo, return_lse=True, window=window)
    what = f"B={B} hq={hq} hkv={hkv} S={S} D={D} causal={causal} {layout} {algo} {dtype} window={window}"
    assert out.shape == (B, hq, pos.numel(), D) and out.dtype == dtype, f"{what}: {out.shape} {out.dtype}"
    assert lse.shape == (B, hq, pos.numel()) and lse.dtype == torch.float32, f"{what}: lse {lse.shape}"
    _check(out, want[:, :, pos], what, tol)
    _check(lse, want_lse[:, :, pos], f"{what} lse", 1e-5 if dtype == torch.float32 else 2e-2)
    return out


def _every_group_layout_algo_and_mask(world, case) -> None:
    """``case(comm, layout, algo, causal, i)`` for i in 0, 1 over the flat world and the package layouts, an
    error naming the layout it failed on."""
    groups = layouts(world, PACKAGES)
    for name, comm in groups:
        for layout in LAYOUTS:
            for algo in ALGOS:
                for causal in (False, True):
                    for i in range(2):
                        try:
                            case(comm, layout, algo, causal, i)
                        except AssertionError as e:
                            raise AssertionError(f"{name}: {e}") from None
    free(groups)


def check_every_algo_layout_and_mask(world):
    _every_group_layout_algo_and_mask(world, lambda comm, layout, algo, causal, i: _case(
        comm, 1, 4, 2, (13, 29)[i], 64, causal, layout, algo, 10 * i + causal))


def check_head_dims_mha_batch_and_scale(world):
    for layout in LAYOUTS:
        for algo in ALGOS:
            _case(world, 2, 2, 2, 17, 128, True, layout, algo, 1)
            _case(world, 1, 2, 1, 11, 256, True, layout, algo, 2, scale=0.3)
            _case(world, 2, 3, 3, 19, 32, False, layout, algo, 3)


def check_bfloat16(world):
    for layout in LAYOUTS:
        for algo in ALGOS:
            for causal in (False, True):
                _case(world, 1, 4, 2, 23, 64, causal, layout, algo, 4, dtype=torch.bfloat16, tol=3e-2)


def check_sequences_shorter_than_the_blocks(world):
    """S below 2n: some blocks (and at S < n some ranks) are empty; out/LSE of an empty shard are empty."""
    for S in (1, world.size, 2 * world.size + 1):
        for layout in LAYOUTS:
            for algo in ALGOS:
                _case(world, 1, 2, 1, S, 16, True, layout, algo, 5 + S)


def check_auto_and_defaults(world):
    """Defaults (zigzag, auto, no LSE): the output alone, equal to the explicit algorithms."""
    q, k, v = _qkv(1, 4, 2, 21, 64, 6)
    shard = lambda x: xelink.cp_shard(x)  # noqa: E731
    got = xelink.cp_attention(shard(q), shard(k), shard(v), causal=True)
    assert isinstance(got, torch.Tensor)
    want = reference_flash_attention(q, k, v, causal=True)
    _check(got, want[:, :, xelink.cp_positions(21)], "defaults", 1e-5)
    for algo in ALGOS:
        _check(xelink.cp_attention(shard(q), shard(k), shard(v), causal=True, algo=algo), got, f"auto vs {algo}", 1e-5)
    for B, S in ((1, 0), (0, 5)):  # an empty sequence or batch: auto ran the cost model, which refused it
        q, k, v = (shard(x) for x in _qkv(B, 4, 2, S, 16, 7))
        assert xelink.cp_attention(q, k, v, causal=True).shape == q.shape


def check_seq_len_given_skips_the_exchange(world):
    q, k, v = _qkv(1, 2, 2, 27, 64, 7)
    for layout in LAYOUTS:
        pos = xelink.cp_positions(27, layout=layout)
        want = reference_flash_attention(q, k, v, causal=True)[:, :, pos]
        shard = lambda x: xelink.cp_shard(x, layout=layout)  # noqa: E731
        for algo in ALGOS:
            got = xelink.cp_attention(shard(q), shard(k), shard(v), causal=True, layout=layout, algo=algo, seq_len=27)
            _check(got, want, f"seq_len= {layout} {algo}", 1e-5)


def check_shard_unshard_round_trips_and_positions(world):
    n, r = world.size, world.rank
    for layout in LAYOUTS:
        for S in (0, 1, 7, 13, 2 * n, 40):
            pos = xelink.cp_positions(S, layout=layout)
            assert pos.dtype == torch.long, pos.dtype
            blocks = n if layout == "contiguous" else 2 * n
            sizes = [len(c) for c in torch.arange(S).tensor_split(blocks)]  # numpy.array_split's sizes
            starts = [sum(sizes[:i]) for i in range(blocks)]
            mine = [r] if layout == "contiguous" else [r, 2 * n - 1 - r]
            want = [p for b in mine for p in range(starts[b], starts[b] + sizes[b])]
            assert pos.tolist() == want, (layout, S, pos.tolist(), want)
            every = world.allgather_object(pos.tolist())
            assert sorted(p for ps in every for p in ps) == list(range(S)), (layout, S, every)
            x = torch.arange(2 * 3 * S * 2, dtype=torch.float32).reshape(2, 3, S, 2)
            local = xelink.cp_shard(x, layout=layout)
            assert torch.equal(local, x[:, :, pos]), (layout, S)
            assert torch.equal(xelink.cp_unshard(local, seq_len=S, layout=layout), x), (layout, S)
            ids = torch.arange(3 * S).reshape(3, S)  # token ids (B, S), dim=1 / dim=-1
            local = xelink.cp_shard(ids, layout=layout, dim=-1)
            assert torch.equal(local, ids[:, pos])
            assert torch.equal(xelink.cp_unshard(local, seq_len=S, layout=layout, dim=1), ids)
            # cp_unshard's gradient, as an autograd all-gather's: every rank's loss (its own weights on the whole
            # sequence) a term of one sum, so a shard's gradient is the weights summed over the ranks there
            weights = torch.randn((n,) + tuple(x.shape), generator=torch.Generator().manual_seed(S), dtype=x.dtype)
            leaf = xelink.cp_shard(x, layout=layout).requires_grad_()
            (xelink.cp_unshard(leaf, seq_len=S, layout=layout) * weights[r]).sum().backward()
            assert torch.allclose(leaf.grad, weights.sum(0)[:, :, pos], atol=1e-5), (layout, S)


def check_back_to_back_calls_change_shape_and_algo(world):
    plan = [(13, 64, True, "zigzag", "ring"), (40, 64, False, "contiguous", "all_gather"), (13, 64, True, "zigzag", "all_gather"),
            (22, 128, True, "contiguous", "ring"), (9, 64, False, "zigzag", "auto"), (13, 64, True, "zigzag", "ring")]
    for i, (S, D, causal, layout, algo) in enumerate(plan):
        _case(world, 1, 4, 2, S, D, causal, layout, algo, 100 + i)


def check_ranks_that_disagree_all_raise(world):
    """A rank with another head count, or local lengths not of the layout: every rank raises the same
    ValueError after the signature exchange, and the group works afterwards."""
    n, r = world.size, world.rank
    if n == 1:
        return
    q, k, v = _qkv(1, 4, 2, 6, 64, 8)
    hk = 1 if r == 0 else 2
    m = 5 if r == n - 1 else 2  # lengths 2, ..., 2, 5: never zigzag's for their sum
    cases = [((q, k[:, :hk], v[:, :hk]), "ranks disagree about the call"),
             ((q[:, :, :m], k[:, :, :m], v[:, :, :m]), "are not those of layout='zigzag'")]
    for args, text in cases:
        try:
            xelink.cp_attention(*args, causal=True)
        except ValueError as e:
            assert text in str(e), str(e)
        else:
            raise AssertionError(f"no ValueError for {text!r}")
    _case(world, 1, 4, 2, 15, 64, True, "zigzag", "ring", 9)


@only(sizes=(2,))  # compiling costs seconds per launch; one size shows the op traces and runs
def check_torch_compile_traces_the_custom_op(world):
    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(q, k, v):
        out, lse = xelink.cp_attention(q * 1.0, k, v, causal=True, layout="zigzag", algo="ring", return_lse=True)
        return out + 0.0, lse

    q, k, v = _qkv(1, 4, 2, 19, 64, 11)
    pos = xelink.cp_positions(19)
    want, want_lse = reference_flash_attention(q, k, v, causal=True, return_lse=True)
    with torch.no_grad():
        out, lse = step(*(xelink.cp_shard(x) for x in (q, k, v)))
    _check(out, want[:, :, pos], "compiled", 1e-5)
    _check(lse, want_lse[:, :, pos], "compiled lse", 1e-5)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def windowed(q, k, v):
        return xelink.cp_attention(q * 1.0, k, v, causal=True, window=4) + 0.0

    with torch.no_grad():
        out = windowed(*(xelink.cp_shard(x) for x in (q, k, v)))
    _check(out, reference_flash_attention(q, k, v, causal=True, window=4)[:, :, pos], "compiled window", 1e-5)


@only(sizes=(2,))
def check_torch_compile_backward_equals_eager(world):
    """A compiled loss through cp_attention (the LSE unused, then used, then with a window): its gradients are the
    eager call's (the backward traced through ``xelink::cp_attention_backward``)."""
    q, k, v = (xelink.cp_shard(t) for t in _qkv(1, 4, 2, 19, 16, 12))
    for use_lse, window in ((False, None), (True, None), (True, 5)):
        def loss(q, k, v):
            out, lse = xelink.cp_attention(q, k, v, causal=True, algo="auto" if window else "all_gather",
                                           return_lse=True, window=window)
            return (out * out).sum() + use_lse * lse.sum()

        grads = []
        for f in (loss, torch.compile(loss, backend="aot_eager", fullgraph=True)):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            f(*leaves).backward()
            grads.append([t.grad for t in leaves])
        for name, got, want in zip("qkv", grads[1], grads[0]):
            _check(got, want, f"compiled d{name} (lse used: {use_lse}, window {window})", 1e-6)


@only(launchers=("mpi",), sizes=(4,))
def check_ring_keeps_about_two_blocks_in_flight(world):
    """The CPU ring waits for the block it sent a step ago (MPI keeps a send's buffer until then): at every
    step the send and receive buffers still held come to at most two KV blocks and the next block's receive, not
    every block the ring passed on (which made the ring's memory the all-gather's, the reason it exists)."""
    import gc
    import weakref

    import xelink.dist.cp_host as host
    import xelink.transport.mpi as transport

    held, steps = [], []
    as_bytes, attend = transport.as_bytes, host.attend

    def tracked(buf):
        arr = as_bytes(buf)
        held.append(weakref.ref(arr))
        return arr

    def counting(*args, **kwargs):
        gc.collect()
        steps.append(sum(a().nbytes for a in held if a() is not None))
        return attend(*args, **kwargs)

    transport.as_bytes, host.attend = tracked, counting
    try:
        q = torch.randn(1, 1, 64, 64)
        xelink.cp_attention(q, q, q, algo="ring", layout="contiguous")
    finally:
        transport.as_bytes, host.attend = as_bytes, attend
    block = 2 * q.numel() * q.element_size()
    assert len(steps) == world.size and max(steps) <= 2 * block, (steps, block)


WINDOWS = (1, 3, 7, 12, 29, 40)  # one key, shorter and longer than a block, the sequence less one, all, more


def check_window_every_layout_and_mask(world):
    """A sliding window over the halo exchange: every group (flat and packages), layout, mask and window."""
    groups = layouts(world, PACKAGES)
    for name, comm in groups:
        for layout in LAYOUTS:
            for causal in (True, False):
                for i, window in enumerate(WINDOWS):
                    try:
                        _case(comm, 1, 4, 2, 30, 16, causal, layout, "auto", 200 + i, window=window)
                    except AssertionError as e:
                        raise AssertionError(f"{name}: {e}") from None
    free(groups)


def check_window_short_sequences_bfloat16_and_batch(world):
    """Empty blocks and ranks (S below 2n), bfloat16, batch 2 with MHA and a head dim of 64."""
    n = world.size
    for layout in LAYOUTS:
        for S in (1, n, 2 * n + 1):
            _case(world, 1, 2, 1, S, 16, True, layout, "auto", 210 + S, window=2)
        _case(world, 1, 4, 2, 23, 64, True, layout, "auto", 215, dtype=torch.bfloat16, tol=3e-2, window=5)
        _case(world, 2, 3, 3, 19, 64, True, layout, "auto", 216, window=4)


def check_window_names_no_algorithm(world):
    """A window shorter than the sequence runs the halo exchange, so a named algorithm is refused (on every rank,
    before anything moves: the group works afterwards); a window over the whole sequence is no window, and any
    algorithm runs it."""
    q, k, v = (xelink.cp_shard(t) for t in _qkv(1, 4, 2, 16, 16, 220))
    for algo in ALGOS:
        if world.size > 1:
            try:
                xelink.cp_attention(q, k, v, causal=True, window=5, algo=algo)
            except ValueError as e:
                assert f"algo must be 'auto', got '{algo}'" in str(e), str(e)
            else:
                raise AssertionError(f"no ValueError for window=5 with algo={algo!r}")
        _case(world, 1, 4, 2, 16, 16, True, "zigzag", algo, 221, window=16)
    _case(world, 1, 4, 2, 16, 16, True, "zigzag", "auto", 222, window=5)


def check_window_and_no_window_back_to_back(world):
    """Calls that change the window (and drop it), the shape and grad mode: each result as its own."""
    plan = [(17, 4, False), (17, None, True), (17, 9, True), (11, 2, False), (25, 25, True), (25, 3, False),
            (17, 4, True)]
    for i, (S, window, grad) in enumerate(plan):
        if grad:
            _grad_case(world, 1, 4, 2, S, 16, True, "zigzag", "auto", 230 + i, window=window)
        else:
            _case(world, 1, 4, 2, S, 16, True, "zigzag", "auto", 230 + i, window=window)


def check_window_gradients_every_layout_and_mask(world):
    groups = layouts(world, PACKAGES)
    for name, comm in groups:
        for layout in LAYOUTS:
            for causal in (True, False):
                for i, window in enumerate((1, 6, 13, 30)):
                    try:
                        _grad_case(comm, 1, 4, 2, 29, 16, causal, layout, "auto", 240 + i, use_lse=i % 2 == 0,
                                   window=window)
                    except AssertionError as e:
                        raise AssertionError(f"{name}: {e}") from None
    free(groups)
    for S in (1, world.size, 2 * world.size + 1):
        _grad_case(world, 1, 2, 1, S, 8, True, "zigzag", "auto", 250 + S, window=2)
    _grad_case(world, 1, 4, 2, 23, 64, True, "zigzag", "auto", 255, dtype=torch.bfloat16, tol=3e-2, window=5)


def _grad_case(comm, B, hq, hkv, S, D, causal, layout, algo, seed, dtype=torch.float64, tol=1e-5, use_lse=True,
               window=None):
    """The gradients of a loss of this rank's output (and LSE) shard: summed over the ranks, the loss is one
    loss of the whole attention, whose float64 gradients (sliced to the rank's positions) they must equal."""
    q, k, v = _qkv(B, hq, hkv, S, D, seed, torch.float64)
    g = torch.Generator().manual_seed(seed + 1)
    dout, dlse = torch.randn(B, hq, S, D, generator=g, dtype=torch.float64), torch.randn(B, hq, S, generator=g,
                                                                                        dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = full_attention(*full, causal, window=window)
    ((out * dout).sum() + use_lse * (lse * dlse).sum()).backward()
    shard = lambda x: xelink.cp_shard(x, group=comm, layout=layout)  # noqa: E731
    mine = [shard(t).to(dtype).requires_grad_() for t in (q, k, v)]
    o, l = xelink.cp_attention(*mine, causal=causal, group=comm, layout=layout, algo=algo, return_lse=True,
                               window=window)
    ((o.double() * shard(dout)).sum() + use_lse * (l.double() * shard(dlse)).sum()).backward()
    what = (f"grad B={B} hq={hq} hkv={hkv} S={S} D={D} causal={causal} {layout} {algo} {dtype} lse={use_lse} "
            f"window={window}")
    for name, got, want in zip("qkv", mine, full):
        assert got.grad is not None and got.grad.dtype == dtype, f"{what}: d{name} {got.grad}"
        want = shard(want.grad)
        scale = 1.0 if dtype == torch.float64 else max(1.0, want.abs().max().item())
        _check(got.grad, want, f"{what}: d{name}", tol * scale)


def check_gradients_every_algo_layout_and_mask(world):
    _every_group_layout_algo_and_mask(world, lambda comm, layout, algo, causal, i: _grad_case(
        comm, 1, 4, 2, (13, 29)[i], 16, causal, layout, algo, 20 * i + causal, use_lse=i == 0))


def check_gradients_short_sequences_mha_batch_and_auto(world):
    for layout in LAYOUTS:
        for algo in ALGOS + ("auto",):
            for S in (1, world.size, 2 * world.size + 1):  # empty blocks (and at S < n empty ranks)
                _grad_case(world, 1, 2, 1, S, 8, True, layout, algo, 40 + S)
            _grad_case(world, 2, 3, 3, 11, 8, False, layout, algo, 50)


def check_gradients_bfloat16(world):
    for algo in ALGOS:
        _grad_case(world, 1, 4, 2, 23, 64, True, "zigzag", algo, 60, dtype=torch.bfloat16, tol=3e-2)


def check_grad_and_no_grad_calls_back_to_back(world):
    """Calls with and without grad, under no_grad, changing algorithm and shape: each result as its own."""
    plan = [(13, True, "ring", True), (9, False, "all_gather", False), (17, True, "all_gather", True),
            (13, True, "ring", False), (5, False, "auto", True)]
    for i, (S, causal, algo, grad) in enumerate(plan):
        if grad:
            _grad_case(world, 1, 4, 2, S, 16, causal, "zigzag", algo, 70 + i)
        else:
            q, k, v = (t.requires_grad_() for t in _qkv(1, 4, 2, S, 16, 70 + i))
            with torch.no_grad():
                out = xelink.cp_attention(*(xelink.cp_shard(t) for t in (q, k, v)), causal=causal, algo=algo)
            assert out.grad_fn is None and not out.requires_grad
            _check(out, reference_flash_attention(q, k, v, causal=causal)[:, :, xelink.cp_positions(S)],
                   f"no_grad {algo}", 1e-5)


def check_a_rank_late_to_the_backward(world):
    """The last rank reaches its forward and then its backward 0.3 s after the others (which wait inside theirs):
    the gradients are still exact, for both algorithms and the windowed halo exchange."""
    import time

    q, k, v = _qkv(1, 4, 2, 21, 16, 86, torch.float64)
    for algo, window in [(algo, None) for algo in ALGOS] + [("auto", 4)]:
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        full_attention(*full, True, window=window)[0].pow(2).sum().backward()
        mine = [xelink.cp_shard(t).requires_grad_() for t in (q, k, v)]
        if window is not None and world.rank == world.size - 1:
            time.sleep(0.3)
        loss = xelink.cp_attention(*mine, causal=True, algo=algo, window=window).pow(2).sum()
        if world.rank == world.size - 1:
            time.sleep(0.3)
        loss.backward()
        for name, a, b in zip("qkv", mine, full):
            _check(a.grad, xelink.cp_shard(b.grad), f"late rank, {algo} window {window} d{name}", 1e-5)


def check_activation_checkpointing_recomputes_the_same_gradients(world):
    """torch.utils.checkpoint around cp_attention (reentrant and not): the forward runs again inside the backward
    (a collective inside a collective's backward, in the same order on every rank) and the gradients are those
    of the plain call, bit for bit."""
    from torch.utils.checkpoint import checkpoint

    q, k, v = _qkv(1, 4, 2, 17, 16, 85, torch.float64)

    def f(q, k, v, algo):
        return torch.tanh(xelink.cp_attention(q * 1.5, k, v, causal=True, algo=algo)).pow(2).sum()

    for algo in ALGOS:
        for reentrant in (False, True):
            plain, ckpt = ([xelink.cp_shard(t).requires_grad_() for t in (q, k, v)] for _ in range(2))
            f(*plain, algo).backward()
            checkpoint(f, *ckpt, algo, use_reentrant=reentrant).backward()
            for name, a, b in zip("qkv", plain, ckpt):
                assert torch.equal(a.grad, b.grad), (algo, reentrant, name)


def check_ranks_that_disagree_about_grad_all_raise(world):
    """A backward is collective: a rank whose inputs require grad among ranks whose do not would leave the
    others' backward waiting; every rank raises in the forward instead, and the group works afterwards."""
    if world.size == 1:
        return
    q, k, v = _qkv(1, 4, 2, 12, 16, 80)
    q, k, v = (xelink.cp_shard(t) for t in (q, k, v))
    q.requires_grad_(world.rank == 0)
    try:
        xelink.cp_attention(q, k, v, causal=True)
    except ValueError as e:
        assert "ranks disagree about the call" in str(e) and "requires grad" in str(e), str(e)
    else:
        raise AssertionError("no ValueError for ranks that disagree about grad")
    _grad_case(world, 1, 4, 2, 12, 16, True, "zigzag", "ring", 81)


def _layer(x, w, causal, attend):
    """A pre-norm attention block (4 q heads over 2 KV heads of 8) on x (B, S, 16), attention by ``attend``."""
    B, S, _ = x.shape
    h = torch.nn.functional.rms_norm(x, (16,))
    q = (h @ w["q"]).view(B, S, 4, 8).transpose(1, 2)
    k = (h @ w["k"]).view(B, S, 2, 8).transpose(1, 2)
    v = (h @ w["v"]).view(B, S, 2, 8).transpose(1, 2)
    o = attend(q, k, v, causal).transpose(1, 2).reshape(B, S, 32)
    return x + o @ w["o"]


def check_training_matches_one_process(world):
    """A real client: three SGD steps of an attention block on a sequence split over the ranks (zigzag, causal;
    the algorithm changing per step), each rank's loss its positions' share of the mean squared error, the
    weight gradients summed with xelink.all_reduce, against the same training in one process; then the same
    with a sliding window of 4 positions (Mistral's attention)."""
    _train(world, ("ring", "all_gather", "auto"), None)
    _train(world, ("auto",) * 3, 4)


def _train(world, algos, window):
    g = torch.Generator().manual_seed(90)
    shapes = {"q": (16, 32), "k": (16, 16), "v": (16, 16), "o": (32, 16)}
    init = {name: torch.randn(shape, generator=g, dtype=torch.float64) * 0.3 for name, shape in shapes.items()}
    x, y = torch.randn(2, 21, 16, generator=g, dtype=torch.float64), torch.randn(2, 21, 16, generator=g,
                                                                                 dtype=torch.float64)
    count = y.numel()
    one = {name: t.clone().requires_grad_() for name, t in init.items()}
    ours = {name: t.clone().requires_grad_() for name, t in init.items()}
    xs, ys = xelink.cp_shard(x, dim=1), xelink.cp_shard(y, dim=1)
    for step, algo in enumerate(algos):
        loss = ((_layer(x, one, True, lambda q, k, v, c: full_attention(q, k, v, c, window=window)[0]) - y) ** 2
                ).sum() / count
        loss.backward()
        mine = ((_layer(xs, ours, True, lambda q, k, v, c: xelink.cp_attention(q, k, v, causal=c, algo=algo,
                                                                             window=window))
                 - ys) ** 2).sum() / count
        mine.backward()
        _sgd_step(loss, mine, one, ours, f"step {step} ({algo}, window {window})")
    for name in shapes:
        _check(ours[name], one[name], f"weights {name} after training (window {window})", 1e-6)


def _sgd_step(loss, mine, one, ours, what):
    """One SGD step of both trainings (their losses back-propagated): the ranks' losses summed equal the one
    process's, and so do their weight gradients summed with all_reduce."""
    total = torch.tensor([mine.item()], dtype=torch.float64)
    xelink.all_reduce(total)
    assert abs(total.item() - loss.item()) <= 1e-6 * abs(loss.item()), (what, total.item(), loss.item())
    with torch.no_grad():
        for name in one:
            xelink.all_reduce(ours[name].grad)
            _check(ours[name].grad, one[name].grad, f"{what} grad {name}", 1e-6)
            for w in (one[name], ours[name]):
                w -= 0.5 * w.grad
                w.grad = None


@only(launchers=("mpi",), sizes=(2, 3))
def check_an_error_part_way_through_the_backward_fails_the_group(world):
    """Rank 0's backward raises after its messages were posted (the ring's, then the windowed halo's: after the KV
    halo arrived, before the gradients' return trip): its next call on the group raises at once (the group and its
    duplicate refuse further use) instead of taking the failed call's stray messages for its own; the other ranks'
    waits expire naming a rank, or their next call raises; a new group works."""
    import pytest

    import xelink.dist.cp_backward as cpb
    import xelink.dist.cp_window as cpw

    for module, algo, window in ((cpb, "ring", None), (cpw, "auto", 3)):
        sub = world.split(0)
        sub.timeout = 2.0  # (read by the group's private duplicate, made on the first call)
        q, k, v = (xelink.cp_shard(t, group=sub).requires_grad_() for t in _qkv(1, 4, 2, 16, 16, 91))
        real, calls = module.flash_attention_backward, []

        def broken(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2 or module is cpw:
                raise RuntimeError("injected")
            return real(*args, **kwargs)

        if world.rank == 0:
            module.flash_attention_backward = broken
        try:
            try:
                xelink.cp_attention(q, k, v, causal=True, group=sub, algo=algo, window=window).sum().backward()
                assert world.rank != 0, "the injected error did not surface"
            except xelink.TimeoutError:
                assert world.rank != 0
            except RuntimeError as e:
                assert world.rank == 0 and "injected" in str(e), str(e)
        finally:
            module.flash_attention_backward = real
        with pytest.raises((xelink.XelinkError, xelink.TimeoutError)) as info:
            with torch.no_grad():
                xelink.cp_attention(q, k, v, causal=True, group=sub, algo=algo, window=window)
        if world.rank == 0:
            assert "unusable after an earlier failure" in str(info.value), str(info.value)
        sub.free()
        fresh = world.split(0)
        _grad_case(fresh, 1, 4, 2, 16, 16, True, "zigzag", algo, 92, window=window)
        fresh.free()


@only(sizes=(2, 3, 4))
def check_ring_backward_posts_no_partial_receive_ahead_of_its_step(world):
    """While this rank launches the kernels of step s, no receive of a partial gradient for a later step is
    pending: that message's sender posts it only after its own step-s kernels, and on CUDA a kernel's first
    launch waits for the running kernels, so such a receive, spinning for a neighbour in the same state,
    stalled both ranks until the deadline (an H100 run, benchmarks/results/h100-training). The partial for
    step s itself may be pending (its sender posted it before its step-s kernels), as may the KV blocks'."""
    import xelink.dist.cp_backward as cpb

    n = world.size
    real = (cpb.irecv, cpb._attend_backward)
    pending, violations, counts = set(), [], {"posted": 0, "steps": 0}

    class Tracked:
        def __init__(self, work, step):
            self.work, self.step = work, step
            pending.add(self)

        def wait(self, *args, **kwargs):
            pending.discard(self)
            return self.work.wait(*args, **kwargs)

    def irecv(t, src=None, group=None, tag=0, group_src=None):
        work = real[0](t, src, group=group, tag=tag, group_src=group_src)
        if tag < n:  # a KV block (tags n + owner: gradients, cp_backward's docstring)
            return work
        counts["posted"] += 1  # the i-th partial received is the one for step i (the n-th: the total)
        return Tracked(work, counts["posted"])

    def attend(*args, **kwargs):  # one call a step
        step = counts["steps"]
        counts["steps"] += 1
        violations.extend((step, r.step) for r in pending if r.step > step)
        return real[1](*args, **kwargs)

    cpb.irecv, cpb._attend_backward = irecv, attend
    try:
        for layout in ("zigzag", "contiguous"):
            counts.update(posted=0, steps=0)
            _grad_case(world, 1, 4, 2, 40, 16, True, layout, "ring", 93)
            assert counts["steps"] == n and counts["posted"] == n, counts
    finally:
        cpb.irecv, cpb._attend_backward = real
    assert not violations, f"(step launched, step of a pending partial receive): {violations}"


# -- packed sequences (cp_attention_varlen) -------------------------------------------------------------------

# (offsets) cases: a zero-length and a one-token sequence among long ones crossing rank blocks, one sequence, many
# one-token sequences, and fewer tokens than ranks (ranks with no token at 3 and 4)
VARLEN_OFFSETS = ([0, 5, 5, 17, 18, 40], [0, 23], [0, 1, 2, 3, 4, 5, 6, 7], [0, 2], [0, 9, 30, 31])


def _packed(T, hq, hkv, D, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(T, h, D, generator=g).to(dtype) for h in (hq, hkv, hkv))


def _varlen_full(q, k, v, cu, causal, window=None):
    """(out (T, Hq, D), lse (Hq, T)) of each packed sequence attended alone, in plain torch (full_attention)."""
    outs, lses = [], []
    for a, b in zip(cu, cu[1:]):
        if a == b:
            continue
        o, lse = full_attention(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), causal, window=window)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def _varlen_case(comm, cu, hq, hkv, D, causal, seed, window=None, dtype=torch.float32, tol=1e-5, grad=False,
                 layout="zigzag", stride=None):
    """cp_attention_varlen of this rank's share (cp_shard with the offsets) against _varlen_full of the whole packed
    batch at the rank's positions (cp_positions with the offsets): out, LSE and, with grad, dq / dk / dv of a loss
    of both, in float64; ``stride``: heads_k_stride."""
    T = cu[-1]
    q, k, v = _packed(T, hq, hkv, D, seed)
    g = torch.Generator().manual_seed(seed + 1)
    dout, dlse = torch.randn(T, hq, D, generator=g, dtype=torch.float64), torch.randn(hq, T, generator=g,
                                                                                     dtype=torch.float64)
    full = [t.clone().requires_grad_(grad) for t in (q, k, v)]
    want, want_lse = _varlen_full(*full, cu, causal, window)
    cu_t = torch.tensor(cu, dtype=torch.int32 if seed % 2 else torch.int64)
    pos = xelink.cp_positions(T, group=comm, layout=layout, cu_seqlens=cu_t)
    shard = lambda x, dim=0: x.index_select(dim, pos)  # noqa: E731
    mine = [xelink.cp_shard(t, group=comm, layout=layout, dim=0, cu_seqlens=cu_t).to(dtype).requires_grad_(grad)
            for t in (q, k, v)]
    assert torch.equal(mine[0], shard(q).to(dtype)), "cp_shard and cp_positions disagree"
    saved = []  # the bytes autograd keeps for the backward: this rank's tensors only, never the gathered keys
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        out, lse = xelink.cp_attention_varlen(*mine, cu_t, causal=causal, group=comm, layout=layout, window=window,
                                              return_lse=True, heads_k_stride=stride)
    what = (f"varlen {layout} cu={cu} hq={hq} hkv={hkv} D={D} causal={causal} window={window} {dtype} grad={grad} "
            f"stride={stride}")
    local = sum(t.numel() * t.element_size() for t in (*mine, out, lse))
    assert sum(saved) <= local, f"{what}: {sum(saved)} bytes kept for the backward, more than the local {local}"
    n_local = mine[0].shape[0]
    assert out.shape == (n_local, hq, D) and out.dtype == dtype, f"{what}: out {out.shape} {out.dtype}"
    assert lse.shape == (hq, n_local) and lse.dtype == torch.float32, f"{what}: lse {lse.shape} {lse.dtype}"
    _check(out, shard(want.detach()), what, tol)
    _check(lse, shard(want_lse.detach(), 1), f"{what} lse", 1e-5 if dtype != torch.bfloat16 else 2e-2)
    if grad:
        ((want * dout).sum() + (want_lse * dlse).sum()).backward()
        ((out.double() * shard(dout)).sum() + (lse.double() * shard(dlse, 1)).sum()).backward()
        for name, got, ref in zip("qkv", mine, full):
            assert got.grad is not None and got.grad.shape == got.shape, f"{what}: d{name} {got.grad}"
            _check(got.grad, shard(ref.grad), f"{what}: d{name}", tol)


def check_varlen_sequences_across_ranks(world):
    """Packed sequences in both layouts (zigzag: each sequence's 2n blocks; contiguous: the packed stream's n blocks):
    sequences inside a block, across blocks, of one token, empty, shorter than the blocks, fewer tokens than ranks;
    causal or not, windows shorter and longer than sequences, GQA and MHA, float32 / float64 / bfloat16, int32 and
    int64 offsets; back-to-back calls that change every one of these; cp_unshard of cp_shard with the offsets."""
    for layout in LAYOUTS:
        for i, cu in enumerate(VARLEN_OFFSETS):
            for causal in (True, False):
                for window in (None, 3, 100):
                    _varlen_case(world, cu, 4, 2, 16, causal, 300 + 10 * i + causal, window, layout=layout)
        _varlen_case(world, [0, 7, 19, 26], 2, 2, 64, True, 351, layout=layout)
        _varlen_case(world, [0, 7, 19, 26], 4, 1, 32, True, 352, dtype=torch.bfloat16, tol=3e-2, layout=layout)
        _varlen_case(world, [0, 7, 19, 26], 4, 2, 16, False, 353, dtype=torch.float64, tol=1e-10, layout=layout)
        for cu in VARLEN_OFFSETS:
            cu_t = torch.tensor(cu)
            x = torch.arange(cu[-1] * 3, dtype=torch.float32).reshape(1, cu[-1], 3)
            local = xelink.cp_shard(x, layout=layout, dim=1, cu_seqlens=cu_t)
            assert torch.equal(xelink.cp_unshard(local, seq_len=cu[-1], layout=layout, dim=1, cu_seqlens=cu_t), x)


def check_varlen_gradients(world):
    """dq, dk, dv of a loss of this rank's output and LSE (summed over the ranks: one loss of the whole batch)
    against autograd of plain-torch float64 attention of each sequence; ranks without a token run the backward
    too (their gathers' gradient), and calls with and without grad alternate; the keys gathered all at once, one KV
    head at a time, and two of three heads at a time (a shorter last chunk)."""
    for layout in LAYOUTS:
        for i, cu in enumerate(VARLEN_OFFSETS):
            for causal in (True, False):
                window = (None, 4)[i % 2]
                stride = (None, 1)[(i + causal) % 2]
                _varlen_case(world, cu, 4, 2, 16, causal, 400 + 10 * i + causal, window, torch.float64, 1e-5, True,
                             layout, stride)
                _varlen_case(world, cu, 4, 2, 16, causal, 405 + 10 * i + causal, window, layout=layout, stride=stride)
        _varlen_case(world, [0, 7, 19, 26], 6, 3, 16, True, 470, 5, torch.float64, 1e-5, True, layout, 2)


def check_varlen_training_matches_one_process(world):
    """A real client: three SGD steps of an attention block over a packed batch of four sequences laid over the
    ranks (zigzag, then contiguous one KV head at a time), each rank's loss its tokens' share of the mean squared
    error, weight gradients summed with xelink.all_reduce, against the same training in one process (plain torch per
    sequence)."""
    for layout, stride in (("zigzag", None), ("contiguous", 1)):
        _varlen_train(world, layout, stride)


def _varlen_train(world, layout, stride):
    g = torch.Generator().manual_seed(91)
    cu = [0, 6, 7, 20, 29]
    shapes = {"q": (32, 16), "k": (16, 16), "v": (16, 16), "o": (16, 32)}  # (out, in)
    init = {name: torch.randn(shape, generator=g, dtype=torch.float64) * 0.3 for name, shape in shapes.items()}
    x, y = (torch.randn(cu[-1], 16, generator=g, dtype=torch.float64) for _ in range(2))
    one = {name: t.clone().requires_grad_() for name, t in init.items()}
    ours = {name: t.clone().requires_grad_() for name, t in init.items()}
    cu_t = torch.tensor(cu)
    xs, ys = (xelink.cp_shard(t, layout=layout, dim=0, cu_seqlens=cu_t) for t in (x, y))

    def layer(x, w, attend):
        q, k, v = ((x @ w[name].t()).unflatten(-1, (-1, 8)) for name in "qkv")  # 4 q heads, 2 KV heads of 8
        return attend(q, k, v).flatten(-2) @ w["o"].t()

    for step in range(3):
        loss = ((layer(x, one, lambda q, k, v: _varlen_full(q, k, v, cu, True)[0]) - y) ** 2).sum() / y.numel()
        loss.backward()
        mine = ((layer(xs, ours, lambda q, k, v: xelink.cp_attention_varlen(q, k, v, cu_t, causal=True, layout=layout,
                                                                           heads_k_stride=stride)) - ys) ** 2
                ).sum() / y.numel()
        mine.backward()
        _sgd_step(loss, mine, one, ours, f"varlen {layout} step {step}")
    for name in shapes:
        _check(ours[name], one[name], f"varlen {layout} weights {name} after training", 1e-6)


def check_varlen_bad_input_and_ranks_that_disagree(world):
    """Bad input raises on the calling rank before anything is sent; offsets or grad that differ between ranks
    raise the same error on every rank (after the one signature exchange), and the group still works after; a rank
    late to the call is waited for."""
    cu = torch.tensor([0, 8, 20])
    q, k, v = (xelink.cp_shard(t, dim=0, cu_seqlens=cu) for t in _packed(20, 4, 2, 16, 5, torch.float32))
    f = xelink.cp_attention_varlen
    for call, error, match in [
            (lambda: f(q[None], k, v, cu), ValueError, r"cp_attention_varlen: q must be 3-D"),
            (lambda: f(q, k[:, :1].expand(-1, 3, -1), v, cu), ValueError, "k.shape="),
            (lambda: f(q, k, v, cu.float()), ValueError, "cu_seqlens must be a 1-D int32/int64"),
            (lambda: f(q, k, v, torch.tensor([0, 9, 8, 20])), ValueError, "must start at 0 and never decrease"),
            (lambda: f(q, k, v, cu, max_seqlen=5), ValueError, r"max_seqlen=5 must be None or an int >= the longest"),
            (lambda: f(q, k, v, cu, window=0), ValueError, "window=0"),
            (lambda: f(q, k, v, cu, layout="ring"), ValueError, "layout='ring' is not one of"),
            (lambda: f(q, k, v, cu, heads_k_stride=0), ValueError, "heads_k_stride=0 must be None or an int >= 1"),
            (lambda: f(q, k, v, torch.tensor([0, 8, 21])), ValueError, "cut the packed tensors with xelink.cp_shard"),
            (lambda: f(q, k, v.double(), cu), TypeError, "dtypes differ")]:
        try:
            call()
        except error as e:
            assert re.search(match, str(e)), (match, str(e))
        else:
            raise AssertionError(f"no {error.__name__} matching {match!r}")
    if world.size > 1:
        other = torch.tensor([0, 9, 20]) if world.rank == world.size - 1 else cu
        for args, kwargs in [((q, k, v, other), {}), ((q.clone().requires_grad_(world.rank == 0), k, v, cu), {}),
                             ((q, k, v, cu), dict(heads_k_stride=1 if world.rank else None))]:
            try:
                f(*args, **kwargs)
            except ValueError as e:
                assert "cp_attention_varlen: ranks disagree about the call" in str(e), str(e)
            else:
                raise AssertionError("ranks that disagree did not raise")
    _varlen_case(world, [0, 8, 20], 4, 2, 16, True, 77)  # the group still works
    if world.rank == 0:
        time.sleep(0.5)  # a rank late to the call (and to the backward): the others wait for it
    _varlen_case(world, [0, 3, 20, 21], 4, 2, 16, True, 78, grad=True, dtype=torch.float64)


@only(sizes=(2,))
def check_varlen_under_torch_compile(world):
    """A compiled function around cp_attention_varlen (a graph break there: the offsets are read on the host) gives
    the eager output and gradients."""
    cu = torch.tensor([0, 10, 25])
    q, k, v = (xelink.cp_shard(t, dim=0, cu_seqlens=cu).requires_grad_() for t in _packed(25, 4, 2, 16, 11))

    def f(q, k, v):
        return (xelink.cp_attention_varlen(q * 2, k, v, cu, causal=True) ** 2).sum()

    eager = f(q, k, v)
    want = torch.autograd.grad(eager, (q, k, v))
    compiled = torch.compile(f, backend="aot_eager")(q, k, v)
    got = torch.autograd.grad(compiled, (q, k, v))
    _check(compiled, eager, "varlen compiled loss", 1e-12)
    for name, a, b in zip("qkv", got, want):
        _check(a, b, f"varlen compiled d{name}", 1e-12)

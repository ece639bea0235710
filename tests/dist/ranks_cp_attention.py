"""Context-parallel attention on CPU ranks: both algorithms, both layouts, causal and not, GQA (4 q heads over
2 KV heads) and MHA, head dims 64/128/256, lengths that the block count does not divide (and shorter than
it), float32 (1e-5, out and LSE) and bfloat16, against reference_flash_attention over the whole sequence
(computed on every rank from the same seed) sliced to the rank's positions; flat and as packages (one rank
each at 2, 2+1 at 3, 2x2 at 4: the ring then runs package after package); cp_shard/cp_unshard round trips,
cp_positions, seq_len= without the exchange, back-to-back calls that change shape and algorithm, ranks that
disagree (every rank raises the same error), and torch.compile through the custom op (2 ranks)."""
import torch
from ranks import only

import xelink
from dist_cases import free, layouts
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


def _case(comm, B, hq, hkv, S, D, causal, layout, algo, seed, dtype=torch.float32, tol=1e-5, scale=None):
    q, k, v = _qkv(B, hq, hkv, S, D, seed, dtype)
    want, want_lse = reference_flash_attention(q.float(), k.float(), v.float(), causal=causal, scale=scale,
                                               return_lse=True)
    pos = xelink.cp_positions(S, group=comm, layout=layout)
    shard = lambda x: xelink.cp_shard(x, group=comm, layout=layout)  # noqa: E731
    out, lse = xelink.cp_attention(shard(q), shard(k), shard(v), causal=causal, scale=scale, group=comm,
                                   layout=layout, algo=algo, return_lse=True)
    what = f"B={B} hq={hq} hkv={hkv} S={S} D={D} causal={causal} {layout} {algo} {dtype}"
    assert out.shape == (B, hq, pos.numel(), D) and out.dtype == dtype, f"{what}: {out.shape} {out.dtype}"
    assert lse.shape == (B, hq, pos.numel()) and lse.dtype == torch.float32, f"{what}: lse {lse.shape}"
    _check(out, want[:, :, pos], what, tol)
    _check(lse, want_lse[:, :, pos], f"{what} lse", 1e-5 if dtype == torch.float32 else 2e-2)
    return out


def check_every_algo_layout_and_mask(world):
    groups = layouts(world, PACKAGES)
    for name, comm in groups:
        for layout in LAYOUTS:
            for algo in ALGOS:
                for causal in (False, True):
                    for i, (S, D) in enumerate(((13, 64), (29, 64))):
                        try:
                            _case(comm, 1, 4, 2, S, D, causal, layout, algo, 10 * i + causal)
                        except AssertionError as e:
                            raise AssertionError(f"{name}: {e}") from None
    free(groups)


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

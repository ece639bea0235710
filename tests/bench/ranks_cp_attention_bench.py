"""The cp-attention family on CPU ranks: both algorithms in both causal modes next to one device's flash
attention, the blocking ring and the launch's all-gather then SDPA, the timed outputs checked, a wrong output
counted, the outputs written; the windowed rows (``--window``)."""
import contextlib
import json
import tempfile

import xelink
from xelink.bench import suite
from xelink.bench.families import cp_attention as fam

WORLD_SIZES = (1, 2)


def _ctx(world, *extra):
    out = world.allgather_object(tempfile.mkdtemp(prefix="xelink-cp-attention-") if world.rank == 0 else None)[0]
    args = suite.family_parser("cp-attention").parse_args(
        ["--quick", "--shapes", "64x2x32", "--iters", "1", "--rounds", "2", "--out", out, "--plots", *extra])
    return suite.Context(world, "cp-attention", args)


@contextlib.contextmanager
def _wrong_algo(algo):
    """xelink.cp_attention with ``algo``'s output off in one element on every rank."""
    real = xelink.cp_attention

    def call(*args, **kw):
        out = real(*args, **kw)
        if kw.get("algo") == algo:
            out = out.clone()
            out[0, 0, 0, 0] += 1.0
        return out

    xelink.cp_attention = call
    try:
        yield
    finally:
        xelink.cp_attention = real


def check_both_algorithms_both_causal_modes_and_the_baselines_are_timed_and_checked(world):
    ctx = _ctx(world)
    rows = fam.run(ctx)
    if world.rank:
        assert rows == []
        return
    base = "mpi" if world.transport.name == "mpi" else "gloo"
    common = {"xelink:ring", "xelink:all_gather", fam.SINGLE, fam.BLOCKING}
    got = {(r.op, r.path) for r in rows}
    assert got == {("cp_attention", p) for p in common | {f"{base}:all_gather+sdpa"}} | \
        {("cp_attention:causal", p) for p in common}, got
    for r in rows:
        assert r.wrong == 0 and r.time_us > 0 and r.nranks == world.size, r
        assert r.extra["shape"] == "N=64 H=2 D=32" and r.extra["causal"] == r.op.endswith(":causal")
        if r.path != fam.SINGLE:
            assert r.baseline == fam.SINGLE and r.ratio > 0
    by = {(r.op, r.path): r for r in rows}
    assert by["cp_attention", "xelink:ring"].extra["vs_blocking_ring"] > 0
    assert by["cp_attention:causal", "xelink:ring"].extra["vs_blocking_ring"] > 0
    assert by["cp_attention", "xelink:all_gather"].extra["vs_gather_sdpa"] > 0
    assert "vs_gather_sdpa" not in by["cp_attention:causal", "xelink:all_gather"].extra
    assert any("causal: the all-gather + SDPA baseline left out" in n for n in ctx.notes)
    suite.write_outputs(ctx, rows)
    lines = [json.loads(x) for x in ctx.path(".jsonl").read_text().splitlines()]
    assert len(lines) == len(rows) and lines[0]["manifest"]["extra"]["family"] == "cp-attention"
    assert "the overlap alone" in ctx.path(".txt").read_text()
    assert (ctx.out / "cp-attention-cp_attention.png").is_file()


def check_window_rows_are_timed_and_checked(world):
    """--window: the halo exchange, one device's windowed attention and the gathered baseline, causal only, every
    timed output checked against SDPA with the window's mask; a wrong halo output is counted."""
    for layout in ("zigzag", "contiguous"):
        ctx = _ctx(world, "--window", "5", "--layout", layout)
        rows = fam.run(ctx)
        if world.rank:
            assert rows == []
            continue
        by = {(r.op, r.path): r for r in rows}
        assert set(by) == {("cp_attention:window", p) for p in ("xelink:halo", fam.SINGLE, "gather:window")}, set(by)
        for r in rows:
            assert r.wrong == 0 and r.time_us > 0 and r.extra["window"] == 5 and r.extra["causal"], r
        assert by["cp_attention:window", "xelink:halo"].extra["vs_gather"] > 0
        assert not any("target" in n for n in ctx.notes), ctx.notes
    real = xelink.cp_attention

    def off(*args, **kw):
        out = real(*args, **kw).clone()
        out[0, 0, 0, 0] += 1.0
        return out

    xelink.cp_attention = off
    try:
        rows = fam.run(_ctx(world, "--window", "5"))
    finally:
        xelink.cp_attention = real
    if world.rank == 0:
        assert {r.path: r.wrong for r in rows}["xelink:halo"] > 0, rows


def check_the_blocking_ring_agrees_with_the_op_contiguous_and_uneven(world):
    import torch

    q, k, v = (torch.randn(1, 2, 37, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    for causal in (False, True):
        want = xelink.cp_shard(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal),
                               layout="contiguous")
        ql, kl, vl = (xelink.cp_shard(x, layout="contiguous") for x in (q, k, v))
        got = fam.blocking_ring(world, ql, torch.stack((kl, vl)), 37, "contiguous", causal)
        assert fam.wrong_count(got, want, 1e-4) == 0


def check_a_wrong_output_of_a_timed_call_is_counted(world):
    ctx = _ctx(world, "--algos", "ring", "--causal", "on")
    with _wrong_algo("ring"):
        rows = fam.run(ctx)
    if world.rank == 0:
        wrong = {r.path: r.wrong for r in rows}
        # one element off on every rank, checked after each of the 2 rounds
        assert wrong["xelink:ring"] == 2 * world.size and wrong[fam.SINGLE] == wrong[fam.BLOCKING] == 0, wrong

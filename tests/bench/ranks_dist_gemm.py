"""The dist-gemm family on CPU ranks: every op x algorithm next to the GEMM alone and MPI's all-gather /
reduce-scatter then matmul, the timed outputs checked, the cost model's prediction, the outputs written.

Until issue 21's ops exist in this tree, ``dist_gemm_stand_in`` puts minimal stand-ins on ``xelink``
(the test's own; the family looks the ops up when it runs)."""
import importlib.util
import json
import tempfile
from pathlib import Path

from xelink.bench import suite
from xelink.bench.families import dist_gemm

WORLD_SIZES = (1, 3)
_spec = importlib.util.spec_from_file_location("dist_gemm_stand_in", Path(__file__).with_name("dist_gemm_stand_in.py"))
stand_in = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stand_in)


def _ctx(world, *extra):
    out = world.allgather_object(tempfile.mkdtemp(prefix="xelink-dist-gemm-") if world.rank == 0 else None)[0]
    args = suite.family_parser("dist-gemm").parse_args(
        ["--quick", "--shapes", "64x32x48", "--iters", "1", "--rounds", "2", "--out", out, "--plots", *extra])
    return suite.Context(world, "dist-gemm", args)


def check_every_algorithm_is_timed_checked_and_priced(world):
    ctx = _ctx(world)
    with stand_in.ops():
        rows = dist_gemm.run(ctx)
    if world.rank:
        assert rows == []
        return
    n = world.size
    base = "mpi" if world.transport.name == "mpi" else "gloo"
    M = 64 // n * n
    got = {(r.op, r.path) for r in rows}
    assert got == {(op, p) for op in dist_gemm.OPS for p in
                   [f"xelink:{a}" for a in dist_gemm.ALGOS if a != "fused"] + [dist_gemm.GEMM] +
                   [f"{base}:all_gather+matmul" if op == "all_gather_matmul" else f"{base}:matmul+reduce_scatter"]}
    for r in rows:
        assert r.wrong == 0 and r.time_us > 0 and r.nranks == n and r.extra["shape"] == f"{M}x32x48", r
        assert r.count == M * 32 and r.size_bytes == M * (48 if r.op == "all_gather_matmul" else 32) * 4
        if r.path != dist_gemm.GEMM:
            assert r.baseline == dist_gemm.GEMM and r.ratio > 0
            assert abs(r.extra["pct_of_gemm_alone"] - 100 * r.ratio) < 1e-6
            assert r.extra["vs_unfused"] > 0 if "+" not in r.path else "vs_unfused" not in r.extra
        if r.path.startswith("xelink:"):
            assert r.predicted_us > 0 and r.extra["pred_over_meas"] > 0
    suite.write_outputs(ctx, rows)
    lines = [json.loads(x) for x in ctx.path(".jsonl").read_text().splitlines()]
    assert len(lines) == len(rows) and lines[0]["manifest"]["extra"]["family"] == "dist-gemm"
    text = ctx.path(".txt").read_text()
    assert "% of GEMM-alone speed" in text and "share of GEMM-alone speed" in text
    assert (ctx.out / "dist-gemm-all_gather_matmul.png").is_file()


def check_a_wrong_output_of_a_timed_call_is_counted(world):
    ctx = _ctx(world, "--algos", "topo", "--ops", "all_gather_matmul")
    with stand_in.ops(wrong_algo="topo"):
        rows = dist_gemm.run(ctx)
    if world.rank == 0:
        wrong = {r.path: r.wrong for r in rows}
        # one element off on every rank, checked after each of the 2 rounds
        assert wrong["xelink:topo"] == 2 * world.size and wrong[dist_gemm.GEMM] == 0


def check_without_the_ops_the_family_says_so(world):
    ctx = _ctx(world)
    with stand_in.ops(missing=True):
        rows = dist_gemm.run(ctx)
    assert rows == []
    if world.rank == 0:
        assert any("skipped: xelink.all_gather_matmul does not exist" in n for n in ctx.notes)

"""The suite on real ranks: the links matrix, and ``xelink bench all --quick`` (at tiny sizes) end to end."""
import importlib.util
import json
import tempfile
from pathlib import Path

from xelink import cost, tuning
from xelink import topology as T
from xelink.bench import probe, suite
from xelink.bench.families import attention, collectives, cp_attention, decode, dist_gemm, gemm, gemv, links, norm
from xelink.models import DecodeLayerConfig

WORLD_SIZES = (2,)
_spec = importlib.util.spec_from_file_location("dist_gemm_stand_in", Path(__file__).with_name("dist_gemm_stand_in.py"))
stand_in = importlib.util.module_from_spec(_spec)  # issue 21's ops, where this tree lacks them
_spec.loader.exec_module(stand_in)


def _shared_dir(world) -> Path:
    return Path(world.allgather_object(tempfile.mkdtemp(prefix="xelink-suite-") if world.rank == 0 else None)[0])


def check_links_measures_every_pair_and_writes_the_matrix(world):
    out = _shared_dir(world)
    args = suite.family_parser("links").parse_args(
        ["--quick", "--sizes", "8", "64K", "--iters", "2", "--rounds", "1", "--out", str(out), "--plots",
         "--topology-out", str(out / "t.toml"), "--calibration-out", str(out / "c.toml")])
    ctx = suite.Context(world, "links", args)
    rows = links.run(ctx)
    assert [(r.op, r.path, r.size_bytes, r.extra["pair"]) for r in rows] == \
        [("p2p", "xelink:pingpong", 8, [0, 1]), ("p2p", "xelink:pingpong", 65536, [0, 1])]
    assert all(r.time_us > 0 and r.wrong == 0 for r in rows)
    assert rows[0].extra["latency_us"] > 0 and rows[0].extra["bandwidth_gbps"] > 0
    if world.rank == 0:
        suite.write_outputs(ctx, rows)
        text = (out / "links.txt").read_text()
        assert "one-way latency (us)" in text and "bandwidth (GB/s, one way)" in text
        assert (out / "links-matrix.png").stat().st_size > 5000
        assert len((out / "links.jsonl").read_text().splitlines()) == 2
        topo, cal = T.load(out / "t.toml"), cost.load_calibration(out / "c.toml")
        assert topo.name.endswith("-probed") and cal.topology == topo.name
        assert topo.links[0].latency_source.startswith("measured here: by `xelink bench probe`")


def check_all_quick_runs_every_family_into_one_folder(world):
    out = _shared_dir(world)
    # The quick suite at tiny sizes: the same code paths in a few seconds.
    saved = (dict(probe.QUICK), collectives.QUICK_SIZES, dict(collectives.QUICK), gemm.QUICK_SHAPES, gemv.QUICK_SHAPES,
             norm.QUICK_SHAPES, attention.QUICK_SHAPES, decode.QUICK_CPU_CONFIG, dist_gemm.QUICK_SHAPES,
             cp_attention.QUICK_SHAPES)
    probe.QUICK.update(pingpong_sizes=(8, 4096), exchange_sizes=(4096, 16384), local_sizes=(4096, 16384),
                       iters=1, rounds=1)
    collectives.QUICK_SIZES = (1024, 8192)
    collectives.QUICK["iters"], collectives.QUICK["rounds"] = 1, 1
    gemm.QUICK_SHAPES, gemv.QUICK_SHAPES, norm.QUICK_SHAPES = ((32, 32, 32),), ((256, 256),), ((16, 256),)
    attention.QUICK_SHAPES = (("mha", 1, 2, 2, 32, 64, False), ("decode", 1, 4, 2, 64, 64, False))
    decode.QUICK_CPU_CONFIG = DecodeLayerConfig(hidden=128, heads=2, kv_heads=1, ffn=128, context=16)
    dist_gemm.QUICK_SHAPES = ((32, 16, 16),)
    cp_attention.QUICK_SHAPES = ((32, 2, 16),)
    if world.rank == 0:  # a folder reused from an older run: its links outputs must not be read back
        (out / "topology.toml").write_text("# an older format\n")
        (out / "calibration.toml").write_text("# an older format\n")
    world.barrier()
    try:
        with stand_in.ops():
            status = suite.main_all(["--quick", "--out", str(out), "--csv", "--tune", str(out / "t.tuning.json")])
    finally:
        probe.QUICK.clear()
        probe.QUICK.update(saved[0])
        collectives.QUICK_SIZES = saved[1]
        collectives.QUICK.update(saved[2])
        gemm.QUICK_SHAPES, gemv.QUICK_SHAPES, norm.QUICK_SHAPES, attention.QUICK_SHAPES = saved[3:7]
        decode.QUICK_CPU_CONFIG, dist_gemm.QUICK_SHAPES, cp_attention.QUICK_SHAPES = saved[7:10]
    assert status == 0
    if world.rank == 0:
        names = {p.name for p in out.iterdir()}
        for family in ("links", "collectives", "dist-gemm", "cp-attention", "gemm", "gemv", "norm", "attention", "decode",
                       "sycl-collectives"):
            assert {f"{family}.jsonl", f"{family}.txt", f"{family}.csv"} <= names, (family, sorted(names))
        assert {"links-matrix.png", "collectives-all_to_all-float32.png", "gemm-gemm.png",
                "attention-decode_attention.png", "norm-rope.png", "dist-gemm-matmul_reduce_scatter.png", "cp-attention-cp_attention_causal.png",
                "decode-decode-layer.png", "calibration.toml",
                "topology.toml", "summary.txt", "t.tuning.json"} <= names
        rows = [json.loads(line) for line in (out / "collectives.jsonl").read_text().splitlines()]
        assert {r["op"] for r in rows} == set(collectives.OPS) and all(r["wrong"] == 0 for r in rows)
        # nccl-tests' count: one rank's share of all_gather's output and reduce_scatter's input, the whole buffer else
        share = {"all_gather": world.size, "reduce_scatter": world.size}
        assert all(r["count"] * 4 * share.get(r["op"], 1) == r["size_bytes"] for r in rows), \
            [(r["op"], r["size_bytes"], r["count"]) for r in rows]
        ours = [r for r in rows if r["path"].startswith("xelink:")]
        # Priced with the calibration the links family measured in the same launch.
        assert all(r["predicted_us"] > 0 and r["extra"]["model"]["calibration"].endswith("-probed") for r in ours)
        assert rows[0]["manifest"]["extra"]["family"] == "collectives"
        summary = (out / "summary.txt").read_text()
        assert "gpu-collectives  skipped: needs one CUDA GPU per rank" in summary
        assert "sycl-collectives ok (" in summary  # the test extra installs dpctl (tests/sycl never skip)
        assert summary.count(" ok (") == 10
        # The table the suite wrote is the one xelink.init finds for this job (the same fingerprint).
        here = tuning.fingerprint(world.topology.name, world.hosts, world.world_placement)
        assert tuning.find_table(here, [out]).source == str(out / "t.tuning.json")


def check_decode_parallel_rows(world):
    # `xelink bench decode` on several ranks: TP = n against the plain-torch twin with the launch's collectives
    # (the same logits: the twin is an independent implementation on the same slices) and CP = n against TP = 1
    # on rank 0; every rank takes part, the rows land on rank 0; --no-parallel leaves them out.
    def run(*flags):
        args = suite.family_parser("decode").parse_args(["--quick", "--iters", "2", "--rounds", "1", *flags])
        return decode.run(suite.Context(world, "decode", args))

    rows, solo = run("--parallel-only"), run("--no-parallel", "--model-only")
    if world.rank:
        assert rows == [] and solo == []
        return
    n = world.size
    by = {r.path: r for r in rows}
    tp, twin = by[f"xelink:reference float32 tp={n}"], next(r for p, r in by.items() if p.startswith("torch+"))
    assert twin.path in (f"torch+mpi:eager float32 tp={n}", f"torch+gloo:eager float32 tp={n}")
    assert tp.baseline == twin.path and tp.ratio > 0 and tp.nranks == n and (tp.extra["tp"], tp.extra["cp"]) == (n, 1)
    assert tp.extra["same_next_token"] and tp.extra["logits_rel_rms_diff"] < 1e-5 and tp.extra["ranks_agree"]
    cp, one = by[f"xelink:eager float32 cp={n}"], by["xelink:reference float32 tp=1"]
    assert cp.baseline == one.path and cp.ratio > 0 and (cp.extra["tp"], cp.extra["cp"]) == (1, n)
    assert cp.extra["ranks_agree"] and cp.extra["context"] == decode.CPU_CONTEXTS[-1]
    assert all(r.wrong == 0 and r.time_us > 0 for r in rows) and len(rows) == 4
    assert solo and all("tp" not in r.extra for r in solo)

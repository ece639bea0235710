"""``xelink bench decode``'s model rows (issue 26) on CPU: the plain-torch twin against ``Llama.decode``, the
bytes a step reads, the CPU rows and options, and the CUDA rows' flow (cases, checks, targets, summary) with
the CUDA pieces (graphs, events, the decode graph) stood in by eager calls."""
import importlib.util
from types import SimpleNamespace

import pytest
import torch

from xelink.bench import suite
from xelink.bench.families import decode
from xelink.bench.harness import time_fn
from xelink.bench.kernel_timing import KernelReport
from xelink.models import CONFIGS, Llama


def _tiny(max_batch=2, max_seq_len=80, weights="bf16", dtype=torch.float32, config="tiny"):
    return Llama.random(config, impl="reference", device="cpu", dtype=dtype, weights=weights, max_batch=max_batch,
                        max_seq_len=max_seq_len)


@pytest.mark.parametrize("config", ["tiny", "qwen3"])
def test_twin_matches_llama_decode_at_different_positions_and_writes_the_cache(config):
    # qwen3: the tiny shape with Qwen3's per-head q/k norms (what `--model qwen3-0.6b` times)
    model = _tiny(config=dict(CONFIGS["tiny"].to_hf(), model_type="qwen3") if config == "qwen3" else config)
    gen = torch.Generator().manual_seed(0)
    decode._fill_caches(model, 2, 48, gen)  # rows past a sequence's position hold keys it must not see
    tokens, positions = torch.tensor([3, 411]), torch.tensor([10, 47])
    twin = decode.TorchDecode(decode.dense_weights(model), 2, 48, model.caches)
    twin.set(tokens, positions)
    assert twin.w["embed"] is model.embed and twin.w["layers"][1]["qkv"] is model.layers[1]["qkv"].weight  # shared
    logits, nxt = twin.step()
    want = model.decode(tokens, positions)
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(nxt, want.argmax(-1))
    for c, k, v in zip(model.caches, twin.k, twin.v):
        for b, p in enumerate(positions.tolist()):
            torch.testing.assert_close(k[b, :, p], c.k[b, :, p])
            torch.testing.assert_close(v[b, :, p], c.v[b, :, p])
    # the float64 twin (the CPU rows' reference) agrees too
    ref = decode.TorchDecode(decode.dense_weights(model, torch.float64), 2, 48, model.caches)
    ref.set(tokens, positions)
    torch.testing.assert_close(ref.step()[0].float(), want, rtol=1e-4, atol=1e-4)


def test_step_bytes_count_weights_norms_head_one_embedding_row_and_the_cache_rows():
    cfg = CONFIGS["tiny"]
    H, I, D, V = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size
    hq, hk, n = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers
    per_layer = (hq + 2 * hk) * D * H + H * hq * D + 2 * I * H + H * I + 2 * H
    B, L = 2, 33
    want = 4 * (n * per_layer + V * H + H + B * H + n * 2 * B * L * hk * D)
    model = _tiny()
    assert decode.model_step_bytes(model, B, L) == want
    assert decode.TorchDecode(decode.dense_weights(model), B, L, model.caches).bytes() == want
    qwen3 = _tiny(config=dict(cfg.to_hf(), model_type="qwen3"))  # plus two norms of head_dim a layer
    assert decode.model_step_bytes(qwen3, B, L) == want + 4 * n * 2 * D
    assert decode.TorchDecode(decode.dense_weights(qwen3), B, L, qwen3.caches).bytes() == want + 4 * n * 2 * D
    # quantized weights count as stored (int4 packed + scales: well under a quarter of bf16's, plus the dense head)
    bf16 = decode.model_step_bytes(_tiny(dtype=torch.bfloat16), 1, L)
    w4 = decode.model_step_bytes(_tiny(weights="w4a16", dtype=torch.bfloat16), 1, L)
    w8 = decode.model_step_bytes(_tiny(weights="w8a16", dtype=torch.bfloat16), 1, L)
    assert w4 < w8 < bf16
    with pytest.raises(ValueError, match="dense weights"):
        decode.dense_weights(_tiny(weights="w8a16", dtype=torch.bfloat16))


def test_model_cases_and_contexts():
    assert decode.model_cases(decode.GPU_CONTEXTS) == [
        ("bf16", 1, 1024), ("bf16", 1, 8192), ("bf16", 1, 32768), ("bf16", 8, 1024), ("w4a16", 1, 1024),
        ("w4a16+head", 1, 1024), ("w8a16", 1, 1024)]
    assert decode.model_cases(decode.QUICK_GPU_CONTEXTS, quick=True) == [
        ("bf16", 1, 1024), ("bf16", 1, 8192), ("bf16", 8, 1024), ("w4a16", 1, 1024), ("w4a16+head", 1, 1024)]
    assert decode.model_cases([4096, 512, 4096], quick=True)[0] == ("bf16", 1, 512)
    args = suite.family_parser("decode").parse_args(["--contexts", "1K", "2048", "--model-only"])
    assert args.contexts == [1024, 2048] and args.model_only and args.model is None and not args.no_transformers
    with pytest.raises(SystemExit):
        suite.family_parser("decode").parse_args(["--contexts", "1"])


def _ctx(argv):
    world = SimpleNamespace(rank=0, size=1, device="cpu", hosts=["here"], launch=None, topology=None)
    return suite.Context(world, "decode", suite.family_parser("decode").parse_args(argv))


def test_cpu_family_runs_the_model_rows_checked_against_float64():
    ctx = _ctx(["--model-only", "--contexts", "16", "40", "--iters", "1", "--rounds", "1"])
    rows = decode.run(ctx)
    assert [(r.op, r.path, r.extra["context"]) for r in rows] == [
        ("decode-model", "xelink:reference float32", 16), ("decode-model", "torch:eager float32", 16),
        ("decode-model", "xelink:reference float32", 40), ("decode-model", "torch:eager float32", 40)]
    model = _tiny(max_batch=1)
    for r in rows:
        assert r.wrong == 0 and r.time_us > 0 and r.count == 1 and r.dtype == "float32"
        assert r.size_bytes == decode.model_step_bytes(model, 1, r.extra["context"]) == r.extra["bytes_per_step"]
        assert r.extra["shape"] == f"tiny B=1 ctx={r.extra['context']}" and r.extra["ms_per_token"] > 0
    assert all(r.extra["same_next_token"] and r.extra["logits_rel_rms_diff"] < 1e-5 for r in rows[::2])
    assert rows[0].baseline == "torch:eager float32" and rows[0].ratio > 0
    text = "\n".join(ctx.notes)
    assert "decode-model tiny B=1 ctx=16" in text and "ms/token" in text and "decode-layer" not in text
    assert ctx.extra["contexts"] == [16, 40]


def test_cpu_refuses_the_cuda_model_options():
    # (the suite refuses them before the family runs: every family's CUDA-only group)
    with pytest.raises(SystemExit, match="unrecognized arguments on cpu ranks .*: --model llama-3.1-8b"):
        suite._run_family(_ctx(["--model", "llama-3.1-8b"]))
    with pytest.raises(SystemExit, match="--no-transformers"):
        suite._run_family(_ctx(["--no-transformers"]))


class _EagerGraph:
    """A stand-in for ``Llama.decode_graph``'s graph on CPU: ``step`` and ``graph.replay`` call the model."""

    def __init__(self, model, batch):
        self.model, self.batch = model, batch
        self.graph = SimpleNamespace(replay=self._replay)

    def _replay(self):
        self.logits = self.model.decode(self.tokens, self.positions)
        self.next_tokens = self.logits.argmax(-1)

    def step(self, tokens, positions):
        self.tokens, self.positions = tokens.clone(), positions.clone()
        self._replay()
        return self.logits


def _eager_cuda_graph(calls, repeats):
    outs = [call() for call in calls]
    return SimpleNamespace(replay=lambda: [call() for call in calls]), outs, repeats * len(calls)


def test_cuda_rows_flow_with_eager_stand_ins(monkeypatch):
    """run_model_gpu's cases, rows, checks and notes, the CUDA pieces replaced by eager CPU calls."""

    def random(config, **kw):  # the CUDA model, made on the CPU through the reference paths
        kw.update(impl="reference", device="cpu", dtype=torch.float32)
        model = Llama.random(config, **kw)
        model.decode_graph = lambda batch: _EagerGraph(model, batch)
        return model

    monkeypatch.setattr(decode, "Llama", SimpleNamespace(random=random))
    monkeypatch.setattr(decode, "cuda_graph", _eager_cuda_graph)
    monkeypatch.setattr(decode, "_events", lambda fn, iters: time_fn(fn, warmup=0, iters=iters))
    monkeypatch.setattr(decode, "_kernels", lambda fn: "stand-in")
    monkeypatch.setattr(decode, "_transformers_row", lambda *a: None)
    monkeypatch.setattr(decode, "device_hbm", lambda: 4.8e12)  # the stand-in runs on the CPU: an H200's peak
    report = KernelReport()
    failed = decode.run_model_gpu(report, "tiny", (16, 32), quick=True, iters=1, rounds=1, device="cpu")
    assert not failed, report.notes
    got = [(r.path, r.extra["batch"], r.extra["context"]) for r in report.rows]
    assert got == [("xelink:graph bf16", 1, 16), ("torch:graph bf16", 1, 16), ("xelink:graph bf16", 1, 32),
                   ("torch:graph bf16", 1, 32), ("xelink:graph bf16", 8, 16), ("torch:graph bf16", 8, 16),
                   ("xelink:graph w4a16", 1, 16), ("xelink:graph w4a16+head", 1, 16)]
    for r in report.rows:
        assert r.wrong == 0 and r.extra["roofline"] > 0 and r.extra["kernels"] == "stand-in"
        assert r.extra["timing"] == "cuda-graph per step" and r.count == r.extra["batch"]
    x = report.rows[0]
    assert x.baseline == "torch:graph bf16" and x.extra["same_next_token"] and x.extra["logits_rel_rms_diff"] < 1e-5
    w4, w4_head = report.rows[-2:]
    assert w4.baseline == "torch:graph bf16" and w4.extra["torch_bf16_us"] == w4.baseline_us
    assert w4_head.size_bytes < w4.size_bytes < x.size_bytes  # the quantized head reads fewer bytes
    text = decode._model_summary(report.rows)
    assert len(text.splitlines()) == 8 and "roofline" in text and "vs torch:graph bf16" in text
    assert decode._targets(report.rows, "tiny") == ["decode-model targets (issue 26): Llama-3.1-8B only (this run: "
                                                    "tiny)"]


def _row(path, fmt, B, L, ms, ratio=None):
    from xelink.bench.harness import make_row

    base = [ms / 1e3 * ratio] if ratio else None
    return make_row("decode-model", path, [ms / 1e3], size_bytes=1, count=B, dtype=fmt, nranks=1,
                    baseline="torch:graph bf16" if ratio else None, baseline_samples=base,
                    extra={"shape": f"llama-3.1-8b B={B} ctx={L}", "weights": fmt, "batch": B, "context": L})


def test_targets_of_issue_26():
    rows = [_row("xelink:graph bf16", "bf16", 1, 1024, 4.0, 1.7), _row("xelink:graph bf16", "bf16", 1, 8192, 4.5, 1.8),
            _row("xelink:graph bf16", "bf16", 8, 1024, 4.6, 1.0), _row("xelink:graph w4a16", "w4a16", 1, 1024, 1.7)]
    lines = decode._targets(rows, "llama-3.1-8b")
    assert lines[0].startswith("target bf16 B=1 ctx=1024: <= 4.2 ms and >= 1.6x") and lines[0].endswith(": met")
    assert lines[1].endswith("MISSED") and "4.50 ms" in lines[1]
    assert lines[2] == "target bf16 B=1 ctx=32768: <= 5.4 ms and >= 1.6x the torch graph: not measured in this run"
    assert lines[3].startswith("target w4a16 B=1 ctx=1024: <= 1.8 ms: 1.70 ms") and lines[3].endswith("met")
    assert "B=8 ctx=1024: <= 1.2x the B=1 time: 1.15x" in lines[4] and lines[4].endswith(": met")
    assert rows[0].extra["target_ok"] and not rows[1].extra["target_ok"] and rows[2].extra["b8_over_b1"] == 4.6 / 4.0
    # On another GPU the millisecond targets are reported, not judged; the ratios still are.
    rows = [_row("xelink:graph bf16", "bf16", 1, 1024, 5.5, 1.7), _row("xelink:graph bf16", "bf16", 1, 8192, 5.9, 1.4),
            _row("xelink:graph w4a16", "w4a16", 1, 1024, 2.7)]
    lines = decode._targets(rows, "llama-3.1-8b", "NVIDIA H100 80GB HBM3")
    assert lines[0].startswith("decode-model: the millisecond targets are set on one H200; this run's NVIDIA H100")
    assert lines[1] == ("target bf16 B=1 ctx=1024: <= 4.2 ms and >= 1.6x the torch graph: 5.50 ms (not judged), "
                        "1.70x: met")
    assert lines[2].endswith("5.90 ms (not judged), 1.40x: MISSED") and not rows[1].extra["target_ok"]
    assert lines[4] == "target w4a16 B=1 ctx=1024: <= 1.8 ms: 2.70 ms (not judged)" and "target_ok" not in rows[2].extra
    assert decode._targets(rows, "llama-3.1-8b", "NVIDIA H200")[0].startswith("target bf16 B=1 ctx=1024")


def test_roofline_by_device_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, peak in (("NVIDIA H200", 4.8e12), ("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H100 PCIe", 2.0e12),
                       ("NVIDIA A10", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, n=name: n)
        assert decode.device_hbm() == peak, name
        row = _row("xelink:graph bf16", "bf16", 1, 1024, 4.0)
        decode._per_token([row], roofline=True)
        assert row.extra.get("roofline") == (None if peak is None else 1 / 4e-3 / peak), name


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_transformers_generate_row_on_cpu():
    samples, extra = decode.run_transformers(CONFIGS["tiny"], 8, device="cpu", new_tokens=2, reps=1)
    assert len(samples) == 1 and extra["wrong"] == 0 and "no torch.compile" in extra["timing"]


def test_twin_of_a_tp_model_needs_collectives_and_options_conflict():
    # A TP model's twin sums and gathers through the launch's collectives: without them, a clear error before
    # any work; the parallel options exclude each other; dense_weights refuses a CP model (no CP twin).
    weights = {**decode.dense_weights(_tiny()), "tp": 2}
    with pytest.raises(ValueError, match="TorchDecode: the twin of a TP model \\(2 ranks\\) needs collectives"):
        decode.TorchDecode(weights, 1, 8, [])
    with pytest.raises(SystemExit):
        suite.family_parser("decode").parse_args(["--parallel-only", "--no-parallel"])
    with pytest.raises(SystemExit):
        suite.family_parser("decode").parse_args(["--cp-context", "1"])
    model = _tiny()
    model.cp = object()  # what dense_weights looks at
    with pytest.raises(ValueError, match="no context parallelism"):
        decode.dense_weights(model)


def test_parallel_targets_judge_cp_only_at_its_context():
    """The CP = 2 target is set at 128K: a row at another context is reported, not marked met or missed;
    at 128K it is judged against TP = 1's time in the same row (0.8x)."""
    from xelink.bench.harness import make_row

    def cp_row(context, ours_s, tp1_s):
        return make_row("decode-model", "xelink:eager bf16 cp=2", [ours_s] * 3, size_bytes=1, count=1,
                        dtype=torch.bfloat16, nranks=2, baseline="xelink:graph bf16 tp=1", baseline_samples=[tp1_s] * 3,
                        extra={"cp": 2, "tp": 1, "context": context})

    short, met, missed = cp_row(8192, 0.02, 0.004), cp_row(131072, 0.003, 0.004), cp_row(131072, 0.0035, 0.004)
    lines = decode._parallel_targets([short, met, missed], "llama-3.1-8b", 2)
    assert "target_ok" not in short.extra and "not judged" in lines[0] and "MISSED" not in lines[0]
    assert met.extra["target_ok"] is True and lines[1].endswith("met")
    assert missed.extra["target_ok"] is False and lines[2].endswith("MISSED")
    assert decode._parallel_targets([met], "tiny", 2) == [] and decode._parallel_targets([met], "llama-3.1-8b", 4) == []

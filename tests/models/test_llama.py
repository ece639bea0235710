"""The Llama model against Hugging Face's own code (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM) on folders that transformers' save_pretrained wrote: logits and greedy tokens in float32, ragged
batches, quantized weights, generation options, and the errors raised before any work. Multi-rank TP: ranks_llama.py."""
import dataclasses
import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from llama_cases import CASES, hf_greedy, hf_logits, save  # noqa: E402

from xelink.models import CONFIGS, Llama, save_random_llama  # noqa: E402

TOL = 1e-4


class _Folders(dict):
    """(path, HF model) per (case, sharded), written on first use."""

    def __init__(self, factory):
        super().__init__()
        self.factory = factory

    def __missing__(self, key):
        name, shard = key
        path = self.factory.mktemp(f"{name}-{'sharded' if shard else 'one'}")
        self[key] = (path, save(name, path, shard=shard))
        return self[key]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return _Folders(tmp_path_factory)


# Every case from one file; the GQA cases also from shards (model.safetensors.index.json).
MATCH = [(name, False) for name in CASES] + [("llama3.1", True), ("llama3.2", True)]


def _rel(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.parametrize("name,shard", MATCH, ids=[f"{n}-{'sharded' if s else 'one-file'}" for n, s in MATCH])
def test_logits_and_greedy_tokens_match_transformers(folders, name, shard):
    path, hf = folders[name, shard]
    model = Llama.from_pretrained(path, dtype=torch.float32, max_batch=2, max_seq_len=64)
    vocab = hf.config.vocab_size
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(1))
    got, want = model(ids, 0), hf_logits(hf, ids)
    assert (got - want).abs().max().item() < TOL
    assert _rel(got, want) < TOL
    # Greedy decode through the cache, one token a step, equals HF's greedy generation.
    new = 6
    every = torch.ones_like(ids)  # (as hf_greedy's: a random prompt may hold a pad token, masked without it)
    assert torch.equal(model.generate(ids, new, attention_mask=every, eos_token_id=[]), hf_greedy(hf, ids, new))


@pytest.mark.parametrize("name", ["llama3.1", "mistral", "qwen2", "qwen3", "phi3"])
def test_ragged_left_padded_batch_matches_transformers(folders, name):
    path, hf = folders[name, False]
    model = Llama.from_pretrained(path, dtype=torch.float32, max_batch=3, max_seq_len=64)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, hf.config.vocab_size, (3, 8), generator=g)
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[0, :3] = 0
    mask[2, :6] = 0
    ids = ids.masked_fill(mask == 0, 0)
    got, want = model(ids, 0, mask), hf_logits(hf, ids, mask)
    real = mask.bool()
    assert (got[real] - want[real]).abs().max().item() < TOL
    # Each row alone (no padding) gives the same logits as in the padded batch.
    for b in range(3):
        alone = Llama.from_pretrained(path, dtype=torch.float32, max_seq_len=64)(ids[b:b + 1, mask[b].bool()], 0)
        assert (alone[0] - got[b, mask[b].bool()]).abs().max().item() < TOL
    new = 5
    assert torch.equal(model.generate(ids, new, attention_mask=mask, eos_token_id=[]),
                       hf_greedy(hf, ids, new, mask))


def test_generate_masks_pad_tokens_as_transformers_generate(folders):
    """Without attention_mask, transformers' generate takes a prompt's tokens equal to generation_config's
    pad_token_id (set and no EOS) for padding: the same tokens here as there and as with the mask given; a pad
    token after a real one is refused by name (transformers would mask it in place)."""
    path, hf = folders["phi3", False]  # generation_config.json: pad_token_id 0, eos_token_id 2
    model = Llama.from_pretrained(path, dtype=torch.float32, max_batch=2, max_seq_len=64)
    assert model.generation_config["pad_token_id"] == 0
    ids = torch.randint(3, hf.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(5))
    ids[1, :3] = 0
    got = model.generate(ids, 4)
    assert torch.equal(got, model.generate(ids, 4, attention_mask=(ids != 0).long()))
    with torch.no_grad():
        assert torch.equal(got, hf.generate(ids, max_new_tokens=4, do_sample=False))
    unpadded = model.generate(ids, 4, eos_token_id=0)  # the pad an EOS: every token real, as transformers reads it
    assert not torch.equal(unpadded[1], got[1])
    ids[0, 4] = 0
    with pytest.raises(ValueError, match="^Llama.generate: input_ids row 0 holds pad_token_id=0 .* other than as left "
                                         "padding"):
        model.generate(ids, 4)


def test_chunked_prefill_and_per_sequence_start(folders):
    path, hf = folders["llama3.2", False]
    model = Llama.from_pretrained(path, dtype=torch.float32, max_batch=2, max_seq_len=32)
    ids = torch.randint(0, hf.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    want = hf_logits(hf, ids)
    first = model(ids[:, :4], 0)
    rest = model(ids[:, 4:], [4, 4])
    assert (torch.cat([first, rest], 1) - want).abs().max().item() < TOL


def test_logits_to_keep_is_the_last_positions_of_the_whole(folders):
    """logits_to_keep (transformers' argument): the last n positions of a prefill's logits, exactly (the same rows
    through the same head), for a plain and a left-padded batch; 0 and n >= S keep every position; bad values are
    named before any work (the cache is untouched: a later prefill from 0 gives the same logits)."""
    path, hf = folders["llama3.2", False]
    model = Llama.from_pretrained(path, dtype=torch.float32, max_batch=2, max_seq_len=32)
    ids = torch.randint(0, hf.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 9, dtype=torch.int64)
    mask[1, :3] = 0
    plain = model(ids, 0)
    for attention_mask in (None, mask):
        whole = model(ids, 0, attention_mask)
        real = torch.ones(2, 9, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        assert (whole - hf_logits(hf, ids, attention_mask))[real].abs().max().item() < TOL
        for n in (1, 4, 9, 20, 0):
            got = model(ids, 0, attention_mask, logits_to_keep=n)
            want = whole[:, -n:] if n else whole
            assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6, rtol=0), (n, attention_mask)
    for bad in (-1, 1.5, True, "1", None):
        with pytest.raises(ValueError, match=r"^Llama: logits_to_keep=.* must be an int >= 0"):
            model(ids, 0, logits_to_keep=bad)
    assert torch.equal(model(ids, 0), plain)


def test_eos_stops_each_sequence_and_generation_config_defaults(folders, tmp_path):
    src, hf = folders["llama3.1", False]
    path = tmp_path / "m"
    shutil.copytree(src, path)
    model = Llama.from_pretrained(path, dtype=torch.float32, max_batch=2, max_seq_len=64)
    ids = torch.randint(0, 250, (2, 5), generator=torch.Generator().manual_seed(4))
    free = model.generate(ids, 8, eos_token_id=[])
    # The second sequence's 3rd new token becomes an EOS: it stops there, the first goes on.
    stop = int(free[1, 5 + 2])
    out = model.generate(ids, 8, eos_token_id=[stop, 254])
    first_hit = {b: next((i for i in range(5, out.shape[1]) if int(free[b, i]) == stop), None) for b in (0, 1)}
    for b in (0, 1):
        end = first_hit[b]
        if end is None:
            assert torch.equal(out[b], free[b, :out.shape[1]])
        else:
            assert torch.equal(out[b, :end + 1], free[b, :end + 1])
            assert (out[b, end + 1:] == stop).all()  # padded with the first EOS (no pad_token_id)
    # generation_config.json: eos ids and sampling defaults.
    gc = json.loads((path / "generation_config.json").read_text())
    assert gc["eos_token_id"] == [251, 252, 253]
    gc.update(do_sample=True, temperature=0.7, top_p=0.9, eos_token_id=stop)
    (path / "generation_config.json").write_text(json.dumps(gc))
    model = Llama.from_pretrained(path, dtype=torch.float32, max_batch=2, max_seq_len=64)
    a = model.generate(ids, 6, seed=5)  # sampled (do_sample), reproducible by its seed
    assert torch.equal(a, model.generate(ids, 6, seed=5))
    greedy = model.generate(ids, 6, temperature=0.0)  # stops at the config's EOS
    assert torch.equal(greedy, out[:, :greedy.shape[1]])


def test_without_generation_config_the_model_configs_eos_stops(folders, tmp_path):
    """A folder without generation_config.json (many exported ones): the special tokens of config.json stand in,
    as transformers builds its generation config from the model config."""
    src, hf = folders["llama3.1", False]
    path = tmp_path / "m"
    shutil.copytree(src, path)
    (path / "generation_config.json").unlink()
    ids = torch.randint(0, 250, (1, 5), generator=torch.Generator().manual_seed(14))
    free = Llama.from_pretrained(path, dtype=torch.float32, max_seq_len=64).generate(ids, 8, eos_token_id=[])
    stop = int(free[0, 5 + 2])
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(eos_token_id=stop, pad_token_id=None)
    (path / "config.json").write_text(json.dumps(cfg))
    model = Llama.from_pretrained(path, dtype=torch.float32, max_seq_len=64)
    first = next(i for i in range(5, free.shape[1]) if int(free[0, i]) == stop)
    assert torch.equal(model.generate(ids, 8), free[:, :first + 1])
    # its generation settings too (an older folder's config.json), applied or refused as generation_config.json's
    cfg.update(eos_token_id=None, repetition_penalty=1.5)
    (path / "config.json").write_text(json.dumps(cfg))
    model = Llama.from_pretrained(path, dtype=torch.float32, max_seq_len=64)
    assert model.generation_config["repetition_penalty"] == 1.5
    assert torch.equal(model.generate(ids, 8), model.generate(ids, 8, repetition_penalty=1.5, eos_token_id=[]))
    assert not torch.equal(model.generate(ids, 8), free)
    cfg.update(no_repeat_ngram_size=2)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"Llama.generate: generation_config.json sets no_repeat_ngram_size=2"):
        Llama.from_pretrained(path, dtype=torch.float32, max_seq_len=64).generate(ids, 8)


def test_generate_takes_what_torch_users_pass_and_refuses_the_rest_by_name(folders):
    path, _ = folders["llama2", False]
    model = Llama.from_pretrained(path, dtype=torch.float32, max_batch=2, max_seq_len=64)
    ids = torch.randint(0, 160, (2, 4), generator=torch.Generator().manual_seed(15))
    want = model.generate(ids, 3, eos_token_id=[5])
    np = pytest.importorskip("numpy")
    assert torch.equal(model.generate(ids, 3, eos_token_id=np.int64(5)), want)  # numpy and 0-d tensor ints
    assert torch.equal(model.generate(ids, 3, eos_token_id=torch.tensor(5)), want)
    assert torch.equal(model.generate(ids.int(), 3, eos_token_id=[5]), want)
    logits = model(ids, 0)
    for start in (np.int64(0), torch.tensor(0), torch.tensor([0, 0])):
        assert torch.equal(model(ids, start), logits), start
    for call, exc, text in [
            (lambda: model.generate(ids.float(), 2), TypeError, "input_ids must be an int32/int64 tensor [B, S], got "
                                                                "torch.float32"),
            (lambda: model.generate(ids.tolist(), 2), TypeError, "got list"),
            (lambda: model.generate(ids[:0], 2), ValueError, "input_ids.shape=(0, 4) must be [B, S] with B, S >= 1"),
            (lambda: model.generate(ids, 2, attention_mask=torch.ones(4)), ValueError,
             "attention_mask must be a [B, S] = (2, 4) tensor like input_ids, got (4,)"),
            (lambda: model.generate(ids, 2, attention_mask=torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]])), ValueError,
             "a row of attention_mask has no token"),
            (lambda: model.generate(ids, 2, eos_token_id=2.0), TypeError, "eos_token_id=2.0 must be an int"),
            (lambda: model(ids, 1.5), ValueError, "start_pos=1.5 must be an int >= 0 or one per sequence")]:
        with pytest.raises(exc) as info:
            call()
        assert text in str(info.value), (str(info.value), text)


def test_a_prefill_chunk_may_hold_only_padding_for_a_row(folders):
    """A ragged batch prefilled in chunks: the first chunk is all padding for the short row (its tokens come
    later); the last chunk's logits equal the one-shot prefill's."""
    path, _ = folders["llama3.1", False]
    model = Llama.from_pretrained(path, dtype=torch.float32, max_batch=2, max_seq_len=64)
    ids = torch.randint(0, 250, (2, 10), generator=torch.Generator().manual_seed(16))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :7] = 0
    whole = model(ids, 0, mask)
    model(ids[:, :5], 0, mask[:, :5])
    rest = model(ids[:, 5:], [5, 0], mask[:, 5:])
    assert (rest[0] - whole[0, 5:]).abs().max().item() < TOL
    assert (rest[1, 2:] - whole[1, 7:]).abs().max().item() < TOL
    with pytest.raises(ValueError, match="attention_mask has no token in any row"):
        model(ids[:, :5], 0, torch.zeros(2, 5, dtype=torch.long))


def test_a_one_token_step_may_leave_a_row_out(folders):
    """A step of one token a row whose attention_mask leaves a row out (a finished sequence, say) writes nothing
    into that row's cache: its next tokens' logits are those of a model that never saw the step (the decode step
    had written the pad at the position before the row's start, a silent change of its logits)."""
    path, _ = folders["llama3.1", False]
    a, b = (Llama.from_pretrained(path, dtype=torch.float32, max_batch=2, max_seq_len=32) for _ in range(2))
    ids = torch.randint(0, 250, (2, 6), generator=torch.Generator().manual_seed(17))
    a(ids, 0), b(ids, 0)
    got = a(torch.tensor([[7], [9]]), [6, 6], torch.tensor([[1], [0]]))
    want = b(torch.tensor([[7]]), [6])
    assert (got[0] - want[0]).abs().max().item() < TOL
    got, want = a(torch.tensor([[3], [4]]), [7, 6]), b(torch.tensor([[3], [4]]), [7, 6])
    assert (got - want).abs().max().item() < TOL


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_qwen_folders_biases_norms_and_window(tmp_path, folders, kind):
    """A Qwen2 / Qwen3 folder xelink writes is one transformers reads (Qwen2: q/k/v biases, no o or MLP bias,
    whatever attention_bias / mlp_bias say; Qwen3: q/k norms, the biases attention_bias says, none in the MLP; the
    window off); a window written but off bounds nothing."""
    import transformers
    from safetensors import safe_open

    from xelink.models import LlamaConfig

    cfg = LlamaConfig.from_hf(dict(CONFIGS["tiny"].to_hf(), model_type=kind, attention_bias=True, mlp_bias=True))
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias, cfg.qk_norm) == (True, kind == "qwen3", False, kind == "qwen3")
    path = save_random_llama(tmp_path / "q", cfg, dtype=torch.float32)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.k_proj.bias" in names and not [n for n in names if "mlp" in n and "bias" in n]
    assert ("model.layers.1.self_attn.o_proj.bias" in names) == ("model.layers.1.self_attn.k_norm.weight" in names) \
        == (kind == "qwen3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert type(hf).__name__ == f"{kind.title()}ForCausalLM"
    ids = torch.randint(0, cfg.vocab_size, (1, 6))
    got = Llama.from_pretrained(path, dtype=torch.float32, max_seq_len=16)(ids, 0)
    assert (got - hf_logits(hf, ids)).abs().max().item() < TOL
    path = folders[kind, False][0]  # use_sliding_window false (a window written or not): no limit
    model = Llama.from_pretrained(path, dtype=torch.float32, max_seq_len=40000)
    assert model.max_seq_len == 40000 and model.config.sliding_window is None


def test_phi3_folder_xelink_writes_is_one_transformers_reads(tmp_path):
    """Phi-3's fused tensors (qkv_proj, gate_up_proj) as save_random_llama writes them, read by transformers'
    Phi3ForCausalLM to the same logits; biases asked for are not Phi-3's (none is written); a window in its config
    (Phi-3-mini-4k's 2047) no longer bounds the default cache."""
    import transformers
    from safetensors import safe_open

    from xelink.models import LlamaConfig

    cfg = LlamaConfig.from_hf(dict(CONFIGS["tiny"].to_hf(), model_type="phi3", attention_bias=True, mlp_bias=True,
                                   rope_scaling=None))  # transformers' Phi3 takes no Llama 3 scaling
    assert cfg.fused_projections and not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias)
    path = save_random_llama(tmp_path / "p", cfg, dtype=torch.float32)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.self_attn.qkv_proj.weight" in names and "model.layers.1.mlp.gate_up_proj.weight" in names
    assert not [n for n in names if n.endswith("bias") or "q_proj" in n or ".gate_proj" in n]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert type(hf).__name__ == "Phi3ForCausalLM"
    ids = torch.randint(0, cfg.vocab_size, (1, 6))
    assert (Llama.from_pretrained(path, dtype=torch.float32, max_seq_len=16)(ids, 0) - hf_logits(hf, ids)).abs().max() \
        < TOL
    windowed = Llama.from_pretrained(_edit(path, tmp_path / "w", config={"sliding_window": 2047}), dtype=torch.float32)
    assert windowed.max_seq_len == 2048 and windowed.config.sliding_window == 2047  # tiny: max_position_embeddings


def test_a_head_stored_under_tie_word_embeddings_is_the_head(folders, tmp_path):
    """A fine-tune that untied the head and kept tie_word_embeddings: transformers (5) uses the stored lm_head
    (the embedding stays the embedding); so does xelink, to the same logits."""
    import transformers
    from safetensors.torch import load_file, save_file

    src, _ = folders["llama3.2", False]  # (a tied case)
    path = _edit(src, tmp_path / "m")
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"]
    tensors = load_file(str(path / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = torch.randn(tensors["model.embed_tokens.weight"].shape,
                                            generator=torch.Generator().manual_seed(3)) * 0.1
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert torch.equal(hf.lm_head.weight, tensors["lm_head.weight"])
    ids = torch.randint(0, 200, (1, 6), generator=torch.Generator().manual_seed(4))
    got = Llama.from_pretrained(path, dtype=torch.float32, max_seq_len=16)(ids, 0)
    assert _rel(got, hf_logits(hf, ids)) < TOL


def test_rope_scaling_fields_as_transformers_reads_them():
    """The pretraining length of a scaled RoPE: config.json's own original_max_position_embeddings first (as
    transformers gives it priority), then rope_scaling's, then max_position_embeddings; what a type needs is
    named when missing."""
    from xelink.models import LlamaConfig

    base = dict(CONFIGS["tiny"].to_hf(), max_position_embeddings=1024)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    for extra, old in ((dict(original_max_position_embeddings=64), 64), ({}, 128)):
        cfg = LlamaConfig.from_hf(dict(base, rope_scaling=yarn, **extra))
        assert cfg.rope_scaling == dict(yarn, original_max_position_embeddings=old), cfg.rope_scaling
    assert LlamaConfig.from_hf(dict(base, rope_scaling={"type": "yarn", "factor": 2.0})).rope_scaling == \
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024}
    with pytest.raises(ValueError, match=r"rope_scaling of type 'linear' lacks \['factor'\]"):
        LlamaConfig.from_hf(dict(base, rope_scaling={"rope_type": "linear"}))
    # a LlamaConfig built by hand gets the same checks (Llama.random took it unchecked: KeyErrors, or a "dynamic"
    # scaling run as llama3, a Gemma run as a Llama)
    tiny = CONFIGS["tiny"]
    for bad, what in (({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"rope_scaling=.* must be None or a dict"),
                      ({"rope_scaling": dict(tiny.rope_scaling, rope_type="dynamic")}, "rope_type one of"),
                      ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
                       r"lacks \['original_max_position_embeddings'\]"),
                      ({"model_type": "gemma"}, "model_type=.gemma. is not supported")):
        with pytest.raises(ValueError, match="Llama.random: .*" + what):
            Llama.random(dataclasses.replace(tiny, **bad), dtype=torch.float32, max_seq_len=16)


def test_config_defaults_and_resaves_as_transformers_reads_them(tmp_path):
    """Fields a config.json leaves out take transformers' defaults (rms_norm_eps 1e-6; a Mistral's window 4096); a
    Mistral xelink writes says full attention; a folder saved again as one file after a sharded save drops the old
    index (which named files no longer there)."""
    from xelink.models import LlamaConfig

    hf = CONFIGS["tiny"].to_hf()
    del hf["rms_norm_eps"]
    assert LlamaConfig.from_hf(hf, "t").rms_norm_eps == 1e-6
    assert LlamaConfig.from_hf(dict(hf, model_type="phi3"), "t").rms_norm_eps == 1e-5  # (Phi3Config's own)
    # the flags a type's transformers class does not have are ignored, as transformers ignores them
    mistral = LlamaConfig.from_hf(dict(hf, model_type="mistral", attention_bias=True, mlp_bias=True), "t")
    assert not (mistral.qkv_bias or mistral.o_bias or mistral.mlp_bias)
    assert LlamaConfig.from_hf(dict(hf, attention_bias=True, mlp_bias=True), "t").mlp_bias  # (Llama's has them)
    path = save_random_llama(tmp_path / "m", dict(CONFIGS["tiny"].to_hf(), model_type="mistral", sliding_window=None),
                             dtype=torch.float32, max_shard_bytes=200_000)
    assert json.loads((path / "config.json").read_text())["sliding_window"] is None
    assert Llama.from_pretrained(path, dtype=torch.float32, max_seq_len=8192).max_seq_len == 8192
    cfg = json.loads((path / "config.json").read_text())
    del cfg["sliding_window"]
    (path / "config.json").write_text(json.dumps(cfg))
    model = Llama.from_pretrained(path, dtype=torch.float32, max_seq_len=8192)
    assert model.config.sliding_window == 4096 and [c.window for c in model.caches] == [4096, 4096]
    assert Llama.from_pretrained(path, dtype=torch.float32).max_seq_len == 2048  # tiny: max_position_embeddings
    assert (path / "model.safetensors.index.json").exists()
    save_random_llama(path, "tiny", dtype=torch.float32)
    assert not (path / "model.safetensors.index.json").exists()
    assert Llama.from_pretrained(path, dtype=torch.float32, max_seq_len=64).config.num_hidden_layers == 2


def test_sampling_is_seeded_and_top_p_tiny_is_greedy(folders):
    path, hf = folders["llama2", False]
    model = Llama.from_pretrained(path, dtype=torch.float32, max_seq_len=64)
    ids = torch.randint(0, 160, (1, 4), generator=torch.Generator().manual_seed(6))
    a = model.generate(ids, 8, temperature=1.0, seed=7)
    assert torch.equal(a, model.generate(ids, 8, temperature=1.0, seed=7))
    assert not torch.equal(a, model.generate(ids, 8, temperature=1.0, seed=8))
    greedy = model.generate(ids, 8, eos_token_id=[])
    assert torch.equal(model.generate(ids, 8, temperature=1.0, top_p=1e-6, seed=9, eos_token_id=[]), greedy)
    assert torch.equal(model.generate(ids, 8, temperature=5.0, top_k=1, seed=10, eos_token_id=[]), greedy)
    with pytest.raises(ValueError, match="top_k=-1 must be an int >= 0"):
        model.generate(ids, 2, temperature=1.0, top_k=-1)


def test_sample_keeps_the_top_k_then_the_top_p():
    from xelink.models.generate import sample

    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(4000, 1)
    g = torch.Generator().manual_seed(3)
    assert set(sample(logits, 1.0, 1.0, g, top_k=2).tolist()) == {0, 1}  # transformers' default k is 50
    assert set(sample(logits, 1.0, 1.0, g).tolist()) == {0, 1, 2, 3, 4}
    # top-k first, then top-p of what is left: p(0 | top 3) = 0.665 < 0.7, so tokens 0 and 1
    assert set(sample(logits, 1.0, 0.7, g, top_k=3).tolist()) == {0, 1}


def test_sampling_probs_keep_what_transformers_warpers_keep():
    """top-k, then top-p, then min-p (transformers' order): the tokens kept are those its warpers leave finite."""
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from xelink.models.generate import sampling_probs

    logits = torch.randn(64, 50) * 3
    for top_k, top_p, min_p in ((0, 1.0, 0.1), (20, 0.9, 0.05), (0, 0.8, 0.3), (5, 1.0, 0.0)):
        scores = logits / 0.8
        for warper in ([TopKLogitsWarper(top_k)] if top_k else []) + ([TopPLogitsWarper(top_p)] if top_p < 1 else []) \
                + ([MinPLogitsWarper(min_p)] if min_p else []):
            scores = warper(None, scores)
        kept = sampling_probs(logits, 0.8, top_p, top_k, min_p) > 0
        assert torch.equal(kept, scores > float("-inf")), (top_k, top_p, min_p)


@pytest.mark.parametrize("name", ["llama3.1", "qwen2"])
def test_repetition_penalty_and_min_new_tokens_match_transformers(folders, name):
    """Greedy tokens under transformers' repetition penalty (every id of the row so far: its prompt's real tokens,
    not its left padding, then its new tokens, finished rows' pads too) and min_new_tokens (no EOS before it): those
    of transformers' generate, on a ragged batch whose pad id is the padded row's own next token (so a penalty on
    the padding would change it); from the arguments and from generation_config.json."""
    path, hf = folders[name, False]
    model = Llama.from_pretrained(path, dtype=torch.float32, max_batch=3, max_seq_len=64)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, :4] = 0
    for seed in range(21, 41):  # prompts whose padded row's next token is none of its real ones
        ids = torch.randint(0, 128, (3, 7), generator=torch.Generator().manual_seed(seed))
        free = model.generate(ids, 10, attention_mask=mask, eos_token_id=[])
        pad = int(free[1, 7])  # (what the padding holds does not change the free run: it is masked)
        if pad not in ids[1, 4:].tolist():
            break
    ids = ids.masked_fill(mask == 0, pad)
    model.generation_config = dict(model.generation_config, pad_token_id=pad)
    stop = int(free[0, 7 + 1])  # row 0's second token: without min_new_tokens row 0 would stop there

    def hf_generate(**kw):
        with torch.no_grad():
            return hf.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=stop,
                               pad_token_id=pad, **kw)

    for kw in (dict(repetition_penalty=1.5, min_new_tokens=4), dict(repetition_penalty=0.7), dict(min_new_tokens=3),
               dict(repetition_penalty=100.0)):
        got = model.generate(ids, 10, attention_mask=mask, eos_token_id=stop, **kw)
        assert torch.equal(got, hf_generate(**kw)), kw
        if kw.get("repetition_penalty", 1) > 1:
            assert int(got[1, 7]) == pad, kw  # row 1's first token: its padding's id, not penalized
    assert not torch.equal(got, model.generate(ids, 10, attention_mask=mask, eos_token_id=stop))  # it did apply
    model.generation_config.update(repetition_penalty=1.5, min_new_tokens=4, eos_token_id=stop)
    assert torch.equal(model.generate(ids, 10, attention_mask=mask), hf_generate(repetition_penalty=1.5,
                                                                                 min_new_tokens=4))


def test_generation_config_settings_not_done_are_refused_by_name(folders):
    """A generation_config.json that asks for what this generate does not do (beam search, n-gram bans, typical
    sampling, ...) is refused by name before any work; the values that do nothing are taken."""
    path, _ = folders["llama2", False]
    model = Llama.from_pretrained(path, dtype=torch.float32, max_seq_len=64)
    ids = torch.randint(0, 160, (1, 4), generator=torch.Generator().manual_seed(22))
    want = model.generate(ids, 3, eos_token_id=[])
    base = dict(model.generation_config)
    for idle in (dict(num_beams=1, no_repeat_ngram_size=0, bad_words_ids=None, suppress_tokens=[], typical_p=0.5),
                 dict(guidance_scale=1.0, repetition_penalty=None, min_p=0.5)):  # typical_p, min_p: sampling only
        model.generation_config = dict(base, **idle)
        assert torch.equal(model.generate(ids, 3, eos_token_id=[]), want), idle
    for setting, sampling in ((dict(num_beams=4), False), (dict(no_repeat_ngram_size=3), False),
                              (dict(bad_words_ids=[[5]]), False), (dict(typical_p=0.5), True),
                              (dict(encoder_repetition_penalty=1.3), False),
                              (dict(encoder_no_repeat_ngram_size=2), False),
                              (dict(num_return_sequences=2), False)):
        model.generation_config = dict(base, **setting)
        (name, value), = setting.items()
        with pytest.raises(ValueError, match=rf"Llama.generate: generation_config.json sets {name}={value!r}"
                                             .replace("[", r"\[")):
            model.generate(ids, 3, temperature=1.0 if sampling else 0.0)
    # sampling settings written as null there: transformers' defaults (temperature 1, top_p 1, top_k 50)
    model.generation_config = dict(base, do_sample=True, temperature=None, top_p=None, top_k=None)
    drawn = [model.generate(ids, 4, seed=s) for s in range(8)]
    assert all(torch.equal(d, model.generate(ids, 4, seed=s, temperature=1.0, top_p=1.0, top_k=50))
               for s, d in enumerate(drawn))
    assert any(not torch.equal(d, model.generate(ids, 4, seed=s, top_k=0)) for s, d in enumerate(drawn))
    # sampling asked by the call (temperature > 0) in a folder without do_sample: its top_p / min_p apply, as its top_k
    model.generation_config = dict(base, top_p=0.3, min_p=0.2)
    drawn = [model.generate(ids, 4, seed=s, temperature=1.5) for s in range(8)]
    assert all(torch.equal(d, model.generate(ids, 4, seed=s, temperature=1.5, top_p=0.3, min_p=0.2))
               for s, d in enumerate(drawn))
    assert any(not torch.equal(d, model.generate(ids, 4, seed=s, temperature=1.5, top_p=1.0, min_p=0.0))
               for s, d in enumerate(drawn))
    model.generation_config = base
    for bad in (dict(repetition_penalty=0.0), dict(min_p=1.5), dict(min_new_tokens=-1)):
        with pytest.raises(ValueError, match=rf"Llama.generate: {next(iter(bad))}="):
            model.generate(ids, 3, **bad)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaForCausalLM

    path = save_random_llama(tmp_path_factory.mktemp("tiny"), "tiny", seed=1)
    return path, LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("weights", ["w8a16", "w4a16"])
@pytest.mark.parametrize("head", [False, True])
def test_quantized_weights_equal_transformers_on_the_dequantized_weights(tiny, weights, head):
    """Quantized at load: the logits are HF's on the exact dequantized projections (float32 scales), and with
    ``quantize_head`` on the dequantized head too."""
    import copy

    from xelink.kernels import pack_w4a16, pack_w8a16, unpack_w4a16, unpack_w8a16

    path, hf = tiny
    pack, unpack = (pack_w8a16, unpack_w8a16) if weights == "w8a16" else (pack_w4a16, unpack_w4a16)
    hf_q = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in hf_q.named_parameters():
            if "proj" in name or head and name == "lm_head.weight":
                p.copy_(unpack(*pack(p, torch.float32)))
    ids = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(10))
    model = Llama.from_pretrained(path, dtype=torch.float32, weights=weights, max_batch=2, max_seq_len=32,
                                  quantize_head=head)
    assert model.head.fmt == (weights if head else "dense")
    got, want = model(ids, 0), hf_logits(hf_q, ids)
    assert (got - want).abs().max().item() < TOL
    assert 1e-3 < _rel(got, hf_logits(hf, ids)) < 0.5  # and it did quantize
    assert torch.equal(model.generate(ids, 4, eos_token_id=[]), hf_greedy(hf_q, ids, 4))


def test_w4a16_tiles_give_the_row_layouts_logits():
    """``TensorParallel.load(..., tiled=True)`` (what ``Llama`` asks for where gemv reads tiles in place, CUDA):
    every projection of whole 16-row tiles as ``"w4a16t"``; a model on them (here the paths that untile a copy)
    gives the row layout's logits and tokens bit for bit, through a prefill of several rows (qgemm's format) and
    decode steps (gemv's)."""
    from xelink.models.checkpoint import RandomWeights
    from xelink.models.parallel import TensorParallel

    cfg = CONFIGS["tiny"]
    tp = TensorParallel(cfg, None, "test")
    models = {}
    for tiled in (False, True):
        loaded = tp.load(RandomWeights(cfg, 3, "cpu"), "w4a16", torch.bfloat16, "cpu", tiled=tiled)
        fmts = {lin.fmt for layer in loaded["layers"] for lin in layer.values() if hasattr(lin, "fmt")}
        assert fmts == {"w4a16t" if tiled else "w4a16"} and loaded["head"].fmt == "dense"
        models[tiled] = Llama(cfg, loaded, tp, dtype=torch.bfloat16, device=torch.device("cpu"), impl="auto",
                              max_batch=2, max_seq_len=32)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    assert torch.equal(models[True](ids, 0), models[False](ids, 0))
    assert torch.equal(models[True].generate(ids, 4, eos_token_id=[]), models[False].generate(ids, 4, eos_token_id=[]))


def test_quantize_head_needs_a_quantized_format(tiny):
    path, _ = tiny
    with pytest.raises(ValueError, match="Llama.from_pretrained: quantize_head=True quantizes the head to the "
                                         "projections' format: it needs weights='w8a16' or 'w4a16', got "
                                         "weights='bf16'"):
        Llama.from_pretrained(path, dtype=torch.float32, quantize_head=True)
    with pytest.raises(ValueError, match="Llama.random: quantize_head='yes' must be a bool"):
        Llama.random("tiny", weights="w4a16", quantize_head="yes")


def test_w4a16_needs_k_multiple_of_128(folders):
    path, _ = folders["llama3.1", False]  # MLP 448
    with pytest.raises(ValueError, match=r"down_proj input \(intermediate_size / TP\)=448 to be a multiple of 128"):
        Llama.from_pretrained(path, dtype=torch.float32, weights="w4a16")


def test_save_random_llama_tiny_read_by_transformers(tiny, tmp_path):
    path, hf = tiny
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["hidden_size"] == CONFIGS["tiny"].hidden_size
    ids = torch.randint(0, 512, (1, 7), generator=torch.Generator().manual_seed(11))
    want = hf_logits(hf, ids)
    assert _rel(Llama.from_pretrained(path, dtype=torch.float32, max_seq_len=32)(ids, 0), want) < TOL
    assert _rel(Llama.from_pretrained(path, dtype=torch.bfloat16, max_seq_len=32)(ids, 0), want) < 3e-2
    # Sharded writes: an index and several files, read back the same.
    sharded = save_random_llama(tmp_path / "sharded", "tiny", seed=1, max_shard_bytes=200_000)
    assert (sharded / "model.safetensors.index.json").exists()
    assert torch.equal(Llama.from_pretrained(sharded, dtype=torch.float32, max_seq_len=32)(ids, 0),
                       Llama.from_pretrained(path, dtype=torch.float32, max_seq_len=32)(ids, 0))
    # an index that puts a tensor in a shard without it: a ValueError naming both (safetensors' own error said
    # neither the shard nor the folder, and is no ValueError)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == files[0])
    index["weight_map"][name] = files[1]
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"tensor '{name}' is missing from {files[1]}, where model.safetensors"):
        Llama.from_pretrained(sharded, dtype=torch.float32, max_seq_len=32)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_named_configs_are_the_shapes_transformers_builds(name):
    """Each named config's folder layout (every tensor name and shape save_random_llama writes) is the state
    dict transformers builds from its config.json (on the meta device: no memory), tied head included."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from xelink.models.checkpoint import tensor_shapes

    cfg = CONFIGS[name]
    hf_cfg = AutoConfig.for_model(**cfg.to_hf())
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_cfg)
    want = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    if cfg.tie_word_embeddings:
        want.pop("lm_head.weight")
    assert tensor_shapes(cfg) == want
    assert hf_cfg.tie_word_embeddings == cfg.tie_word_embeddings
    assert hf_cfg.head_dim == cfg.head_dim and hf_cfg.num_key_value_heads == cfg.num_key_value_heads


def test_max_seq_len_default_is_bounded(folders):
    path, _ = folders["llama3.1", False]  # max_position_embeddings 131072
    assert Llama.from_pretrained(path, dtype=torch.float32).max_seq_len == 8192
    path, _ = folders["bias", False]  # 2048
    assert Llama.from_pretrained(path, dtype=torch.float32).max_seq_len == 2048


def _edit(src, dst, config=None, drop=None, reshape=None):
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    if drop or reshape:
        from safetensors.torch import load_file, save_file

        f = dst / "model.safetensors"
        tensors = load_file(str(f))
        if drop:
            del tensors[drop]
        if reshape:
            tensors[reshape] = tensors[reshape][:-1].contiguous()
        save_file(tensors, str(f), metadata={"format": "pt"})
    return dst


def _retype(folder, name, dtype):
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, str(f), metadata={"format": "pt"})


def test_errors_before_any_work(folders, tmp_path):
    path, _ = folders["llama3.1", False]
    name = "model.layers.1.self_attn.k_proj.weight"
    with pytest.raises(ValueError, match=f"tensor '{name}' is missing"):
        Llama.from_pretrained(_edit(path, tmp_path / "a", drop=name))
    with pytest.raises(ValueError, match=f"tensor '{name}' has shape"):
        Llama.from_pretrained(_edit(path, tmp_path / "b", reshape=name))
    with pytest.raises(ValueError, match="hidden_act='gelu' is not supported"):
        Llama.from_pretrained(_edit(path, tmp_path / "c", config={"hidden_act": "gelu"}))
    with pytest.raises(ValueError, match="rope_scaling type 'dynamic' is not supported"):
        Llama.from_pretrained(_edit(path, tmp_path / "d", config={
            "rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}}))
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
        Llama.from_pretrained(_edit(path, tmp_path / "e", config={"model_type": "gpt2"}))
    # transformers' Llama has no window: one in its config.json is not read; a config that sets one is refused
    windowed = Llama.from_pretrained(_edit(path, tmp_path / "f", config={"sliding_window": 16}), max_seq_len=64)
    assert windowed.config.sliding_window is None
    with pytest.raises(ValueError, match="sliding_window=16 on model_type 'llama'"):
        dataclasses.replace(CONFIGS["tiny"], sliding_window=16).check("t")
    with pytest.raises(TypeError, match="cannot be served"):
        Llama.from_pretrained(path, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"quantization_config \(quant_method='fp8'\) is not supported"):
        Llama.from_pretrained(_edit(path, tmp_path / "g", config={"quantization_config": {"quant_method": "fp8"}}))
    fp8 = _edit(path, tmp_path / "h")
    _retype(fp8, name, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=f"tensor '{name}' is stored as F8_E4M3, which cannot be served"):
        Llama.from_pretrained(fp8)
    with pytest.raises(ValueError, match="num_attention_heads=8 must be a multiple of num_key_value_heads=3"):
        Llama.from_pretrained(_edit(path, tmp_path / "i", config={"num_key_value_heads": 3}))
    with pytest.raises(TypeError, match="impl='xelink' needs dtype bfloat16 or float16"):
        Llama.from_pretrained(path, impl="xelink", dtype=torch.float32, device="cuda")
    with pytest.raises(ValueError, match="impl='xelink' runs xelink's Triton kernels, which need a GPU"):
        Llama.from_pretrained(path, impl="xelink")
    with pytest.raises(ValueError, match="impl='fast' must be one of"):
        Llama.from_pretrained(path, impl="fast")
    with pytest.raises(ValueError, match="weights='int3' must be one of"):
        Llama.from_pretrained(path, weights="int3")
    with pytest.raises(FileNotFoundError, match="config.json"):
        Llama.from_pretrained(tmp_path / "nowhere")
    model = Llama.from_pretrained(path, dtype=torch.float32, max_seq_len=16, max_batch=1)
    with pytest.raises(TypeError, match=r"^Llama: input_ids must be an int32/int64 tensor \[B, S\], got torch.float32"):
        model(torch.zeros(1, 2))
    with pytest.raises(ValueError, match=r"^Llama: input_ids.shape=\(1, 1, 2\) must be \[B, S\]"):
        model(torch.zeros(1, 1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^Llama.generate: token id -1 at input_ids\[0, 1\] is not in \[0, vocab"):
        model.generate(torch.tensor([[5, -1]]), 2)
    with pytest.raises(ValueError, match="^Llama.generate: batch 2 must be in 1..max_batch=1"):
        model.generate(torch.zeros(2, 3, dtype=torch.long), 2)
    ids = torch.zeros(1, 17, dtype=torch.long)
    with pytest.raises(ValueError, match="prompt of 17 tokens is longer than max_seq_len=16"):
        model.generate(ids, 1)
    with pytest.raises(ValueError, match="exceed max_seq_len=16"):
        model.generate(ids[:, :10], 8)
    # the last new token is never cached: 16 prompt tokens and 1 new one, 10 and 7, fit 16 positions
    assert model.generate(ids[:, :16], 1, eos_token_id=[]).shape == (1, 17)
    assert model.generate(ids[:, :10], 7, eos_token_id=[]).shape == (1, 17)
    with pytest.raises(ValueError, match="batch 2 must be in 1..max_batch=1"):
        model(torch.zeros(2, 3, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="left-padded"):
        model(torch.zeros(1, 3, dtype=torch.long), 0, torch.tensor([[1, 0, 1]]))


@pytest.mark.parametrize("kind, extra, windows", [
    ("mistral", dict(sliding_window=5), [5, 5]),
    # layer_types in a Mistral folder: transformers' Auto classes build a Ministral (alternating layers); every layer
    # slid here, logits 3.6 apart past the window
    ("mistral", dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"]), [5, None]),
    ("phi3", dict(sliding_window=4, rope_scaling=None), [4, 4]),
    ("qwen2", dict(use_sliding_window=True, sliding_window=3, max_window_layers=1), [None, 3]),
    ("qwen3", dict(use_sliding_window=True, sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
     [6, None]),
])
def test_sliding_window_matches_transformers(tmp_path, kind, extra, windows):
    """Sliding-window attention as transformers computes it (Mistral-7B-v0.1, Phi-3-mini-4k; Qwen2/Qwen3 with
    use_sliding_window on the layers max_window_layers or layer_types name): a ragged left-padded prompt longer than
    the window, its logits at every real position, and greedy tokens decoded well past the window, equal to
    transformers' generate; the folder written again reads back with the same windows."""
    import transformers

    from xelink.models import LlamaConfig

    cfg = LlamaConfig.from_hf(dict(CONFIGS["tiny"].to_hf(), model_type=kind, **extra))
    assert [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)] == windows
    path = save_random_llama(tmp_path / kind, cfg, dtype=torch.float32, seed=3)
    assert LlamaConfig.from_hf(json.loads((path / "config.json").read_text())) == cfg
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model = Llama.from_pretrained(path, dtype=torch.float32, max_seq_len=48, max_batch=2)
    assert [c.window for c in model.caches] == windows
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(1, cfg.vocab_size, (2, 14), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # row 1: 4 pads, then 10 tokens
    got = model(ids, 0, mask)
    want = hf_logits(hf, ids, mask)
    assert (got[0] - want[0]).abs().max().item() < TOL
    assert (got[1, 4:] - want[1, 4:]).abs().max().item() < TOL
    assert torch.equal(model.generate(ids, 16, attention_mask=mask), hf_greedy(hf, ids, 16, mask))
    # the window matters: full attention gives other logits past it
    full = Llama.from_pretrained(_edit(path, tmp_path / "full", config={"sliding_window": None,
                                                                       "use_sliding_window": False}),
                                 dtype=torch.float32, max_seq_len=48)
    assert (full(ids[:1], 0)[0, -1] - got[0, -1]).abs().max().item() > 100 * TOL


def test_ring_cache_holds_the_window_only(tmp_path):
    """A sliding-window layer shorter than max_seq_len caches its window's rows only (a ring, as transformers'
    sliding-window caches), a full layer every position; a left-padded first chunk, ragged later chunks (one of them
    past the window) and ragged decode steps give the logits of the same calls on the same model whose caches keep
    every position (the window then masks: the path checked against transformers above)."""
    from xelink.models import LlamaConfig

    cfg = LlamaConfig.from_hf(dict(CONFIGS["tiny"].to_hf(), model_type="qwen3", use_sliding_window=True,
                                   sliding_window=5, layer_types=["sliding_attention", "full_attention"]))
    path = save_random_llama(tmp_path / "q3", cfg, dtype=torch.float32, seed=4)
    ring = Llama.from_pretrained(path, dtype=torch.float32, max_seq_len=40, max_batch=2)
    assert [(c.ring, c.k.shape[2], c.v.shape[2]) for c in ring.caches] == [(True, 5, 5), (False, 40, 40)]
    plain = Llama.from_pretrained(path, dtype=torch.float32, max_seq_len=40, max_batch=2)
    for c in plain.caches:  # the same model keeping every position
        c.ring = False
        c.k, c.v = (torch.zeros(2, c.k.shape[1], 40, c.k.shape[3]) for _ in range(2))
    ids = torch.randint(1, cfg.vocab_size, (2, 26), generator=torch.Generator().manual_seed(6))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :4] = 0  # sequence 1: 3 real tokens, then 4 behind sequence 0 throughout
    calls = [(ids[:, :7], 0, mask), (ids[:, 7:13], [7, 3], None), (ids[:, 13:15], [13, 9], None)]
    calls += [(ids[:, t:t + 1], [t, t - 4], None) for t in range(15, 26)]  # decode steps, positions past the window
    for chunk, start, m in calls:
        got, want = ring(chunk, start, m), plain(chunk, start, m)
        real = slice(4, None) if m is not None else slice(None)
        assert (got[0] - want[0]).abs().max().item() < TOL, start
        assert (got[1, real] - want[1, real]).abs().max().item() < TOL, start


def test_folded_norms_give_the_unfolded_logits(monkeypatch):
    """The decode step with each layer's RMSNorms folded into the GEMVs around them (``Llama._layers_folded``:
    gemv_residual / gemv_rms, here on their reference paths; on a GPU where the CUDA C++ kernel serves a W4A16
    model, ``gemv_norm.CU_FOLD``): logits within rounding of the unfolded step's, the same greedy token, and every
    layer's norms folded but the first and the final one."""
    from xelink.models import llama

    model = Llama.random("tiny", seed=5, weights="w4a16", dtype=torch.bfloat16, max_batch=2, max_seq_len=64)
    assert not model._fold_norms(2)  # (on CPU: no kernel folds them)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    model(ids, 0)
    tok, pos = torch.tensor([3, 17]), torch.tensor([9, 9])
    unfolded = model.decode(tok, pos).float()
    calls = {"gemv_rms": 0, "gemv_residual": 0, "rmsnorm": 0}
    for name in calls:
        def spy(*args, _name=name, _fn=getattr(llama.Ops, name), **kw):
            calls[_name] += 1
            return _fn(*args, **kw)
        monkeypatch.setattr(llama.Ops, name, spy)
    monkeypatch.setattr(Llama, "_fold_norms", lambda self, rows: True)
    folded = model.decode(tok, pos).float()  # (the same cache row written again)
    n = len(model.layers)
    assert calls == {"gemv_rms": 2 * n - 1, "gemv_residual": 2 * n, "rmsnorm": 2}
    err = ((folded - unfolded).norm() / unfolded.norm()).item()
    assert 0 < err < 2e-2, err  # (h * g is rounded before the 1 / rms: not bit for bit)
    assert torch.equal(folded.argmax(-1), unfolded.argmax(-1))

"""The Llama model on CUDA: TP = 1, TP = 2 and CP = 2 with the ranks sharing one GPU, impl "xelink" (Triton
kernels, xelink's GPU collectives) and "auto", against transformers (float32) on the same folder, in bf16:
the prompt's logits and the next decode step's (through the cache: gemv, decode_attention) within a
relative error of 3e-2 (bf16 weights; 6e-2 W8A16, 0.3 W4A16), the first greedy token equal to
transformers' where its top-2 logits are apart by more than bf16 can blur. Skips without a GPU; run on a
GPU machine and commit the log (benchmarks/results/h200-issue21/gpu_rank_tests.log)."""
import tempfile

import pytest
import torch
from ranks import only

WORLD_SIZES = (1, 2)
GPUS = 1
LAUNCH_TIMEOUT = 900
ENV = {"XELINK_RANKS_PER_DEVICE": "4", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
_state = {}


def _setup(world):
    pytest.importorskip("transformers")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if "case" not in _state:
        from llama_cases import hf_logits

        from xelink.models import save_random_llama

        path = None
        if world.rank == 0:
            path = tempfile.mkdtemp(prefix="xelink-gpu-llama-")
            save_random_llama(path, "tiny", seed=3, dtype=torch.bfloat16)
        path = world.allgather_object(path)[0]
        from transformers import LlamaForCausalLM

        hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(4))
        _state["case"] = (path, ids, hf_logits(hf, ids), hf)
    return _state["case"]


def _window_folder(world):
    """The "mistral-window" case's folder (a 3-key sliding window), once per launch: rank 0 writes it."""
    if "window" not in _state:
        from llama_cases import save

        path = None
        if world.rank == 0:
            path = tempfile.mkdtemp(prefix="xelink-gpu-window-")
            save("mistral-window", path)
        _state["window"] = world.allgather_object(path)[0]
    return _state["window"]


def _rel(got, want) -> float:
    return ((got - want).norm() / want.norm()).item()


def _step_want(hf, ids, nxt):
    """transformers' logits of the token after the prompt (greedy from its own prompt logits)."""
    from llama_cases import hf_logits

    return hf_logits(hf, torch.cat([ids, nxt], 1))[:, -1]


def check_bf16_logits_match_transformers(world):
    from xelink.models import Llama

    path, ids, want, hf = _setup(world)
    nxt = want[:, -1].argmax(-1, keepdim=True)
    want_step = _step_want(hf, ids, nxt)
    for impl in ("xelink", "auto"):
        for weights, tol in (("bf16", 3e-2), ("w8a16", 6e-2), ("w4a16", 0.3)):
            model = Llama.from_pretrained(path, tp_group=world, dtype=torch.bfloat16, weights=weights, impl=impl,
                                          max_batch=2, max_seq_len=64)
            got = model(ids, 0).float().cpu()
            err = _rel(got, want)
            assert err < tol, f"impl={impl} weights={weights}: relative error {err:.3g} > {tol}"
            # Decode through the cache (gemv, decode_attention): the next step against transformers'.
            step = model(nxt, 24).float().cpu()
            err = _rel(step[:, -1], want_step)
            assert err < tol, f"impl={impl} weights={weights}: decode step relative error {err:.3g} > {tol}"
            out = model.generate(ids[:1], 4, eos_token_id=[])
            assert out.shape == (1, 28) and torch.equal(out[:, :24].cpu(), ids[:1])
            top2 = want[0, -1].topk(2).values
            if weights == "bf16" and (top2[0] - top2[1]).item() > 0.1:
                assert out[0, 24].item() == nxt[0, 0].item(), f"impl={impl}: first greedy token differs"


@only(sizes=(2,))
def check_cp2_bf16_matches_transformers(world):
    """CP = 2 over the two ranks (the prefill through cp_attention on CUDA, the decode KV round-robin, the
    partial decode attention merged across the CP group); then a ragged batch (its prefill through
    cp_attention_varlen) and a decode step at each row's own position."""
    from llama_cases import hf_logits

    from xelink.models import Llama

    path, ids, want, hf = _setup(world)
    nxt = want[:, -1].argmax(-1, keepdim=True)
    want_step = _step_want(hf, ids, nxt)
    for impl in ("xelink", "auto"):
        model = Llama.from_pretrained(path, cp_group=world, dtype=torch.bfloat16, impl=impl, max_batch=2,
                                      max_seq_len=64)
        got = model(ids, 0).float().cpu()
        err = _rel(got, want)
        assert err < 3e-2, f"CP=2 impl={impl}: relative error {err:.3g}"
        step = model(nxt, 24).float().cpu()
        err = _rel(step[:, -1], want_step)
        assert err < 3e-2, f"CP=2 impl={impl}: decode step relative error {err:.3g}"
        seen = world.allgather_object(step.numpy().tobytes())
        assert seen[0] == seen[1], f"CP=2 impl={impl}: ranks disagree"
        # A ragged batch (row 1 left-padded by 9: cp_attention_varlen on CUDA), then a token a row at its own position.
        mask = torch.ones_like(ids)
        mask[1, :9] = 0
        padded = ids.masked_fill(mask == 0, 0)
        got = model(padded, 0, mask).float().cpu()
        err = _rel(got[mask.bool()], hf_logits(hf, padded, mask)[mask.bool()])
        assert err < 3e-2, f"CP=2 impl={impl}: ragged prompt relative error {err:.3g}"
        step = model(nxt, [24, 15]).float().cpu()[:, -1]
        for b, n in enumerate((24, 15)):
            want_b = hf_logits(hf, torch.cat([ids[b:b + 1, 24 - n:], nxt[b:b + 1]], 1))[0, -1]
            err = _rel(step[b], want_b)
            assert err < 3e-2, f"CP=2 impl={impl}: ragged decode row {b} relative error {err:.3g}"



@only(sizes=(2,))
def check_cp2_sliding_window_bf16_matches_transformers(world):
    """The "mistral-window" case (a 3-key sliding window) at CP = 2 on CUDA: the prompt through cp_attention's
    window (the halo exchange), then each row's last 3 keys gathered into a ring on both ranks and the decode steps
    over it (the decode step on the device); the prompt's logits and five decode steps' (given tokens, positions 9-13)
    against transformers'."""
    pytest.importorskip("transformers")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from llama_cases import hf_logits, hf_model

    from xelink.models import Llama

    path = _window_folder(world)
    seq = torch.randint(0, 128, (2, 14), generator=torch.Generator().manual_seed(6))
    want = hf_logits(hf_model("mistral-window"), seq)
    for impl in ("xelink", "auto"):
        model = Llama.from_pretrained(path, cp_group=world, dtype=torch.bfloat16, impl=impl, max_batch=2,
                                      max_seq_len=32)
        err = _rel(model(seq[:, :9], 0).float().cpu(), want[:, :9])
        assert err < 3e-2, f"CP=2 window impl={impl}: prompt relative error {err:.3g}"
        for p in range(9, 14):
            step = model(seq[:, p:p + 1], p).float().cpu()
            err = _rel(step[:, -1], want[:, p])
            assert err < 3e-2, f"CP=2 window impl={impl}: decode at position {p} relative error {err:.3g}"
        seen = world.allgather_object(step.numpy().tobytes())
        assert seen[0] == seen[1], f"CP=2 window impl={impl}: ranks disagree"


@only(sizes=(2,))
def check_cp2_chunks_after_the_prompt_bf16_match_transformers(world):
    """At CP = 2 on CUDA, a sequence fed as a prompt, a chunk after it (computed on both ranks: each attends to its
    cached keys, rank 0 to the chunk's own, merged), a decode token, then another chunk: every position's logits
    against transformers' over the whole sequence, for the Llama case and "mistral-window" (a 3-key window: its
    ring on both ranks)."""
    from llama_cases import hf_logits, hf_model

    from xelink.models import Llama

    path, ids, want, _ = _setup(world)
    window = _window_folder(world)
    seq = torch.randint(0, 128, (2, 14), generator=torch.Generator().manual_seed(7))
    cases = [("llama", path, ids, want, (10, 18, 19)), ("window", window, seq, hf_logits(hf_model("mistral-window"),
                                                                                       seq), (6, 10, 11))]
    for name, folder, tokens, full, (a, b, c) in cases:
        for impl in ("xelink", "auto"):
            model = Llama.from_pretrained(folder, cp_group=world, dtype=torch.bfloat16, impl=impl, max_batch=2,
                                          max_seq_len=32)
            got = torch.cat([model(tokens[:, lo:hi], lo).float().cpu()
                             for lo, hi in ((0, a), (a, b), (b, c), (c, tokens.shape[1]))], dim=1)
            for lo, hi in ((0, a), (a, b), (b, c), (c, tokens.shape[1])):
                err = _rel(got[:, lo:hi], full[:, lo:hi])
                assert err < 3e-2, f"CP=2 {name} impl={impl}: positions {lo}..{hi - 1} relative error {err:.3g}"
            seen = world.allgather_object(got.numpy().tobytes())
            assert seen[0] == seen[1], f"CP=2 {name} impl={impl}: ranks disagree"


def check_decode_graph_under_tp_and_cp_matches_eager(world):
    """The decode step captured in a CUDA graph with the TP all-reduces and the head's gather in it, then under
    CP with the cache writes at the positions' slots and the merge's all-gather in it (ranks sharing the GPU): its
    logits equal the eager step's bit for bit, positions moving; greedy generation through it gives the eager
    loop's tokens on every rank, a ragged batch too; under CP also a model with a sliding window of 8 on one layer
    of two (its ring on every rank: the window layer's decode without a merge, in the same graph)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import dataclasses

    from xelink.models import Llama
    from xelink.models.checkpoint import CONFIGS

    windowed = dataclasses.replace(CONFIGS["tiny"], model_type="qwen2", sliding_window=8,
                                   layer_types=["sliding_attention", "full_attention"])
    for impl, group, cfg in (("xelink", "tp_group", "tiny"), ("auto", "tp_group", "tiny"),
                             ("xelink", "cp_group", "tiny"), ("auto", "cp_group", "tiny"),
                             ("xelink", "cp_group", windowed)):
        model = Llama.random(cfg, seed=9, dtype=torch.bfloat16, impl=impl, max_batch=2, max_seq_len=96,
                             **{group: world})
        impl = f"{impl} {group}{' window' if cfg is windowed else ''}"
        ids = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
        graph = model.decode_graph(2)
        model(ids, 0)
        tok = torch.tensor([5, 7])
        for step in range(3):
            pos = torch.tensor([20 + step, 20 + step], device=model.device)
            want = model.decode(tok.to(model.device), pos).float().cpu()
            got = graph.step(tok, pos).float().cpu()
            assert torch.equal(got, want), f"impl={impl} step {step}: graph logits differ from the eager step"
        mask = torch.ones_like(ids)
        mask[1, :6] = 0
        for m in (None, mask):
            a = model.generate(ids, 8, attention_mask=m, eos_token_id=[], cuda_graph=True)
            b = model.generate(ids, 8, attention_mask=m, eos_token_id=[], cuda_graph=False)
            assert torch.equal(a, b), f"impl={impl}: graph tokens {a[:, 20:].tolist()} != eager {b[:, 20:].tolist()}"
            assert all(torch.equal(a, x) for x in world.allgather_object(a)), f"impl={impl}: ranks disagree"

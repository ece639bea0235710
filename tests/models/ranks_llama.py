"""Tensor-parallel Llama on CPU ranks: TP = 1, 2, 4 (and two TP = 2 replicas at 4 ranks) give the same
tokens and logits as one rank, ragged batches with attention masks included; seeded sampling draws the
same tokens on every rank; KV heads replicated when TP > KV heads; the errors. The folder is written once
per launch by rank 0 (transformers' save_pretrained) and its path shared."""
import tempfile

import pytest
import torch

WORLD_SIZES = (1, 2, 4)
TOL = 1e-4
_state = {}


def _folder(world, name="llama3.1"):
    """(path, HF's logits and greedy tokens on ``_prompts``) of case ``name``, once per launch: rank 0 writes
    the folder; every rank builds the same seeded HF model (waiting ranks spinning in a barrier would slow
    rank 0 down more than the duplicated work costs)."""
    pytest.importorskip("transformers")
    if name not in _state:
        from llama_cases import hf_greedy, hf_logits, hf_model, save

        path = None
        if world.rank == 0:
            path = tempfile.mkdtemp(prefix=f"xelink-llama-{name}-")
            save(name, path, shard=True)
        hf = hf_model(name)
        ids, mask = _prompts()
        want = (hf_logits(hf, ids, mask), hf_greedy(hf, ids, 5, mask))
        _state[name] = (world.allgather_object(path)[0],) + want
    return _state[name]


def _tp(world, size):
    """Consecutive blocks of ``size`` ranks."""
    return world.split(world.rank // size)


def _prompts():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 150, (3, 7), generator=g)  # in every case's vocabulary
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :2] = 0
    return ids.masked_fill(mask == 0, 0), mask


def check_tp_matches_one_rank_and_transformers(world):
    from xelink.models import Llama

    path, want, want_tokens = _folder(world)
    ids, mask = _prompts()
    # TP = the world size (1, 2, 4 over the launches), and at 4 ranks two TP = 2 replicas as well.
    for size in sorted({world.size, 2} if world.size == 4 else {world.size}):
        tp = _tp(world, size)
        model = Llama.from_pretrained(path, tp_group=tp, dtype=torch.float32, max_batch=3, max_seq_len=32)
        # llama3.1 case: 8 heads, 2 KV heads: TP 4 replicates each KV head on two ranks.
        assert model.kv_heads == (2 // size if size <= 2 else 1)
        got = model(ids, 0, mask)
        real = mask.bool()
        err = (got[real] - want[real]).abs().max().item()
        assert err < TOL, f"TP={size}: logits differ from transformers by {err}"
        tokens = model.generate(ids, 5, attention_mask=mask, eos_token_id=[])
        assert torch.equal(tokens, want_tokens), f"TP={size}: {tokens} != {want_tokens}"
        # Every rank of the group holds the same logits and tokens.
        seen = tp.allgather_object((got.numpy().tobytes(), tokens.tolist()))
        assert all(s == seen[0] for s in seen), f"TP={size}: ranks disagree"
        tp.free()


def check_seeded_sampling_same_tokens_on_every_rank(world):
    from xelink.models import Llama

    path = _folder(world)[0]
    ids, mask = _prompts()
    tp = _tp(world, world.size)
    model = Llama.from_pretrained(path, tp_group=tp, dtype=torch.bfloat16, max_batch=3, max_seq_len=32)
    a = model.generate(ids, 6, attention_mask=mask, temperature=0.9, top_p=0.95, seed=11, eos_token_id=[])
    b = model.generate(ids, 6, attention_mask=mask, temperature=0.9, top_p=0.95, seed=11, eos_token_id=[])
    assert torch.equal(a, b)
    c = model.generate(ids, 6, attention_mask=mask, temperature=0.9, seed=None, eos_token_id=[])  # rank 0's seed
    seen = world.allgather_object((a.tolist(), c.tolist()))
    assert all(s == seen[0] for s in seen), "ranks drew different tokens"


def check_errors(world):
    from xelink.models import Llama

    path = _folder(world, "llama2")[0]  # 4 heads, 4 KV heads
    if world.size == 1:
        with pytest.raises(TypeError, match="tp_group=.* must be an xelink Communicator"):
            Llama.from_pretrained(path, tp_group="world")
        return
    with pytest.raises(ValueError, match="context parallelism is not wired into the model yet"):
        Llama.from_pretrained(path, cp_group=world)
    one = world.split(world.rank)  # a CP group of one rank works
    Llama.from_pretrained(path, cp_group=one, dtype=torch.float32, max_seq_len=8)
    if world.size == 4:
        three = world.split(0 if world.rank < 3 else 1)
        if world.rank < 3:
            with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by the TP size 3"):
                Llama.from_pretrained(path, tp_group=three)

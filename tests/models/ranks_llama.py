"""Tensor- and context-parallel Llama on CPU ranks: TP = 1, 2, 4 (and two TP = 2 replicas at 4 ranks) give
the same tokens and logits as one rank, ragged batches with attention masks included; CP = 2 (2 ranks), CP =
4 and TP = 2 x CP = 2 (4 ranks) give transformers' logits and greedy tokens on a 7-token prompt (not a
multiple of the 2 x CP zigzag blocks) and 6 decode steps (the round-robin KV placement wraps); seeded
sampling draws the same tokens on every rank (TP, CP and TP x CP); KV heads replicated when TP > KV heads; biases and
a vocabulary the TP size does not divide; the errors. The folder is written once
per launch by rank 0 (transformers' save_pretrained) and its path shared."""
import tempfile

import pytest
import torch
from ranks import only

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
        # The padded batch, and the same rows unpadded (every token real: CP takes no padding).
        want = (hf_logits(hf, ids, mask), hf_greedy(hf, ids, 5, mask), hf_logits(hf, ids), hf_greedy(hf, ids, 6))
        _state[name] = (world.allgather_object(path)[0],) + want
    return _state[name]


def _tp(world, size):
    """Consecutive blocks of ``size`` ranks."""
    return world.split(world.rank // size)


def _prompts():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (3, 7), generator=g)  # in every case's vocabulary
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :2] = 0
    return ids.masked_fill(mask == 0, 0), mask


def check_tp_matches_one_rank_and_transformers(world):
    from xelink.models import Llama

    path, want, want_tokens = _folder(world)[:3]
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


@only(sizes=(2, 4))
def check_cp_and_tp_x_cp_match_transformers(world):
    """CP over the world, and at 4 ranks TP = 2 x CP = 2 (TP {0,1},{2,3}, CP {0,2},{1,3}), as ``xelink
    generate --cp`` builds the groups; the llama3.1 case, and the mistral-window one (a 3-key sliding window: the
    prompt through cp_attention's window, then each row's last 3 keys gathered into a ring on every rank)."""
    for name in ("llama3.1", "mistral-window"):
        _cp_and_tp_x_cp(world, name)


def _cp_and_tp_x_cp(world, name):
    from xelink.models import Llama

    path, want_pad, want_pad_tokens, want, want_tokens = _folder(world, name)
    ids, _ = _prompts()
    for tp_size in (1, 2) if world.size == 4 else (1,):
        cp_size = world.size // tp_size
        tp = _tp(world, tp_size)
        cp = world.split(world.rank % tp_size)
        model = Llama.from_pretrained(path, tp_group=tp, cp_group=cp, dtype=torch.float32, max_batch=3,
                                      max_seq_len=16)
        got = model(ids, 0)
        err = (got - want).abs().max().item()
        assert err < TOL, f"{name} TP={tp_size} x CP={cp_size}: logits differ from transformers by {err}"
        tokens = model.generate(ids, 6, eos_token_id=[])
        assert torch.equal(tokens, want_tokens), f"{name} TP={tp_size} x CP={cp_size}: {tokens} != {want_tokens}"
        # Each rank cached its shard of the 7 prompt positions (the decoded ones go round-robin after them); a window
        # shorter than max_seq_len: every rank a ring of the window's keys.
        cache, ring = model.caches[0], name == "mistral-window"
        assert all(type(c).__name__ == ("CPRingCache" if ring else "CPKVCache") for c in model.caches)
        assert ring or cache.first[:3] == [7] * 3 and cache.base[:3] == [len(model.cp.positions(7))] * 3
        seen = world.allgather_object((got.numpy().tobytes(), tokens.tolist()))
        assert all(s == seen[0] for s in seen), f"TP={tp_size} x CP={cp_size}: ranks disagree"
        if not ring:
            with pytest.raises(ValueError, match=r"a token goes after its row's prompt \(of \[7, 7, 7\] positions\)"):
                model(ids[:, :1], 5)
        # A ragged (left-padded) batch: the rows' real tokens packed over the ranks (cp_attention_varlen), then each
        # row decoding at its own position.
        ids_pad, mask = _prompts()
        got = model(ids_pad, 0, mask)
        err = (got[mask.bool()] - want_pad[mask.bool()]).abs().max().item()
        assert err < TOL, f"{name} TP={tp_size} x CP={cp_size}: ragged logits differ from transformers by {err}"
        tokens = model.generate(ids_pad, 5, attention_mask=mask, eos_token_id=[])
        assert torch.equal(tokens, want_pad_tokens), \
            f"{name} TP={tp_size} x CP={cp_size}: ragged {tokens} != {want_pad_tokens}"
        lens = mask.sum(1).tolist()  # each row's prompt
        cu = torch.tensor([0] + lens).cumsum(0)
        if not ring:
            assert cache.first[:3] == lens and sum(cache.base[:3]) == len(model.cp.positions(int(cu[-1]), cu))
            with pytest.raises(ValueError, match=r"a token goes after its row's prompt \(of \[7, 3, 5\] positions\)"):
                model(ids[:, :1], [11, 2, 9])
        # Sampling (rank 0's seed) draws the same tokens on every rank of the grid.
        sampled = model.generate(ids, 4, temperature=1.0, top_p=0.9, eos_token_id=[])
        seen = world.allgather_object(sampled.tolist())
        assert all(s == seen[0] for s in seen), f"TP={tp_size} x CP={cp_size}: ranks sampled different tokens"
        tp.free()
        cp.free()


def check_tp_biases_and_uneven_vocab_match_transformers(world):
    """The "bias" case (attention and MLP biases, vocabulary 130: 33 rows a rank at TP 4, the last padded):
    the row-parallel biases added once after the all-reduce, the head's padding cut. The "qwen2" case (q/k/v
    biases sliced with their heads, no o bias, a tied head; 14 heads: TP 2 where the world is even); the "qwen3"
    one (q/k norms whole on every rank, a head_dim of its own); the "phi3" one (q, k, v and gate, up sliced out of
    its fused tensors); the "mistral-window" one (a 3-key sliding window: each rank's heads in ring caches of 3
    rows, the prompts and their decode past the window)."""
    from xelink.models import Llama

    ids, mask = _prompts()
    for name, size, vocab in (("bias", world.size, 130), ("qwen2", 2 - world.size % 2, 208),
                              ("qwen3", world.size, 176), ("phi3", 2 - world.size % 2, 180),
                              ("mistral-window", world.size, 192)):
        path, want, want_tokens = _folder(world, name)[:3]
        tp = _tp(world, size)
        model = Llama.from_pretrained(path, tp_group=tp, dtype=torch.float32, max_batch=3, max_seq_len=32)
        assert all(c.ring == (name == "mistral-window") for c in model.caches)
        got = model(ids, 0, mask)
        assert got.shape[-1] == vocab
        err = (got[mask.bool()] - want[mask.bool()]).abs().max().item()
        assert err < TOL, f"{name} TP={size}: logits differ from transformers by {err}"
        tokens = model.generate(ids, 5, attention_mask=mask, eos_token_id=[])
        assert torch.equal(tokens, want_tokens), f"{name} TP={size}: {tokens} != {want_tokens}"
        tp.free()


@only(sizes=(2, 4))
def check_tp_w8a16_is_the_one_rank_model(world):
    """W8A16 under TP: the row-parallel projections (o, down) were quantized slice by slice, each rank's columns
    scaled by their own largest (another model than one rank's: tokens differed); the whole rows' scale now."""
    from xelink.models import Llama

    path = _folder(world)[0]
    ids, mask = _prompts()
    alone = world.split(world.rank)
    kw = dict(dtype=torch.float32, weights="w8a16", max_batch=3, max_seq_len=32)
    one = Llama.from_pretrained(path, tp_group=alone, **kw)
    want = one(ids, 0, mask)
    tp = _tp(world, world.size)
    model = Llama.from_pretrained(path, tp_group=tp, **kw)
    got = model(ids, 0, mask)
    err = (got[mask.bool()] - want[mask.bool()]).abs().max().item()
    assert err < TOL, f"W8A16 TP={world.size}: logits differ from one rank's by {err}"
    assert torch.equal(model.generate(ids, 5, attention_mask=mask, eos_token_id=[]),
                       one.generate(ids, 5, attention_mask=mask, eos_token_id=[]))
    for g in (tp, alone):
        g.free()


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
    # the repetition penalty over the tokens the ranks agreed on, min-p, a minimum length: still one draw
    d = model.generate(ids, 6, attention_mask=mask, temperature=1.2, min_p=0.05, repetition_penalty=1.3,
                       min_new_tokens=3, seed=12, eos_token_id=[int(a[0, 7])])
    seen = world.allgather_object((a.tolist(), c.tolist(), d.tolist()))
    assert all(s == seen[0] for s in seen), "ranks drew different tokens"


def check_errors(world):
    from xelink.models import Llama

    path = _folder(world, "llama2")[0]  # 4 heads, 4 KV heads
    if world.size == 1:
        with pytest.raises(TypeError, match="tp_group=.* must be an xelink Communicator"):
            Llama.from_pretrained(path, tp_group="world")
        return
    # TP and CP over the same ranks do not tile them.
    with pytest.raises(ValueError, match="the TP and CP groups must tile the ranks as a grid"):
        Llama.from_pretrained(path, tp_group=world, cp_group=world)
    one = world.split(world.rank)  # a CP group of one rank is no CP
    assert Llama.from_pretrained(path, tp_group=world, cp_group=one, dtype=torch.float32, max_seq_len=8).cp is None
    if world.size == 4:
        # TP {0,1},{2,3} with CP {0,3},{1,2}: a CP group whose ranks hold different TP slices.
        tp, cp = _tp(world, 2), world.split(0 if world.rank in (0, 3) else 1)
        with pytest.raises(ValueError, match=r"the ranks of cp_group hold different TP \(size, rank\)"):
            Llama.from_pretrained(path, tp_group=tp, cp_group=cp)
        # TP {0,1},{2,3} with CP {0,2},{3,1}: CP ranks out of step with the TP groups.
        cp2 = world.split(world.rank % 2, key=[0, 1, 1, 0][world.rank])
        with pytest.raises(ValueError, match=r"the ranks of tp_group hold different CP \(size, rank\)"):
            Llama.from_pretrained(path, tp_group=tp, cp_group=cp2)
        for g in (tp, cp, cp2):
            g.free()
        three = world.split(0 if world.rank < 3 else 1)
        if world.rank < 3:
            with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by the TP size 3"):
                Llama.from_pretrained(path, tp_group=three)


@only(sizes=(2, 4))
def check_cp_decode_over_round_robin_caches_matches_one_rank(world):
    # What `xelink bench decode`'s CP rows set up without a prefill: each rank's cache holding its round-robin
    # share of P cached positions' keys and values (len = its share, total = P). A token decoded at P over them
    # gives one rank's logits over the same P positions.
    from xelink.models import Llama

    one = Llama.random("tiny", impl="reference", device="cpu", dtype=torch.float32, max_seq_len=80)
    cp = Llama.random("tiny", impl="reference", device="cpu", dtype=torch.float32, cp_group=world, max_seq_len=80)
    P, gen = 37, torch.Generator().manual_seed(3)
    mine = torch.arange(P)[torch.arange(P) % world.size == world.rank]
    for c1, cc in zip(one.caches, cp.caches):
        k, v = (torch.randn(1, c1.k.shape[1], P, c1.k.shape[3], generator=gen) for _ in range(2))
        c1.k[:1, :, :P], c1.v[:1, :, :P] = k, v
        cc.k[:1, :, :len(mine)], cc.v[:1, :, :len(mine)] = k[:, :, mine], v[:, :, mine]
        cc.cached(len(mine), P)
    steps = []
    for step in range(3):  # the new tokens' keys go round-robin too
        tok = torch.tensor([[5 + step]])
        want = one.decode(tok[0], torch.tensor([P + step]))
        got = cp(tok, P + step)[:, 0]
        assert torch.allclose(got, want, rtol=TOL, atol=TOL), \
            f"step {step}: CP logits differ from one rank's by {float((got - want).abs().max()):.2e}"
        steps.append(got)
    # A slot is the position's (not the next free one): a step decoded again at an earlier position (Llama.decode,
    # what a graph replays) sees what it saw then, not the later tokens.
    again = cp.decode(torch.tensor([6]), torch.tensor([P + 1]))
    assert torch.equal(again, steps[1]), f"a step again at {P + 1}: {float((again - steps[1]).abs().max()):.2e}"
    # What DecodeGraph's warm-up does (a step at the last position, then its writes put back) leaves the caches.
    before = [(c.k.clone(), c.v.clone()) for c in cp.caches]
    restores = [c.hold(1, 79) for c in cp.caches]
    cp.decode(torch.tensor([9]), torch.tensor([79]))
    assert any(not torch.equal(c.k, k) for c, (k, _) in zip(cp.caches, before))  # its slot, or the spare one
    for restore in restores:
        restore()
    assert all(torch.equal(c.k, k) and torch.equal(c.v, v) for c, (k, v) in zip(cp.caches, before))


@only(sizes=(2, 4))
def check_cp_chunks_after_the_prompt_match_one_rank(world):
    """Under CP, chunks of tokens after the prompts (a follow-up turn; a prompt prefilled in chunks after its first):
    a prompt, a chunk at one start, decode tokens, a left-padded chunk at each row's own start (a row without a
    token in it), a one-token step leaving a row out, then ``Llama.decode`` (the device path a graph captures): the
    logits of one rank's model on the same
    calls, with full attention and with a sliding window of 5 on one layer of two (its ring gathered from the ranks
    after the prompt); CP over every rank, and at 4 ranks TP = 2 x CP = 2 too."""
    import dataclasses

    from xelink.models import Llama
    from xelink.models.checkpoint import CONFIGS

    windowed = dataclasses.replace(CONFIGS["tiny"], model_type="qwen2", sliding_window=5,
                                   layer_types=["sliding_attention", "full_attention"])
    gen = torch.Generator().manual_seed(5)
    grids = [(None, world)] + ([(_tp(world, 2), world.split(world.rank % 2))] if world.size == 4 else [])
    for cfg, (tp, cp_group) in ((c, g) for c in ("tiny", windowed) for g in grids):
        one, cp = (Llama.random(cfg, impl="reference", device="cpu", dtype=torch.float32, max_seq_len=48,
                                max_batch=2, tp_group=t, cp_group=g) for t, g in ((None, None), (tp, cp_group)))

        def same(what, *call):
            want, got = one(*call), cp(*call)
            real = torch.ones(want.shape[:2], dtype=torch.bool) if len(call) < 3 else call[2].bool()
            err = float((got[real] - want[real]).abs().max())
            assert err < TOL, f"{what} ({'window' if cfg is windowed else 'full'}, TP {1 if tp is None else tp.size} " \
                              f"x CP {cp_group.size}): logits differ from one rank's by {err:.2e}"

        same("prompt", torch.randint(0, 500, (2, 9), generator=gen), 0)
        same("chunk at 9", torch.randint(0, 500, (2, 6), generator=gen), 9)
        for p in (15, 16):
            same(f"token at {p}", torch.randint(0, 500, (2, 1), generator=gen), p)
        mask = torch.ones(2, 7, dtype=torch.long)
        mask[1, :3] = 0
        same("ragged chunk", torch.randint(0, 500, (2, 7), generator=gen), [17, 17], mask)
        mask[0, :] = 0  # row 0 without a token in this chunk
        same("a row without tokens", torch.randint(0, 500, (2, 7), generator=gen), [24, 21], mask)
        same("a token a row", torch.randint(0, 500, (2, 1), generator=gen), [24, 25])
        same("chunk at different starts", torch.randint(0, 500, (2, 3), generator=gen), [25, 26])
        same("a row left out of a one-token step", torch.randint(0, 500, (2, 1), generator=gen), [28, 29],
             torch.tensor([[1], [0]]))
        tok, at = torch.randint(0, 500, (2,), generator=gen), torch.tensor([29, 29])
        got, want = cp.decode(tok, at), one.decode(tok, at)
        assert float((got - want).abs().max()) < TOL, "Llama.decode after the chunks"
        with pytest.raises(ValueError, match=r"a token goes after its row's prompt \(of \[9, 9\] positions\)"):
            cp(torch.zeros(2, 3, dtype=torch.long), 4)
    for group in grids[1] if len(grids) > 1 else ():
        group.free()


@only(sizes=(2, 4))
def check_cp_ragged_rows_match_one_rank(world):
    """Under CP a ragged batch with a row of padding only (its prompt empty) and rows decoding at their own
    positions, that row from position 0, then new sequences token by token from 0: the logits of one rank's model on
    the same calls."""
    from xelink.models import Llama

    one = Llama.random("tiny", impl="reference", device="cpu", dtype=torch.float32, max_seq_len=40, max_batch=3)
    cp = Llama.random("tiny", impl="reference", device="cpu", dtype=torch.float32, cp_group=world, max_seq_len=40,
                      max_batch=3)
    ids = torch.randint(0, 100, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :] = 0
    mask[2, :5] = 0
    real = mask.bool()
    want, got = one(ids, 0, mask), cp(ids, 0, mask)
    assert torch.allclose(got[real], want[real], rtol=TOL, atol=TOL), float((got[real] - want[real]).abs().max())
    starts = [9, 0, 4]
    for step in range(3):
        tok = torch.tensor([[3 + step], [4], [5]])
        want, got = one(tok, starts), cp(tok, starts)
        assert torch.allclose(got, want, rtol=TOL, atol=TOL), (step, float((got - want).abs().max()))
        starts = [s + 1 for s in starts]
    for p in range(3):  # every row at 0: new sequences, a token at a time (the prompts' slots forgotten)
        tok = torch.tensor([[7 + p], [8], [9]])
        want, got = one(tok, p), cp(tok, p)
        assert torch.allclose(got, want, rtol=TOL, atol=TOL), (p, float((got - want).abs().max()))

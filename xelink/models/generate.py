"""Generation with a KV cache: one prefill of the (left-padded) prompts, then one token per step.

Every rank of the TP and CP groups runs the same loop. Sampling draws from a ``torch.Generator`` seeded
identically on every rank (the seed rank 0 picks when none is given), and rank 0's tokens are broadcast,
so the ranks never disagree on a token even where their logits differ in the last bit.
"""
from __future__ import annotations

import numbers
import random
import time

import torch

__all__ = ["generate", "sample", "sampling_probs"]

# generation_config.json settings that change transformers' tokens and that generate does not do, with the value
# that does nothing (None: only absent, None or empty does nothing); the sampling-only ones matter when sampling
_NOT_DONE = {"num_beams": 1, "num_beam_groups": 1, "penalty_alpha": 0, "no_repeat_ngram_size": 0,
             "bad_words_ids": None, "force_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None,
             "forced_bos_token_id": None, "forced_eos_token_id": None, "exponential_decay_length_penalty": None,
             "sequence_bias": None, "guidance_scale": 1, "dola_layers": None, "watermarking_config": None,
             "encoder_repetition_penalty": 1.0, "encoder_no_repeat_ngram_size": 0, "num_return_sequences": 1,
             "stop_strings": None}
# The settings generate reads, with the special tokens
_READ = ("bos_token_id", "eos_token_id", "pad_token_id", "do_sample", "temperature", "top_p", "top_k", "min_p",
         "repetition_penalty", "min_new_tokens", "min_length")
_NOT_DONE_SAMPLING = {"typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None}


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None,
           top_k: int = 0, min_p: float = 0.0):
    """Next tokens ``[B]`` from float logits ``[B, V]``: argmax at temperature 0, else a draw from
    ``sampling_probs``."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = sampling_probs(logits, temperature, top_p, top_k, min_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0,
                   min_p: float = 0.0) -> torch.Tensor:
    """The (unnormalized) probabilities sampling draws from: the ``top_k`` most likely tokens (0: all), then
    the smallest prefix of them holding ``top_p`` of the mass, then those at least ``min_p`` times as likely
    as the most likely one (transformers' order: temperature, top-k, top-p, min-p); the others 0."""
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(dim=-1) - sorted_p > top_p  # keep the smallest prefix reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    if min_p > 0:  # relative to the top token: the same whether or not the kept mass is renormalized
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


def _processed(logits: torch.Tensor, seen: torch.Tensor, penalty: float, eos_t: torch.Tensor, ban_eos: bool):
    """transformers' logits processors that greedy and sampled decoding share, in its order: the repetition
    penalty over every id of ``seen`` (``[B, L]``: the prompts as given, padding included, then the new tokens;
    a logit below 0 multiplied by ``penalty``, else divided), then the EOS ids banned (``ban_eos``: below the
    minimum length)."""
    if penalty != 1.0:
        score = logits.gather(1, seen)
        logits = logits.scatter(1, seen, torch.where(score < 0, score * penalty, score / penalty))
    if ban_eos and eos_t.numel():
        logits = logits.index_fill(1, eos_t, float("-inf"))
    return logits


def settings_of_model_config(hf: dict) -> dict:
    """The generation settings of a ``config.json`` (a folder without ``generation_config.json``), as transformers
    builds its generation config from the model's: those ``generate`` reads and those it refuses (``_NOT_DONE``)."""
    return {k: hf[k] for k in _READ + tuple(_NOT_DONE) + tuple(_NOT_DONE_SAMPLING) if hf.get(k) is not None}


def _eos_list(eos, fn):
    if eos is None:
        return []
    single = isinstance(eos, numbers.Integral) or (isinstance(eos, torch.Tensor) and eos.dim() == 0)
    try:
        items = [eos] if single else list(eos)
    except TypeError:
        items = [None]
    for e in items:
        if isinstance(e, bool) or not isinstance(e, (numbers.Integral, torch.Tensor)) or \
                (isinstance(e, torch.Tensor) and (e.dim() or e.is_floating_point())):
            raise TypeError(f"{fn}: eos_token_id={eos!r} must be an int or a list of ints")
    return [int(e) for e in items]


def generate(model, input_ids: torch.Tensor, max_new_tokens: int, *, attention_mask=None, temperature=None,
             top_p=None, top_k=None, eos_token_id=None, seed=None, cuda_graph=None, repetition_penalty=None,
             min_p=None, min_new_tokens=None) -> torch.Tensor:
    """Continue a batch of prompts.

    Args:
        model: a ``Llama``.
        input_ids: ``[B, S]`` prompts, left-padded where their lengths differ (with ``attention_mask``).
        max_new_tokens: tokens to add at most.
        attention_mask: ``[B, S]`` 0/1, left-padded; None: as transformers' generate, the tokens other than
            ``generation_config.json``'s ``pad_token_id`` where the prompts hold it and it is no EOS (left padding
            only: ValueError for a pad token after a real one), else every token real.
        temperature: 0 greedy, > 0 sampling; None: ``generation_config.json``'s (when it has
            ``do_sample``), else 0.
        top_p: nucleus mass in (0, 1] (sampling only); None: ``generation_config.json``'s, else 1.
        top_k: sample from the k most likely tokens (0: all); None: ``generation_config.json``'s, else 50
            (transformers' default, which its sampling applies too; a null there is the default too).
        eos_token_id: an int or a list (Llama 3.1 has three); None: ``generation_config.json``'s. A sequence
            stops at its first EOS (later positions get the pad token: ``pad_token_id``, else the first EOS).
        seed: the sampling generator's seed (the same on every rank); None: one rank 0 picks.
        repetition_penalty: > 0; every token already in a row (its prompt's tokens, not its left padding, and
            its new tokens) has its logit divided by it (multiplied where negative), greedy or sampling, as
            transformers' (5: the padding skipped); None: ``generation_config.json``'s, else 1 (none).
        min_p: in [0, 1]: when sampling, keep the tokens at least ``min_p`` times as likely as the most likely
            one (after top-k and top-p); None: ``generation_config.json``'s, else 0.
        min_new_tokens: no EOS before this many new tokens; None: ``generation_config.json``'s, else 0. Its
            ``min_length`` (prompt length plus new tokens, as transformers counts it) holds too.
        cuda_graph: decode steps as replays of ``model.decode_graph(B)`` (one CUDA graph a step, greedy
            tokens taken from the graph's argmax); None: where the model allows it (CUDA, the kernel path),
            True: required (ValueError where not), False: eager steps.

    Returns:
        ``[B, S + n]`` int64 on the CPU, the prompts then ``n <= max_new_tokens`` new tokens (fewer when
        every sequence stopped). ``model.last_timings`` gets ``ttft_s`` (the prefill and first token) and
        ``tpot_s`` (mean seconds a later token).

    Raises ValueError for a ``generation_config.json`` setting that would change transformers' tokens and that
    this loop does not do (beam search, n-gram bans, ...: ``_NOT_DONE``), before any work.

    Collective over the TP and CP groups.
    """
    fn = "Llama.generate"
    gc = model.generation_config
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"{fn}: max_new_tokens={max_new_tokens!r} must be an int >= 0")
    sampling = bool(gc.get("do_sample", False))

    def setting(name, default):  # generation_config.json's value; null there is transformers' default
        value = gc.get(name)
        return default if value is None else value

    if temperature is None:
        temperature = float(setting("temperature", 1.0)) if sampling else 0.0
    if top_p is None:
        top_p = float(setting("top_p", 1.0))  # (the folder's, as top_k: they act only when sampling)
    if top_k is None:
        top_k = setting("top_k", 50)
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
        raise ValueError(f"{fn}: top_k={top_k!r} must be an int >= 0 (0: no top-k filter)")
    if not temperature >= 0:
        raise ValueError(f"{fn}: temperature={temperature!r} must be >= 0")
    if not 0 < top_p <= 1:
        raise ValueError(f"{fn}: top_p={top_p!r} must be in (0, 1]")
    if repetition_penalty is None:
        repetition_penalty = gc.get("repetition_penalty") or 1.0
    if isinstance(repetition_penalty, bool) or not isinstance(repetition_penalty, numbers.Real) or \
            not repetition_penalty > 0:
        raise ValueError(f"{fn}: repetition_penalty={repetition_penalty!r} must be a number > 0 (1: none)")
    if min_p is None:
        min_p = setting("min_p", 0.0)
    if isinstance(min_p, bool) or not isinstance(min_p, numbers.Real) or not 0 <= min_p <= 1:
        raise ValueError(f"{fn}: min_p={min_p!r} must be in [0, 1] (0: none)")
    if min_new_tokens is None:
        min_new_tokens = gc.get("min_new_tokens") or 0
    if isinstance(min_new_tokens, bool) or not isinstance(min_new_tokens, numbers.Integral) or min_new_tokens < 0:
        raise ValueError(f"{fn}: min_new_tokens={min_new_tokens!r} must be an int >= 0")
    for name, idle in list(_NOT_DONE.items()) + (list(_NOT_DONE_SAMPLING.items()) if temperature > 0 else []):
        value = gc.get(name)
        if value is not None and value != idle and (idle is not None or value not in ([], {})):
            raise ValueError(f"{fn}: generation_config.json sets {name}={value!r}, which transformers' generate "
                             f"would apply and this one does not; remove it from model.generation_config to "
                             f"generate without it")
    eos = _eos_list(gc.get("eos_token_id") if eos_token_id is None else eos_token_id, fn)
    pad = gc.get("pad_token_id")
    pad = pad if isinstance(pad, int) else (eos[0] if eos else 0)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int32, torch.int64):
        what = input_ids.dtype if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise TypeError(f"{fn}: input_ids must be an int32/int64 tensor [B, S], got {what}")
    if input_ids.dim() != 2 or 0 in input_ids.shape:
        raise ValueError(f"{fn}: input_ids.shape={tuple(input_ids.shape)} must be [B, S] with B, S >= 1")
    ids = input_ids.to("cpu", torch.int64)
    B, S = ids.shape
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or
                                       tuple(attention_mask.shape) != (B, S)):
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"{fn}: attention_mask must be a [B, S] = {(B, S)} tensor like input_ids, got {got}")
    pad_id = gc.get("pad_token_id")
    if attention_mask is None and isinstance(pad_id, int) and pad_id not in eos and bool((ids == pad_id).any()):
        # as transformers' generate: a prompt holding the pad token (not an EOS) is padded there
        attention_mask = (ids != pad_id).long()
        real = attention_mask.sum(1, keepdim=True)
        odd = (attention_mask != (torch.arange(S)[None, :] >= S - real).long()).any(1)
        if odd.any():
            raise ValueError(f"{fn}: input_ids row {int(odd.nonzero()[0])} holds pad_token_id={pad_id} "
                             f"(generation_config.json) other than as left padding; transformers' generate would "
                             f"mask those tokens: pass attention_mask (1 for every token to keep)")
    lens = [S] * B if attention_mask is None else attention_mask.to("cpu", torch.int64).sum(1).tolist()
    if min(lens) < 1:
        raise ValueError(f"{fn}: a row of attention_mask has no token (every prompt needs one)")
    if max(lens) > model.max_seq_len:
        raise ValueError(f"{fn}: a prompt of {max(lens)} tokens is longer than max_seq_len={model.max_seq_len}")
    # the last new token is returned, never fed back: positions up to prompt + max_new_tokens - 1 are cached
    if max(lens) + max_new_tokens - 1 > model.max_seq_len:
        raise ValueError(f"{fn}: {max(lens)} prompt tokens + max_new_tokens={max_new_tokens} exceed "
                         f"max_seq_len={model.max_seq_len} + 1")
    model._lengths(fn, ids, 0, attention_mask)  # the model call's own checks, named for this call, before any work

    def agree(t):  # rank 0's of the TP group, then of the CP group: TP rank 0 of CP rank 0's everywhere
        t = model.tp.agree(t)
        return t if model.cp is None else model.cp.agree(t)

    if temperature > 0:
        if seed is None:
            seed = random.SystemRandom().randrange(2 ** 62)
            seed = int(agree(torch.tensor([seed], dtype=torch.int64))[0])
        generator = torch.Generator().manual_seed(int(seed))
    else:
        generator = None
    if cuda_graph not in (None, True, False):
        raise ValueError(f"{fn}: cuda_graph={cuda_graph!r} must be None, True or False")
    graphable = model.graph_capturable
    if cuda_graph and not graphable:
        raise ValueError(f"{fn}: cuda_graph=True needs the model on CUDA, impl 'auto' or 'xelink', dtype bfloat16 or "
                         f"float16 (device {model.device}, impl {model.impl!r}, {model.dtype})")
    if max_new_tokens == 0:
        return ids
    graph = model.decode_graph(B) if graphable and cuda_graph is not False and max_new_tokens > 1 else None
    t0 = time.perf_counter()
    logits = model(ids, 0, attention_mask, logits_to_keep=1)[:, -1]  # the head reads the last position only
    done = torch.zeros(B, dtype=torch.bool)
    eos_t = torch.tensor(eos, dtype=torch.int64)
    out, starts = [], list(lens)
    ttft = None
    seen, min_length = ids, gc.get("min_length") or 0  # transformers counts the (padded) prompt in min_length
    if attention_mask is not None and repetition_penalty != 1:  # a pad is no token seen: its row's first real one
        first = ids.gather(1, (S - torch.tensor(lens))[:, None])  # stands in (penalized once, as it is anyway)
        seen = torch.where(attention_mask.to("cpu").bool(), ids, first)
    for step in range(max_new_tokens):
        ban_eos = step < min_new_tokens or S + step < min_length
        if graph is not None and step > 0 and temperature <= 0 and repetition_penalty == 1 and not ban_eos:
            token = graph.next_tokens.cpu()  # the graph's argmax: B ints to the host
        else:
            scores = _processed(logits.float().cpu(), seen, float(repetition_penalty), eos_t, ban_eos)
            token = sample(scores, temperature, top_p, generator, int(top_k), float(min_p))
            token = token.to(torch.int64).contiguous()
        token = agree(token)
        token = torch.where(done, torch.full_like(token, pad), token)
        out.append(token)
        if repetition_penalty != 1:
            seen = torch.cat([seen, token[:, None]], dim=1)
        if ttft is None:
            ttft = time.perf_counter() - t0
        if eos:
            done |= torch.isin(token, eos_t)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        if graph is not None:
            logits = graph.step(token, starts)
        else:
            logits = model(token[:, None], starts)[:, -1]
        starts = [s + 1 for s in starts]
    total = time.perf_counter() - t0
    model.last_timings = {"ttft_s": ttft, "tpot_s": (total - ttft) / max(len(out) - 1, 1),
                          "new_tokens": len(out)}
    return torch.cat([ids, torch.stack(out, dim=1)], dim=1)

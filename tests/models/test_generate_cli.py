"""``xelink generate`` under mpiexec on the tiny config: the tokens equal one-rank ``Llama.generate``'s (TP 2 by
default: the ranks of the one package; CP 2; two TP-1 replicas), text through the folder's tokenizer.json, the
timings printed, and the clear messages (no tokenizer, an error of the model's checks) with exit status 2."""
import ast
import os
import subprocess
import sys

import pytest
import ranks
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from xelink.models import Llama, save_random_llama  # noqa: E402

PROMPT = [1, 2, 3, 4]


def _run(*args, n=None, env=None):
    cmd = [sys.executable, "-m", "xelink", "generate", *args]
    if n is not None:
        cmd = [ranks.mpiexec(), "-n", str(n), *cmd]
    # CPU ranks, on a GPU host too (there, two ranks would otherwise both bind GPU 0 and be refused).
    env = dict(os.environ if env is None else env, CUDA_VISIBLE_DEVICES="")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_random_llama(tmp_path_factory.mktemp("tiny-cli"), "tiny", seed=2, dtype=torch.float32)
    model = Llama.from_pretrained(path, dtype=torch.float32, max_seq_len=64)
    plain, penalized = (model.generate(torch.tensor([PROMPT]), 6, eos_token_id=[], repetition_penalty=p)
                        for p in (None, 3.0))
    return path, plain[0, len(PROMPT):].tolist(), penalized[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("layout,note", [((), "TP 2,"), (("--cp", "2"), "TP 1, CP 2,"),
                                         (("--tp", "1"), "TP 1, 2 replicas,")], ids=["tp2", "cp2", "replicas"])
def test_generate_under_mpiexec_prints_the_one_rank_tokens(tiny, layout, note):
    path, want, _ = tiny
    r = _run("--model", str(path), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "6",
             "--dtype", "fp32", *layout, n=2)
    assert r.returncode == 0, r.stderr
    assert f"2 rank(s), {note}" in r.stdout
    assert f"prompt (4 tokens): {PROMPT}" in r.stdout
    assert f"new tokens (6): {want}" in r.stdout  # the generation config's EOS (2) is not among them
    assert "time to first token: " in r.stdout and "ms; time per output token: " in r.stdout
    assert r.stdout.count("new tokens") == 1  # rank 0 prints


def test_generate_w4a16_with_the_head_quantized(tiny):
    # --weights w4a16 --quantize-head: one rank, the tokens of the model loaded so (the folder's EOS stops both)
    path = tiny[0]
    model = Llama.from_pretrained(path, dtype=torch.float32, max_seq_len=64, weights="w4a16", quantize_head=True)
    want = model.generate(torch.tensor([PROMPT]), 6)[0, len(PROMPT):].tolist()
    r = _run("--model", str(path), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "6",
             "--dtype", "fp32", "--weights", "w4a16", "--quantize-head")
    assert r.returncode == 0, r.stderr
    assert f"new tokens ({len(want)}): {want}" in r.stdout and "weights w4a16 (the head too)" in r.stdout


def test_generate_text_prompt_through_tokenizer_json(tiny, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tiny[0]
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(512)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "with-tokenizer"
    folder.mkdir()
    for f in path.iterdir():
        (folder / f.name).symlink_to(f)
    tok.save(str(folder / "tokenizer.json"))
    r = _run("--model", str(folder), "--prompt", "w1 w2 w3 w4", "--max-new-tokens", "6", "--dtype", "fp32")
    assert r.returncode == 0, r.stderr
    assert f"prompt (4 tokens): {PROMPT}" in r.stdout
    new = ast.literal_eval(r.stdout.split("new tokens (6): ")[1].splitlines()[0])
    assert new == tiny[1]
    assert f"text: {' '.join(f'w{t}' for t in new)}" in r.stdout
    # generate's options on the command line: the repetition penalty (greedy: top-k, top-p, min-p do nothing)
    r = _run("--model", str(folder), "--prompt", "w1 w2 w3 w4", "--max-new-tokens", "6", "--dtype", "fp32",
             "--repetition-penalty", "3", "--top-k", "5", "--top-p", "0.5", "--min-p", "0.1")
    assert r.returncode == 0, r.stderr
    assert f"new tokens (6): {tiny[2]}" in r.stdout and tiny[2] != tiny[1], (r.stdout, tiny)
    # text without a token: named, exit 2 (not the model's dtype error of an empty float tensor)
    r = _run("--model", str(folder), "--prompt", "  ", "--max-new-tokens", "2")
    assert r.returncode == 2 and "xelink generate: --prompt '  ' gives no tokens" in r.stderr, r.stderr


def test_generate_chat_prompt_through_the_folders_template(tiny, tmp_path, capsys):
    """--chat: the prompt as a user's turn in the folder's chat template (transformers' apply_chat_template with
    the generation prompt), the text printed without special tokens; clear messages without a template."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    from xelink import cli

    path = tiny[0]
    folder = tmp_path / "chat"
    folder.mkdir()
    for f in path.iterdir():
        (folder / f.name).symlink_to(f)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(512)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": "{% for m in messages %}w9 {{ m['content'] }} "
        "w8 {% endfor %}{% if add_generation_prompt %}w7{% endif %}"}))
    r = _run("--model", str(folder), "--prompt", "w1 w2", "--chat", "--max-new-tokens", "3", "--dtype", "fp32")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "prompt (5 tokens): [9, 1, 2, 8, 7]" in out, out
    model = Llama.from_pretrained(path, dtype=torch.float32, max_seq_len=64)
    want = model.generate(torch.tensor([[9, 1, 2, 8, 7]]), 3)[0, 5:].tolist()
    assert f"new tokens ({len(want)}): {want}" in out
    # the argument checks come before any set-up: in this process
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    assert cli.main(["generate", "--model", str(folder), "--prompt", "w1", "--chat"]) == 2
    assert "--chat needs a chat template in" in capsys.readouterr().err
    assert cli.main(["generate", "--model", str(folder), "--prompt-ids", "1", "--chat"]) == 2
    assert "--chat takes --prompt (text), not --prompt-ids" in capsys.readouterr().err


def test_generate_clear_messages(tiny, tmp_path, monkeypatch, capsys):
    from xelink import cli

    path = tiny[0]
    # The argument checks come before any set-up: run in this process (exit status 2, the reason on stderr).
    assert cli.main(["generate", "--model", str(path), "--prompt", "hello"]) == 2
    assert "--prompt needs" in (err := capsys.readouterr().err) and "tokenizer.json; this folder has none" in err
    # tokenizer.json present but the tokenizers package missing (an import that fails).
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    assert cli.main(["generate", "--model", str(folder), "--prompt", "hello"]) == 2
    assert "--prompt needs the `tokenizers` package" in capsys.readouterr().err
    assert cli.main(["generate", "--model", str(path), "--prompt-ids", "1,x"]) == 2
    assert "--prompt-ids '1,x' must be comma-separated token ids" in capsys.readouterr().err
    # The model's checks, before any work, on every rank; rank 0 says why.
    r = _run("--model", str(path), "--prompt-ids", "1,2,3,4", "--max-new-tokens", "8", "--max-seq-len", "6", n=2)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("xelink generate: Llama.generate: 4 prompt tokens + max_new_tokens=8 exceed "
                          "max_seq_len=6") == 1
    r = _run("--model", str(path), "--prompt-ids", "1,2", "--tp", "3", n=2)
    assert r.returncode == 2 and "--tp 3 x --cp 1 does not tile 2 rank(s)" in r.stderr

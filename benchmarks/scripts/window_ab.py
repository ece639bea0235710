"""What a sliding window saves (``window=``): the windowed kernels read only the window's keys.

    python3 benchmarks/scripts/window_ab.py

Decode (``decode_attention``, B = 1, 32 / 8 heads of 128, bf16, one token): a 32K cache with a 4096-key window
against the same cache without one and against a 4K cache (the floor the window should reach); 8 layers' caches
replayed in one CUDA graph (more than L2), us a call. The fused decode step (``rope_decode_attention``) at position
32767 over a 32K cache with the window against a ring of 4096 rows (``ring=True``: the model's windowed caches).
Prefill (``flash_attention``, causal, S = 8192 / 16384, the portable kernel and ``impl="cuda"``: the Gluon kernel
with a window and without): a 4096-key window against full causal attention, ms a call. Training (forward and
backward through autograd, ``impl="auto"``, S = 4096 / 8192, 32 / 8 heads of 128): a 1024- / 4096-key window against
full causal attention and against SDPA's full causal (cuDNN or flash), ms a step. Outputs checked against the
references first. (a GPU script: CUDA, NVIDIA's Triton.)
"""
import statistics

import torch

from xelink.bench.harness import time_cuda_events
from xelink.bench.kernel_timing import cuda_graph
from xelink.kernels import attention as A

LAYERS = 8


def _time(fn, rounds=5, iters=10):
    return statistics.median(t for _ in range(rounds) for t in time_cuda_events(fn, warmup=2, iters=iters))


def decode_rows(gen):
    q = torch.randn(1, 32, 1, 128, device="cuda", generator=gen).bfloat16()
    rows = {}
    for name, smax, window in (("cache 4K", 4096, None), ("cache 32K", 32768, None),
                               ("cache 32K, window 4096", 32768, 4096)):
        caches = [(torch.randn(1, 8, smax, 128, device="cuda", generator=gen).bfloat16(),
                   torch.randn(1, 8, smax, 128, device="cuda", generator=gen).bfloat16()) for _ in range(LAYERS)]
        lens = torch.tensor([smax], device="cuda")
        k, v = caches[0]
        got = A.decode_attention(q, k, v, lens, window=window)
        want = A.reference_decode_attention(q, k, v, lens, window=window)
        err = float((got.float() - want.float()).norm() / want.float().norm())
        g = cuda_graph([lambda k=k, v=v: A.decode_attention(q, k, v, lens, window=window) for k, v in caches], 1)[0]
        rows[name] = (_time(g.replay) / LAYERS * 1e6, err)
    return rows


def ring_rows(gen):
    """The fused decode step (``rope_decode_attention``) of a 4096-key window at position 32767: over a 32K cache
    with ``window=4096``, and over a ring of 4096 rows (``ring=True``: the model's cache of a windowed layer)."""
    q, kn, vn = (torch.randn(1, h, 1, 128, device="cuda", generator=gen).bfloat16() for h in (32, 8, 8))
    cos, sin = (torch.randn(32768, 128, device="cuda", generator=gen) for _ in range(2))
    lens = torch.tensor([32768], device="cuda")
    rows = {}
    for name, smax, kw in (("32K cache, window 4096", 32768, dict(window=4096)),
                           ("ring of 4096 rows", 4096, dict(ring=True))):
        caches = [tuple(torch.randn(1, 8, smax, 128, device="cuda", generator=gen).bfloat16() for _ in range(2))
                  for _ in range(LAYERS)]
        k, v = caches[0]
        got = A.rope_decode_attention(q, kn, vn, cos, sin, k.clone(), v.clone(), lens, **kw)
        want = A.reference_rope_decode_attention(q, kn, vn, cos, sin, k.clone(), v.clone(), lens, **kw)
        err = float((got.float() - want.float()).norm() / want.float().norm())
        g = cuda_graph([lambda k=k, v=v: A.rope_decode_attention(q, kn, vn, cos, sin, k, v, lens, **kw)
                        for k, v in caches], 1)[0]
        rows[name] = (_time(g.replay) / LAYERS * 1e6, err, 2 * caches[0][0].nbytes)
    return rows


def prefill_rows(gen):
    rows = {}
    for S in (8192, 16384):
        q, k, v = (torch.randn(1, h, S, 128, device="cuda", generator=gen).bfloat16() for h in (32, 8, 8))
        for impl in ("triton", "cuda"):
            for window in (None, 4096):
                got = A.flash_attention(q, k, v, causal=True, impl=impl, window=window)
                want = A.reference_flash_attention(q[:, :, -256:], k, v, causal=True, window=window)
                err = float((got[:, :, -256:].float() - want.float()).norm() / want.float().norm())
                ms = _time(lambda: A.flash_attention(q, k, v, causal=True, impl=impl, window=window), 3, 5) * 1e3
                rows[f"impl={impl}, S={S}, {'window 4096' if window else 'full causal'}"] = (ms, err)
    return rows


def train_rows(gen):
    import torch.nn.functional as F

    rows = {}
    for S, window in ((4096, 1024), (8192, 4096)):
        q, k, v = (torch.randn(1, h, S, 128, device="cuda", generator=gen).bfloat16().requires_grad_()
                   for h in (32, 8, 8))
        dout = torch.randn(1, 32, S, 128, device="cuda", generator=gen).bfloat16()
        calls = {f"window {window}": lambda w=window: A.flash_attention(q, k, v, causal=True, window=w),
                 "full causal": lambda: A.flash_attention(q, k, v, causal=True),
                 "SDPA full causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)}
        for name, call in calls.items():
            def step(call=call):
                torch.autograd.backward(call(), dout)
            ms = _time(step, 3, 5) * 1e3
            rows[f"S={S}, {name}"] = ms
    return rows


def main() -> int:
    print(torch.cuda.get_device_name(0), flush=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for name, (us, err) in decode_rows(gen).items():
        print(f"decode B=1 32/8 heads, {name}: {us:.2f} us a call (rel err vs reference {err:.1e})", flush=True)
    for name, (us, err, nbytes) in ring_rows(gen).items():
        print(f"rope decode B=1 32/8 heads, {name} ({nbytes / 2 ** 20:.0f} MiB a layer): {us:.2f} us a call "
              f"(rel err vs reference {err:.1e})", flush=True)
    for name, (ms, err) in prefill_rows(gen).items():
        print(f"prefill causal, {name}: {ms:.3f} ms (rel err of the last 256 rows {err:.1e})",
              flush=True)
    for name, ms in train_rows(gen).items():
        print(f"training step (forward + backward) B=1 32/8 heads of 128, {name}: {ms:.3f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a sliding window saves (``window=``): the windowed kernels read only the window's keys.

    python3 benchmarks/scripts/window_ab.py

Decode (``decode_attention``, B = 1, 32 / 8 heads of 128, bf16, one token): a 32K cache with a 4096-key window
against the same cache without one and against a 4K cache (the floor the window should reach); 8 layers' caches
replayed in one CUDA graph (more than L2), us a call. Prefill (``flash_attention``, causal, S = 8192 / 16384, the
portable kernel and ``impl="cuda"``: the TMA kernel with a window, the Gluon one without): a 4096-key window against
full causal attention, ms a call. Outputs checked
against the references first. (a GPU script: CUDA, NVIDIA's Triton.)
"""
import statistics

import torch

from xelink.bench.harness import time_cuda_events
from xelink.kernels import attention as A

LAYERS = 8


def _graph(calls):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            for c in calls:
                c()
    torch.cuda.current_stream().wait_stream(stream)
    return g


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
        g = _graph([lambda k=k, v=v: A.decode_attention(q, k, v, lens, window=window) for k, v in caches])
        rows[name] = (_time(g.replay) / LAYERS * 1e6, err)
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


def main() -> int:
    print(torch.cuda.get_device_name(0), flush=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for name, (us, err) in decode_rows(gen).items():
        print(f"decode B=1 32/8 heads, {name}: {us:.2f} us a call (rel err vs reference {err:.1e})", flush=True)
    for name, (ms, err) in prefill_rows(gen).items():
        print(f"prefill causal, {name}: {ms:.3f} ms (rel err of the last 256 rows {err:.1e})",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a training step's flash attention goes (one GPU, bf16, B=1, 32 heads, head dim 128, MHA): the forward with
grad, the forward without, the backward through autograd and ``flash_attention_backward`` called directly (CUDA events,
median of 20, and host microseconds a call), then torch.profiler's kernels of one forward + backward.

    python3 benchmarks/scripts/flash_grad_profile.py [S ...]   (default 1024 4096)
"""
import statistics
import sys
import time

import torch

from xelink.bench.harness import time_cuda_events
from xelink.kernels import flash_attention, flash_attention_backward


def _ms(fn) -> float:
    return statistics.median(time_cuda_events(fn, warmup=3, iters=20)) * 1e3


def _host_us(fn, n=20) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def main():
    print(torch.cuda.get_device_name(), flush=True)
    for S in [int(a) for a in sys.argv[1:]] or [1024, 4096]:
        g = torch.Generator(device="cuda").manual_seed(S)
        q, k, v = (torch.randn(1, 32, S, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = flash_attention(q, k, v, return_lse=True)
        dout = torch.randn_like(out)
        held = {}

        def fwd_grad():
            held["out"] = flash_attention(*leaves)

        def bwd():
            held["out"].backward(dout, retain_graph=True)

        fwd_grad()
        cases = {"forward, no grad": lambda: flash_attention(q, k, v), "forward with grad": fwd_grad,
                 "backward (autograd)": bwd,
                 "flash_attention_backward": lambda: flash_attention_backward(dout, q, k, v, out, lse),
                 "forward + backward": lambda: flash_attention(*leaves).backward(dout)}
        for name, fn in cases.items():
            print(f"S={S} {name}: {_ms(fn):.3f} ms GPU, {_host_us(fn):.1f} us host a call", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                flash_attention(*leaves).backward(dout)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18), flush=True)


if __name__ == "__main__":
    main()

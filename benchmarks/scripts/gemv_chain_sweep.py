"""The bf16 one-row GEMV's tiles as the decode step calls it (issue 26): for each of Llama-3.1-8B's projection
shapes (N x K), 32 calls over 32 layers' own weights (the weights stream from HBM) with PDL as in the step,
captured in one CUDA graph; us a call and GB/s for the kept configuration (``_gemv_config``) and each
candidate of ``CONFIGS``; every output checked against the kept one's.

python3 benchmarks/scripts/gemv_chain_sweep.py
"""
import statistics

import torch

from xelink.bench.harness import time_cuda_events
from xelink.bench.kernel_timing import cuda_graph
from xelink.kernels import gemv

LAYERS = 32
SHAPES = [(6144, 4096, "qkv"), (4096, 4096, "o"), (4096, 14336, "down")]
CONFIGS = [dict(KERNEL="fma", BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=nw, num_stages=ns)
           for bn, bk, nw in [(2, 1024, 4), (4, 1024, 4), (2, 512, 2), (4, 512, 2), (8, 512, 2), (1, 1024, 4)]
           for sk in (1, 2) for ns in (1, 3)]


def main():
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(5)
    print(torch.cuda.get_device_name(0), flush=True)
    for n, k, name in SHAPES:
        ws = [(torch.randn(n, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16) for _ in range(LAYERS)]
        x = torch.randn(1, k, device=dev, generator=gen).to(torch.bfloat16)
        want = gemv(ws[0], x, None, "bf16", "cuda")
        rows = []
        for cfg in [None] + CONFIGS:
            try:
                got = gemv(ws[0], x, None, "bf16", "cuda", config=cfg)
                err = float((got.float() - want.float()).norm() / want.float().norm())
                graph, _, _ = cuda_graph([lambda w=w: gemv(w, x, None, "bf16", "cuda", config=cfg) for w in ws], 1)
                us = statistics.median(time_cuda_events(graph.replay, warmup=3, iters=20)) * 1e6 / LAYERS
                del graph
            except Exception as e:  # noqa: BLE001 - a config that does not compile is a row, not the end
                print(f"{name} {n}x{k} {cfg}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
                continue
            rows.append((us, cfg))
            print(f"{name} {n}x{k} {'kept' if cfg is None else cfg}: {us:6.2f} us a call "
                  f"({n * k * 2 / us / 1e3:6.0f} GB/s), rel diff {err:.1e}", flush=True)
        best = min(rows, key=lambda r: r[0])
        print(f"{name}: best {best[0]:.2f} us {best[1] or 'kept'} (kept {rows[0][0]:.2f})", flush=True)
        del ws


if __name__ == "__main__":
    main()

"""Flash attention backward on one GPU: the Triton kernel (``flash_attention_backward(impl="triton")``, the
backward of ``flash_attention`` and of ``cp_attention`` with grad) against SDPA's backward, and its tile
configurations.

1. Each configuration in ``CONFIGS`` against the reference (float32 torch ops) at a few shapes (GQA, causal,
   tails, the LSE's gradient): relative error of dq, dk, dv.
2. Time, at B=1, 32 q heads, head dim 128 (``--head-dim``: 64, 256), bf16, MHA non-causal and GQA 32/8 causal,
   S = 1024 / 4096 / 8192:
   the backward alone for each configuration (CUDA events, median of 10 after 3 warm-ups), and as a user
   calls it: forward + backward through autograd (``flash_attention`` with grad; SDPA with grad, its default
   backend), eager. TFLOP/s count 2.5 forward matmuls' worth for the backward (FlashAttention's convention:
   4 of the 5 backward matmuls plus the recomputed scores), causal halved.

    python3 benchmarks/scripts/flash_bwd_ab.py [--quick] [--head-dim 64|128|256]
"""
import argparse
import statistics

import torch
import torch.nn.functional as F

from xelink.bench.harness import time_cuda_events
from xelink.kernels import attention_bwd as AB
from xelink.kernels import flash_attention, flash_attention_backward, reference_flash_attention

# (dkdv tile, dq tile) pairs per head dim, each (BLOCK_M, BLOCK_N, warps, stages); the kept pair first. Offline (ptxas
# -v, sm_90a, Triton 3.6) the key-major dk/dv kernel runs its four dots as wgmma. Spills (bytes a thread): head dim
# 128 dkdv 16 x 128 none, 32 x 64 and 32 x 128 24, 64 x 128 224 (the fastest on the H100 all the same), dq 128 x 32
# none; head dim 64 dkdv 64 x 128 and dq 128 x 64 none; head dim 256 dkdv 32 x 32 none, 16 x 64 216, 32 x 64 336,
# dq 32 x 32 none, 64 x 32 84.
CONFIGS = {64: [((64, 128, 8, 2), (128, 64, 8, 2)), ((32, 64, 8, 2), (64, 64, 8, 2)),
                ((32, 128, 8, 2), (128, 32, 8, 2)), ((64, 64, 8, 2), (64, 64, 8, 2))],
           128: [((64, 128, 8, 2), (128, 32, 8, 2)), ((32, 64, 8, 2), (64, 32, 8, 2)),
                 ((16, 128, 8, 2), (128, 32, 8, 2)), ((32, 128, 8, 2), (128, 32, 8, 2)),
                 ((64, 64, 8, 2), (64, 64, 8, 2))],
           256: [((32, 32, 4, 1), (32, 32, 4, 1)), ((32, 32, 8, 1), (32, 32, 8, 1)), ((16, 64, 8, 1), (32, 32, 8, 1)),
                 ((16, 32, 4, 1), (32, 32, 4, 1))]}


def _use(config, D) -> None:
    AB.BWD_CONFIGS[D] = {"dkdv": config[0], "dq": config[1]}


CHECKS = [(1, 4, 4, 300, 300, False), (2, 8, 2, 257, 513, True), (1, 8, 2, 1000, 1000, True)]


def _inputs(B, H, HKV, SQ, SK, D, dt=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, h, s, D, device="cuda", dtype=dt, generator=g) for h, s in ((H, SQ), (HKV, SK), (HKV, SK))]


def check(config, D) -> int:
    bad = 0
    _use(config, D)
    for B, H, HKV, SQ, SK, causal in CHECKS:
        q, k, v = _inputs(B, H, HKV, SQ, SK, D, seed=SQ)
        out, lse = reference_flash_attention(q, k, v, causal=causal, return_lse=True)
        dout, dlse = torch.randn_like(out), torch.randn_like(lse)
        got = flash_attention_backward(dout, q, k, v, out, lse, causal=causal, dlse=dlse, impl="triton")
        want = flash_attention_backward(dout, q, k, v, out, lse, causal=causal, dlse=dlse, impl="reference")
        errs = [float((a - b).norm() / b.norm()) for a, b in zip(got, want)]
        ok = max(errs) < 1.5e-2 and all(bool(torch.isfinite(a).all()) for a in got)
        bad += not ok
        print(f"check D={D} {config} B={B} H={H}/{HKV} Sq={SQ} Sk={SK} causal={causal}: rel err dq/dk/dv "
              f"{' '.join(f'{e:.1e}' for e in errs)} {'ok' if ok else 'WRONG'}", flush=True)
    return bad


def _ms(fn, iters=10) -> float:
    return statistics.median(time_cuda_events(fn, warmup=3, iters=iters)) * 1e3


def _tflops(S, H, D, causal, ms, factor) -> float:
    flops = factor * 4 * S * S * H * D * (0.5 if causal else 1.0)
    return flops / (ms * 1e-3) / 1e12


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--head-dim", type=int, default=128, choices=sorted(CONFIGS))
    args = p.parse_args()
    D = args.head_dim
    print(torch.cuda.get_device_name(), torch.__version__, f"head dim {D}", flush=True)
    kept = AB.BWD_CONFIGS[D]
    bad = sum(check(c, D) for c in CONFIGS[D])
    AB.BWD_CONFIGS[D] = kept
    lengths = (1024, 4096) if args.quick else (1024, 4096, 8192)
    print("\n| case | S | (dkdv, dq) tiles | backward ms | TFLOP/s |\n|---|---|---|---|---|")
    rows = []
    for causal, hkv in ((False, 32), (True, 8)):
        for S in lengths:
            q, k, v = _inputs(1, 32, hkv, S, S, D, seed=S)
            out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
            dout = torch.randn_like(out)
            for config in CONFIGS[D]:
                _use(config, D)
                ms = _ms(lambda: flash_attention_backward(dout, q, k, v, out, lse, causal=causal, impl="triton"))
                print(f"| {'GQA 32/8 causal' if causal else 'MHA'} | {S} | {config} | {ms:.3f} | "
                      f"{_tflops(S, 32, D, causal, ms, 2.5):.0f} |", flush=True)
            AB.BWD_CONFIGS[D] = kept
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            ours = _ms(lambda: flash_attention(*leaves, causal=causal).backward(dout))
            sdpa = _ms(lambda: F.scaled_dot_product_attention(*leaves, is_causal=causal,
                                                               enable_gqa=hkv != 32).backward(dout))
            rows.append((causal, S, ours, sdpa))
    print("\n| case | S | xelink fwd+bwd ms | SDPA fwd+bwd ms | xelink / SDPA speed |\n|---|---|---|---|---|")
    for causal, S, ours, sdpa in rows:
        print(f"| {'GQA 32/8 causal' if causal else 'MHA'} | {S} | {ours:.3f} | {sdpa:.3f} | {sdpa / ours:.2f}x |")
    print(f"\nwrong: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

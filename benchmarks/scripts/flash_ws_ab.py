"""A/B on one Hopper GPU (issue 23): the warp-specialized flash-attention kernel (``flash_ws.py``) against the
TMA Triton kernel (``impl="cuda"`` with its tile table as ``config``) and SDPA's default dispatch (cuDNN on an H200); the
public ``flash_attention(impl="cuda")`` (which takes the warp-specialized kernel where it applies) too.

First the kernel's outputs and LSE against ``reference_flash_attention`` (float32) over a grid of shapes (GQA,
causal with Sq < Sk and Sq > Sk, Sq not a multiple of 128, head dim 64 and 128, bf16 and fp16), then time a call
(CUDA graph of back-to-back calls, CUDA events, median of 5) at B=1, 32 query heads, head dim 128, MHA
non-causal and GQA 32/8 causal, S = 1024 / 2048 / 8192 / 32768, each ``flash_ws`` configuration (BLOCK_N,
STAGES) in ``CONFIGS``. TFLOP/s count the causal half only.

    python3 benchmarks/scripts/flash_ws_ab.py [--quick]
"""
import argparse
import statistics

import torch
import torch.nn.functional as F

from xelink.bench.harness import time_cuda_events
from xelink.bench.kernel_timing import cuda_graph
from xelink.kernels import attention as A
from xelink.kernels import flash_ws as W

CONFIGS = [(128, 2), (64, 3), (64, 2)]
CHECKS = [  # (B, H, HKV, SQ, SK, D, causal, dtype)
    (1, 4, 4, 128, 128, 128, False, torch.bfloat16),
    (2, 8, 2, 300, 512, 128, True, torch.bfloat16),
    (1, 4, 1, 1000, 1024, 64, True, torch.float16),
    (1, 2, 2, 256, 2048, 128, False, torch.float16),
    (2, 4, 4, 640, 512, 128, True, torch.bfloat16),
    (1, 8, 2, 2048, 2048, 64, False, torch.bfloat16),
    (1, 32, 8, 4096, 4096, 128, True, torch.bfloat16),
]


def check(config, head_dim=None):
    """The kernel at ``config`` against the reference over CHECKS (every case at ``head_dim`` if given)."""
    bad = 0
    for B, H, HKV, SQ, SK, D, causal, dt in CHECKS:
        D = head_dim or D
        if SK % config[0]:
            continue
        g = torch.Generator(device="cuda").manual_seed(SQ + SK + D)
        q = torch.randn(B, H, SQ, D, device="cuda", dtype=dt, generator=g)
        k = torch.randn(B, HKV, SK, D, device="cuda", dtype=dt, generator=g)
        v = torch.randn(B, HKV, SK, D, device="cuda", dtype=dt, generator=g)
        out = torch.full_like(q, float("nan"))
        lse = torch.full((B, H, SQ), float("nan"), device="cuda")
        W.ws_flash_forward(q, k, v, out, lse, causal, D ** -0.5 * 1.4426950408889634, config)
        ref, ref_lse = A.reference_flash_attention(q, k, v, causal=causal, return_lse=True)
        err = float((out.float() - ref.float()).norm() / ref.float().norm())
        fin = torch.isfinite(ref_lse)
        lerr = float((lse[fin] - ref_lse[fin]).abs().max()) if fin.any() else 0.0
        ok = err < 1e-2 and lerr < 2e-3 and torch.equal(torch.isfinite(lse), fin) and not out.isnan().any()
        bad += not ok
        print(f"check {config} B={B} H={H}/{HKV} Sq={SQ} Sk={SK} D={D} causal={causal} {dt}: rel err {err:.1e}, "
              f"lse err {lerr:.1e} {'ok' if ok else 'WRONG'}", flush=True)
    return bad


def graph_us(fn, calls):
    """us a call: a CUDA graph of ``calls`` back-to-back calls, median of 5 replays (CUDA events)."""
    graph, _, _ = cuda_graph([fn], calls)
    return statistics.median(time_cuda_events(graph.replay, warmup=1, iters=5)) * 1e6 / calls


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="S = 8192 only")
    p.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 256), help="timed head dim (default 128)")
    args = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    D = args.head_dim
    configs = CONFIGS if D == 128 else [W.WS_CONFIGS[D]]
    bad = sum(check(c, None if D == 128 else D) for c in configs)
    print(f"checks: {bad} wrong", flush=True)
    seqs = [8192] if args.quick else [1024, 2048, 8192, 32768]
    for causal, hkv in ((False, 32), (True, 8)):
        for S in seqs:
            H = 32
            q = torch.randn(1, H, S, D, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, hkv, S, D, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(1, hkv, S, D, device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(q)
            lse = torch.empty(1, H, S, device="cuda")
            flops = 4 * S * S * D * H * (0.5 if causal else 1.0)
            calls = max(2, min(20, int(2e13 / flops)))
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            rows = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True),
                    "xelink cuda (TMA)": lambda: A._flash_forward(q, k, v, causal, D ** -0.5, "cuda",
                                                                  A._fwd_config("cuda", D), out=out),
                    "xelink cuda (public)": lambda: A.flash_attention(q, k, v, causal=causal, impl="cuda", out=out)}
            for c in configs:
                rows[f"xelink ws {c}"] = (lambda c=c: W.ws_flash_forward(q, k, v, out, lse, causal,
                                                                         D ** -0.5 * 1.4426950408889634, c))
            base = None
            for name, fn in rows.items():
                fn()
                torch.cuda.synchronize()
                got = out if name != "sdpa" else ref
                err = float((got.float() - ref.float()).norm() / ref.float().norm())
                us = graph_us(fn, calls)
                base = base or us
                print(f"S={S:6d} {'GQA 32/8 causal' if causal else 'MHA non-causal'} {name:22s}: {us:9.1f} us "
                      f"{flops / us / 1e6:6.1f} TFLOP/s  x SDPA {base / us:5.3f}  rel err vs SDPA {err:.1e}",
                      flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

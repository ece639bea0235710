"""Quantized projections past gemv's 8 rows: ``qgemm`` (the dequantization in the GEMM's tiles) against what the
model ran before it (the weight dequantized to a 16-bit copy, then ``gemm``), a dense bf16 ``gemm`` of the same
shape (the same FLOPs, 4x / 2x the weight bytes) and ``torch.matmul``; Llama-3.1-8B's projections, M rows of
activations (decode batches past 8, prefills), bf16, ms a call (CUDA events, median). Each qgemm output is
checked against ``reference_gemv`` first. Then overrides of qgemm's tiles, K split and unpacking at M = 16 and
1024 (qkv, gate_up, down), and a W4A16 Llama-3.1-8B prefill of 512 tokens and a batch-16 decode step (CUDA graph)
through the model.

    python3 benchmarks/scripts/qgemm_ab.py [--fmts w4a16 w8a16 w4a16t] [--rows 16 64 256 1024] [--no-model] [--no-overrides]

(``w4a16t``: the W4A16 weights in tiles, ``tile_w4a16``, as the model loads them on CUDA.)

(a GPU script: CUDA, NVIDIA's Triton.)
"""
import argparse
import statistics

import torch

from xelink.bench.harness import time_cuda_events
from xelink.kernels import (gemm, pack_w4a16, pack_w8a16, qgemm, reference_gemv, tile_w4a16, unpack_w4a16, unpack_w8a16,
                            untile_w4a16)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# overrides of the default tiles (qgemm's config=), by rows of x
TILES = {16: [dict(UNPACK=1), dict(SPLIT_K=1), dict(SPLIT_K=2), dict(SPLIT_K=4), dict(SPLIT_K=8), dict(BLOCK_N=64),
              dict(num_stages=4)],
         1024: [dict(UNPACK=1), dict(BLOCK_M=64, num_warps=4), dict(BLOCK_N=256), dict(num_stages=4),
                dict(BLOCK_N=64)]}


def _pack(fmt, w):
    """(q, scales) of ``w`` in ``fmt``, and the exact float32 weight's function of them."""
    if fmt == "w8a16":
        return (*pack_w8a16(w, torch.bfloat16), unpack_w8a16)
    q, s = pack_w4a16(w, torch.bfloat16)
    if fmt == "w4a16t":
        return tile_w4a16(q), s, lambda q, s: unpack_w4a16(untile_w4a16(q), s)
    return q, s, unpack_w4a16


def _ms(fn):
    return statistics.median(t for _ in range(3) for t in time_cuda_events(fn, warmup=2, iters=10)) * 1e3


def kernel_rows(fmts, rows):
    gen = torch.Generator(device="cuda").manual_seed(1)
    for fmt in fmts:
        for name, (n, k) in SHAPES.items():
            dense = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
            q, s, unpack = _pack(fmt, dense)
            for m in rows:
                x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
                y, ref = qgemm(q, x, s, fmt), reference_gemv(q, x, s, fmt)
                err = float((y.float() - ref.float()).norm() / ref.float().norm())
                assert err < 8e-3, (fmt, name, m, err)
                t = dict(qgemm=_ms(lambda: qgemm(q, x, s, fmt)),
                         before=_ms(lambda: gemm(x, unpack(q, s).to(x.dtype).t())),
                         dense=_ms(lambda: gemm(x, dense.t())), torch=_ms(lambda: torch.matmul(x, dense.t())))
                print(f"{fmt} {name:7s} N={n:5d} K={k:5d} M={m:5d}: qgemm {t['qgemm']:.4f} ms (err {err:.1e}), "
                      f"dequant+gemm (before) {t['before']:.4f} = {t['before'] / t['qgemm']:.2f}x, dense bf16 gemm "
                      f"{t['dense']:.4f} ({t['dense'] / t['qgemm']:.2f}x), torch.matmul {t['torch']:.4f} "
                      f"({t['torch'] / t['qgemm']:.2f}x)", flush=True)


def tile_rows(fmt):
    gen = torch.Generator(device="cuda").manual_seed(2)
    for name in ("qkv", "gate_up", "down"):
        n, k = SHAPES[name]
        q, s, _ = _pack(fmt, torch.randn(n, k, device="cuda", generator=gen))
        for m, overrides in TILES.items():
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            ref = reference_gemv(q, x, s, fmt).float()
            line = []
            for cfg in [None] + overrides:
                try:
                    y = qgemm(q, x, s, fmt, config=cfg)
                    assert float((y.float() - ref).norm() / ref.norm()) < 8e-3
                    line.append(f"{cfg or 'default'} {_ms(lambda: qgemm(q, x, s, fmt, config=cfg)):.4f}")
                except Exception as e:  # noqa: BLE001 - a tile the GPU cannot take (shared memory): reported
                    line.append(f"{cfg} failed ({type(e).__name__})")
            print(f"{fmt} {name} M={m} ms: " + ", ".join(line), flush=True)


def model_rows():
    from xelink.models import Llama

    model = Llama.random("llama-3.1-8b", weights="w4a16", impl="xelink", device=torch.device("cuda", 0),
                         max_batch=16, max_seq_len=1024)
    ids = torch.randint(0, 1000, (1, 512), generator=torch.Generator().manual_seed(0))
    print(f"W4A16 Llama-3.1-8B prefill of 512 tokens: {_ms(lambda: model(ids, 0, logits_to_keep=1)):.2f} ms",
          flush=True)
    model(torch.randint(0, 1000, (16, 64), generator=torch.Generator().manual_seed(1)), 0)
    graph = model.decode_graph(16)
    tok, pos = torch.zeros(16, dtype=torch.int64, device="cuda"), torch.full((16,), 64, device="cuda")
    print(f"W4A16 Llama-3.1-8B decode step, batch 16 (CUDA graph): {_ms(lambda: graph.step(tok, pos)):.3f} ms",
          flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fmts", nargs="+", default=["w4a16", "w8a16"])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--no-model", action="store_true")
    ap.add_argument("--no-overrides", action="store_true", help="leave out the tile overrides' rows")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(0), flush=True)
    kernel_rows(args.fmts, args.rows)
    for fmt in [] if args.no_overrides else args.fmts:
        tile_rows(fmt)
    if not args.no_model:
        model_rows()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

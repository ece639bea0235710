"""Issue 22's one-GPU targets: ``gated_gemm`` (the fused distributed GEMM's kernel) with every flag set and
with copy-engine arrivals (8 chunks of rows; the TMA kernel also with 8 column slices of every row,
``k_slices=8``), against torch.matmul, in CUDA graphs (``xelink.bench.families.gemm.run_gated``).

    python3 benchmarks/scripts/gated_gemm_bench.py [--quick] [--tiles] [--jsonl FILE]

``--tiles``: the TMA kernel also with smaller tiles (128x128, 64x256 of 4 warps), where at small M a chunk's rows
feed fewer tiles than a wave has programs (issue 22: 0.834 of flags set with arrivals at 2048x4096x4096).
"""

import argparse
import json

import torch

from xelink.bench.families.gemm import ROW_BLOCK_SHAPES, run_gated
from xelink.bench.kernel_timing import KernelReport


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="2048x4096x4096 only, 2 rounds")
    p.add_argument("--tiles", action="store_true", help="also smaller TMA tiles (128x128, 64x256)")
    p.add_argument("--jsonl", default=None)
    args = p.parse_args()
    report = KernelReport()
    shapes = ROW_BLOCK_SHAPES[2:] if args.quick else ROW_BLOCK_SHAPES
    tiles = [dict(BLOCK_M=128, BLOCK_N=128, num_stages=4), dict(BLOCK_M=64, BLOCK_N=256, num_warps=4, num_stages=4)]
    run_gated(report, shapes, rounds=2 if args.quick else 3, tiles=tiles if args.tiles else ())
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; ratio = torch.matmul time / time; "
          "CUDA graphs of 5 calls, CUDA events")
    print(f"{'shape':>16} {'path':<46} {'time(us)':>10} {'TFLOP/s':>8} {'ratio':>6} {'vs set':>7} {'#wrong':>6}")
    for r in report.rows:
        vs = r.extra.get("vs_flags_set")
        print(f"{r.extra['shape']:>16} {r.path:<46} {r.time_us:10.1f} {r.extra['TFLOPs']:8.1f} "
              f"{(r.ratio or 1.0):6.3f} {'' if vs is None else f'{vs:7.3f}':>7} {r.wrong:6d}")
    for n in report.notes:
        print("note:", n)
    if args.jsonl:
        with open(args.jsonl, "w") as f:
            for r in report.rows:
                f.write(json.dumps({"op": r.op, "path": r.path, "time_us": r.time_us, "ratio": r.ratio,
                                    "wrong": r.wrong, **{k: v for k, v in r.extra.items()
                                                         if isinstance(v, (int, float, str))}}) + "\n")


if __name__ == "__main__":
    main()

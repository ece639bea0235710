"""Whether Triton's software pipeliner keeps the gated GEMM's TMA loads in flight with column slices, without a GPU
(issue 22): NVIDIA Triton 3.6 compiles ``_gated_gemm_tma_kernel`` for ``GPUTarget("cuda", 90, 32)`` with whole
chunks (``SLICES=1``, the kernel measured on H200s) and with column slices (each load waits for its slice first),
and ``ptxas -v`` reports registers. A pipelined K loop issues its first stages' TMA copies before the loop (2 loads
a stage: 6 copies at 3 stages); an unpipelined one has 2 (load, wait, math: the waits' first attempt, a
Triton-level poll loop inside the K loop, compiled that way).

    PYTHONPATH=$PWD python3 benchmarks/scripts/sm90_gated_pipeline.py

(needs NVIDIA's Triton 3.6, e.g. the GPU image's, or a CPU venv with ``triton==3.6.0``; no GPU.)
"""
import importlib
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sm90_registers import ptxas_report  # noqa: E402

G = importlib.import_module("xelink.kernels.gated_gemm")  # (xelink.kernels.gated_gemm is also the function)


def compile_tma(slices: int, a_row: bool = True, b_row: bool = True, stages: int = 3, cross: int = 1):
    """(TMA copies in the TTGIR, wgmma ops, registers a thread) of the kernel at the 128x256x64 tile."""
    fn = G._gated_gemm_tma_kernel
    const = dict(A_ROW_MAJOR=a_row, B_ROW_MAJOR=b_row, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8,
                 NUM_PROGRAMS=131, TIMER=True, SLICES=slices, CROSS=cross)
    descs = {"a_desc": "[128, 64]" if a_row else "[64, 128]", "b_desc": "[64, 256]" if b_row else "[256, 64]",
             "c_desc": "[128, 256]"}
    sig = {}
    for name in fn.arg_names:
        if name in const:
            sig[name] = "constexpr"
        elif name in descs:
            sig[name] = f"tensordesc<bf16{descs[name]}>"
        elif name in ("flags", "order", "err"):
            sig[name] = "*i32"
        else:
            sig[name] = "i64" if name == "timeout_ns" else "i32"
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=stages))
    ttgir = kernel.asm["ttgir"]
    regs = int(ptxas_report(kernel).split("Used ")[1].split(" registers")[0])
    return ttgir.count("async_tma_copy_global_to_local"), ttgir.count("warp_group_dot "), regs


def main() -> int:
    print(f"triton {triton.__version__}, sm_90a, 128x256x64 tiles, 8 warps, 3 stages")
    bad = 0
    for slices, a_row, b_row, cross in ((1, True, True, 1), (8, True, True, 1), (8, False, False, 1),
                                        (24, True, False, 2), (1000, True, True, 0)):
        copies, dots, regs = compile_tma(slices, a_row, b_row, cross=cross)
        ok = copies == 6
        bad += not ok
        orient = f"a {'row' if a_row else 'col'}-major, b {'row' if b_row else 'col'}-major"
        print(f"SLICES={slices:<4} CROSS={cross} {orient}: {copies} TMA copies, {dots} wgmma, {regs} registers: {'pipelined' if ok else 'NOT pipelined'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Registers and spills of the flash-attention backward kernels on sm_90a, without a GPU: NVIDIA Triton 3.6
compiles each (head dim, pass, tile) for ``GPUTarget("cuda", 90, 32)`` and its bundled ``ptxas -v`` reports
registers a thread and spill bytes (bf16, causal). This is how ``attention_bwd.BWD_CONFIGS`` was chosen before
any GPU timing: the largest tiles without spills (the H100 A/B of the key-major dk/dv kernel later chose 64 x 128 at
head dim 128 despite its spills: `flash_bwd_ab.py`).

    PYTHONPATH=$PWD python3 benchmarks/scripts/sm90_registers.py [--grid]

(needs NVIDIA's Triton 3.6, e.g. the GPU image's, or a CPU venv with ``triton==3.6.0``; no GPU.)
"""
import argparse
import itertools
import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia import compiler as nvidia
from triton.compiler import ASTSource

from xelink.kernels import attention_bwd as AB

_CONST = ("HEAD_DIM", "BLOCK_M", "BLOCK_N", "CAUSAL", "WINDOWED")
_HALF = ("Q", "K", "V", "DO")
_FLOAT_PTRS = ("LSE", "DELTA", "DK", "DV", "DQ")


def _type(arg: str) -> str:
    if arg in _CONST:
        return "constexpr"
    if arg in _HALF:
        return "*bf16"
    if arg in _FLOAT_PTRS:
        return "*fp32"
    return "fp32" if arg in ("scale", "qk_scale") else "i32"


def probe(kind: str, head_dim: int, tile) -> tuple[int, int, int]:
    """(registers a thread, spill-store bytes, shared bytes) of pass ``kind`` at ``tile``."""
    fn = AB._dkdv_kernel if kind == "dkdv" else AB._dq_kernel
    block_m, block_n, warps, stages = tile
    values = {"HEAD_DIM": head_dim, "BLOCK_M": block_m, "BLOCK_N": block_n, "CAUSAL": True, "WINDOWED": False}
    src = ASTSource(fn=fn, signature={a: _type(a) for a in fn.arg_names},
                    constexprs={(fn.arg_names.index(a),): v for a, v in values.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    report = ptxas_report(kernel)
    regs = int(report.split("Used ")[1].split(" registers")[0])
    spill = int(report.split(" bytes spill stores")[0].rsplit(",", 1)[-1])
    return regs, spill, kernel.metadata.shared


def ptxas_report(kernel) -> str:
    """``ptxas -v``'s report (registers, spills) of a kernel Triton compiled for sm_90a, by Triton's bundled ptxas."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    ptxas = os.path.join(os.path.dirname(nvidia.__file__), "bin", "ptxas")
    report = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True,
                            text=True, check=True).stderr
    os.unlink(f.name)
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", action="store_true", help="every tile of 32/64/128 x 32/64/128 at 4 and 8 warps")
    args = p.parse_args()
    print(f"triton {triton.__version__}, sm_90a")
    for head_dim, kinds in AB.BWD_CONFIGS.items():
        for kind, tile in kinds.items():
            tiles = [tile]
            if args.grid:
                tiles += [(m, n, w, tile[3]) for m, n, w in itertools.product((32, 64, 128), (32, 64, 128), (4, 8))]
            for t in tiles:
                regs, spill, shared = probe(kind, head_dim, t)
                kept = " (kept)" if t == tile else ""
                print(f"head dim {head_dim} {kind} {t}{kept}: {regs} registers, {spill} B spilled, {shared} B shared")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

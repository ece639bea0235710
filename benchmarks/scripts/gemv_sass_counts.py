"""Instructions a byte of weight in the W4A16 GEMVs' main loops, on sm_90a, without a GPU: NVIDIA Triton 3.6
compiles the word kernel (``gemv._gemv_words_kernel``, the step's down GEMV: 8 rows, 512 columns a one-warp
program) and the tensor-core kernel (``gemv_tc._gemv_tc_kernel``, 4 warps, ``UNROLL`` / ``ROW_TILES`` as given;
gate_up's and o's tiles), its bundled ``nvdisasm`` prints the SASS, and the loop (the block a backward branch
closes) is counted by opcode. Per thread and iteration the word kernel reads 64 bytes of W, the tc kernel
16 bytes a row tile a step.

    PYTHONPATH=$PWD python3 benchmarks/scripts/gemv_sass_counts.py

(needs NVIDIA's Triton 3.6, e.g. a CPU venv with ``triton==3.6.0``; no GPU.)
"""
import collections
import importlib
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia import compiler as nvidia
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

G = importlib.import_module("xelink.kernels.gemv")
T = importlib.import_module("xelink.kernels.gemv_tc")
PTRS = {"w_ptr": "*u8", "x_ptr": "*bf16", "s_ptr": "*bf16", "y_ptr": "*bf16", "o_ptr": "*bf16", "cnt_ptr": "*i32"}
ALIGNED = ("stride_wn", "stride_xm", "stride_sn", "K")


def sass(source_cls, fn, consts: dict, warps: int) -> str:
    names = fn.arg_names
    sig = {a: "constexpr" if a in consts else PTRS.get(a, "i32") for a in names}
    aligned = [a for a in names if a in PTRS or a in ALIGNED]
    src = source_cls(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                     attrs={(names.index(a),): [["tt.divisibility", 16]] for a in aligned})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=1))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "nvdisasm")
    return subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout


def loop_mix(text: str) -> collections.Counter:
    """Opcodes of the largest loop: from a label to the last branch back to it."""
    lines = text.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    best = (0, 0)
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i and i - labels[m.group(1)] > best[1] - best[0]:
            best = (labels[m.group(1)], i)
    ops = collections.Counter()
    for line in lines[best[0] + 1:best[1] + 1]:
        m = re.match(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T] )?([A-Z0-9_]+)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def main():
    words = dict(FMT=2, PARTIAL=False, ROWS=1, PTX=True, BLOCK_N=8, BLOCK_K=512, PDL=0, ACT=False, PREFETCH=0,
                 PIECES=1, LIMIT=0)
    cases = [("words, 8 rows x 512 columns, 1 warp", ASTSource, G._gemv_words_kernel, words, 1, 64)]
    for unroll, tiles in ((1, 1), (4, 1)):
        tc = dict(FMT=2, EVEN=True, PARTIAL=False, UNROLL=unroll, BIASED=False, ROW_TILES=tiles, PDL=0, num_warps=4,
                  PREFETCH=0, LIMIT=0, PIPE=False, STAGES=0)
        cases.append((f"tc, UNROLL {unroll}, ROW_TILES {tiles}, 4 warps", GluonASTSource, T._gemv_tc_kernel, tc, 4,
                      16 * 2 * tiles * unroll))  # a thread: 16 bytes of each of its 2 rows a row tile a step
    for what, cls, fn, consts, warps, nbytes in cases:
        ops = loop_mix(sass(cls, fn, consts, warps))
        total = sum(ops.values())
        top = ", ".join(f"{op} {n}" for op, n in ops.most_common(8))
        print(f"{what}: {total} instructions a loop iteration for {nbytes} bytes of W a thread = "
              f"{total / nbytes:.1f} a byte ({top})")


if __name__ == "__main__":
    main()

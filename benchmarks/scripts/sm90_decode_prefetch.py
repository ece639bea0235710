"""Whether the decode split kernel's prefetch of the next kernel's weight compiles for sm_90a as meant, without a GPU
(issue 26): NVIDIA Triton 3.6 compiles ``_decode_split_kernel`` (head dim 128, GQA 4, with and without the fused
RoPE) for ``GPUTarget("cuda", 90, 32)`` with ``NEXT_PIECES`` 0 and 128; the PTX must hold no bulk L2 prefetch
without it and one a thread with it, behind the kernel's key loop (after its last ``cp.async`` wait) and under
the ``kv_len >= NEXT_MIN_KEYS`` branch, and ptxas must take it (registers reported).

    PYTHONPATH=$PWD python3 benchmarks/scripts/sm90_decode_prefetch.py

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

A = importlib.import_module("xelink.kernels.attention")
TYPES = {"KV_LENS": "*i64", "OP": "*fp32", "LSEP": "*fp32", "LSE_OUT": "*fp32", "COS": "*fp32", "SIN": "*fp32",
         "COUNTERS": "*i32", "qk_scale": "fp32"}
BF16 = ("Q", "K", "V", "OUT", "KN", "VN", "NXT")


def compile_split(rope: bool, next_pieces: int):
    fn = A._decode_split_kernel
    const = dict(HEAD_DIM=128, BLOCK_M=16, BLOCK_N=64, CAUSAL=False, MERGE_ROWS=4, UNROLL=16, MIN_CHUNK=64, PDL=0,
                 PREFETCH=0, PIECES=1, LIMIT=0, ROPE=rope, NEXT_PIECES=next_pieces, NEXT_MIN_KEYS=4096)
    sig = {n: "constexpr" if n in const else "*bf16" if n in BF16 else TYPES.get(n, "i32") for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3))


def main() -> int:
    print(f"triton {triton.__version__}, sm_90a, _decode_split_kernel head dim 128, 4 warps, 3 stages")
    bad = 0
    for rope in (False, True):
        for pieces in (0, 128):
            kernel = compile_split(rope, pieces)
            ptx = kernel.asm["ptx"]
            n = ptx.count("cp.async.bulk.prefetch.L2")
            after_loop = n == 0 or ptx.rfind("cp.async.wait_group") < ptx.find("cp.async.bulk.prefetch.L2")
            regs = ptxas_report(kernel).split("Used ")[1].split(" registers")[0]
            ok = (n == 0) if pieces == 0 else (n >= 1 and after_loop)
            bad += not ok
            print(f"ROPE={rope!s:<5} NEXT_PIECES={pieces:<3}: {n} bulk L2 prefetch(es) in the PTX"
                  f"{', after the key loop' if n and after_loop else ''}, {regs} registers: {'ok' if ok else 'WRONG'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

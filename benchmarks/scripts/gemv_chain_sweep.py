"""The one-row GEMV's tiles as the decode step calls it (issue 26): for each of Llama-3.1-8B's projection
shapes (N x K), 32 calls over 32 layers' own weights (the weights stream from HBM) with PDL (and, where the
kernel has it, the prefetch) as in the step, captured in one CUDA graph; us a call and GB/s of the bytes
stored (packed weights and scales for W4A16) for the kept configuration (``_gemv_config``) and each candidate;
every output checked against the kept one's.

python3 benchmarks/scripts/gemv_chain_sweep.py [bf16|w4a16|w4a16t|w4a16t-act|staged-bf16|staged-w4a16|kept-<fmt>
|cu-w4a16t|cu-w4a16t-act [:shape,...] ...]
(default bf16; e.g. w4a16:down; ``staged-*``: the kept configuration against the tensor-core kernel's
shared-memory stages, ``STAGES``; ``w4a16t``: the weights in tiles, ``tile_w4a16``; ``w4a16t-act``: gate_up
with act="silu_mul" on the tiles, the kept two launches against tiles that apply it in the kernel; ``kept-*``: the
kept configuration only)
"""
import importlib
import statistics
import sys

import torch

from xelink.bench.harness import time_cuda_events
from xelink.bench.kernel_timing import cuda_graph
from xelink.kernels import gemv
from xelink.kernels.gemv import pack_w4a16, tile_w4a16

LAYERS = 32
SHAPES = {"bf16": [(6144, 4096, "qkv"), (4096, 4096, "o"), (4096, 14336, "down")],
          "w4a16": [(6144, 4096, "qkv"), (4096, 4096, "o"), (28672, 4096, "gate_up"), (4096, 14336, "down")]}
CONFIGS = {
    "bf16": [dict(KERNEL="fma", BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=nw, num_stages=ns)
             for bn, bk, nw in [(2, 1024, 4), (4, 1024, 4), (2, 512, 2), (4, 512, 2), (8, 512, 2), (1, 1024, 4)]
             for sk in (1, 2) for ns in (1, 3)],
    # the tensor-core kernel: steps in flight a warp (UNROLL), the nibbles' bias removed by a constant mma instead of
    # a packed fma a pair (BIASED), a grid split; (PIPE and ROW_TILES=2 lost everywhere at 658a747:
    # gemv_chain_sweep_w4a16.log in benchmarks/results/h200-issue26)
    "w4a16": [dict(KERNEL="tc", ROW_TILES=1, num_warps=nw, UNROLL=un, BIASED=bi, SPLIT=sp)
              for nw, un, bi, sp in [(4, 1, False, 1), (4, 1, True, 1), (4, 2, False, 1), (4, 2, True, 1),
                                     (4, 4, False, 1), (4, 4, True, 1), (8, 2, False, 1), (8, 2, True, 1),
                                     (8, 1, True, 1), (2, 1, False, 1), (2, 2, False, 1), (2, 2, True, 1),
                                     (4, 1, False, 2), (4, 1, True, 2), (4, 2, True, 2)]]
    + [dict(KERNEL="words", BLOCK_N=8, BLOCK_K=bk, SPLIT_K=sk, num_warps=1, num_stages=1)
       for bk, sk in [(512, 2), (512, 4), (1024, 2)]]
    # the Triton mma kernel: its weights reach shared memory through cp.async over num_stages stages (checked
    # offline for sm90), bytes in flight without registers; never timed at one row in the step's chain
    + [dict(KERNEL="mma", BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=4, num_stages=ns, FOLD=fold)
       for bn, bk, sk, ns, fold in [(64, 512, 1, 3, False), (64, 256, 1, 4, False), (32, 256, 1, 4, False),
                                    (128, 256, 1, 3, False), (64, 512, 2, 3, False), (64, 512, 1, 3, True),
                                    (32, 512, 1, 3, True)]],
}
# The tensor-core kernel with its weights in flight in shared memory (cp.async, STAGES - 1 iterations ahead): warps,
# steps a warp an iteration, stages, grid split; those whose stages would pass 200 KB a program left out.
_STAGED = [(4, 1, 3, 1), (4, 1, 4, 1), (4, 1, 6, 1), (4, 2, 3, 1), (4, 2, 4, 1), (4, 2, 6, 1), (4, 4, 3, 1),
           (4, 4, 4, 1), (8, 1, 4, 1), (8, 2, 3, 1), (8, 2, 4, 1), (2, 2, 4, 1), (2, 4, 4, 1), (4, 2, 4, 2),
           (4, 1, 8, 1)]
# The weights in tiles of 16 rows x 128 columns ("w4a16t": a warp's step one contiguous 1 KB piece), read by the
# tensor-core kernel: row tiles, warps, steps a warp an iteration, grid split.
SHAPES["w4a16t"] = SHAPES["w4a16"]
CONFIGS["w4a16t"] = [dict(KERNEL="tc", ROW_TILES=rt, num_warps=nw, UNROLL=un, SPLIT=sp)
                     for rt, nw, un, sp in [(1, 4, 1, 1), (1, 4, 2, 1), (1, 4, 4, 1), (1, 8, 1, 1), (1, 8, 2, 1),
                                            (1, 8, 1, 2), (1, 8, 2, 2), (1, 4, 1, 2), (1, 4, 1, 4), (1, 2, 1, 1),
                                            (2, 4, 2, 1), (1, 8, 4, 1), (1, 4, 2, 2), (1, 4, 2, 4), (1, 8, 1, 4),
                                            (1, 16, 1, 1)]]
# gate_up with act="silu_mul" on the tiles: the kept configuration (gemv.TC_ACT_TILES: programs that pair (gate, up)
# row blocks and apply it at the store, one launch) against the GEMV's own tiles then silu_mul (the first: one row
# tile a program cannot pair whole blocks, two launches, as before) and other pairing tiles: row tiles, warps, steps
# a warp an iteration.
SHAPES["w4a16t-act"] = [(28672, 4096, "gate_up")]
CONFIGS["w4a16t-act"] = [dict(KERNEL="tc", ROW_TILES=rt, num_warps=nw, UNROLL=un, SPLIT=1)
                         for rt, nw, un in [(1, 4, 1), (2, 8, 1), (2, 4, 1)]]
# The CUDA C++ kernel on the tiles (gemv_cu, KERNEL="cu"): warps a program (splitting K), tiles a warp a batch, the
# batches in registers (PIPE: the next loaded during this one's math) or copied into shared memory over STAGES;
# "cu-w4a16t-act": gate_up with act="silu_mul" in that kernel against the kept two launches.
SHAPES["cu-w4a16t"], SHAPES["cu-w4a16t-act"] = SHAPES["w4a16t"], SHAPES["w4a16t-act"]
CONFIGS["cu-w4a16t"] = CONFIGS["cu-w4a16t-act"] = [
    dict(KERNEL="cu", num_warps=nw, UNROLL=un, PIPE=pi, STAGES=st)
    for nw, un, pi, st in [(8, 2, False, 3), (8, 4, False, 0), (8, 2, False, 0), (4, 4, False, 0), (8, 2, True, 0),
                           (16, 1, False, 0), (8, 1, False, 4), (8, 4, False, 2), (8, 4, False, 3), (4, 2, False, 4),
                           (4, 4, False, 3), (16, 1, False, 4), (16, 2, False, 3), (4, 8, False, 2), (8, 1, False, 6),
                           (2, 8, False, 3), (16, 2, False, 0), (4, 2, False, 0), (16, 2, True, 0)]]
for _fmt in ("bf16", "w4a16", "w4a16t"):
    SHAPES["kept-" + _fmt], CONFIGS["kept-" + _fmt] = SHAPES[_fmt], []
for _fmt, _row_kb in (("bf16", 4), ("w4a16", 1)):
    SHAPES["staged-" + _fmt] = SHAPES[_fmt]
    CONFIGS["staged-" + _fmt] = [dict(KERNEL="tc", ROW_TILES=1, num_warps=nw, UNROLL=un, STAGES=st, SPLIT=sp)
                                 for nw, un, st, sp in _STAGED if st * nw * un * _row_kb <= 200]


def main():
    fmts = sys.argv[1:] or ["bf16"]
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(5)
    print(torch.cuda.get_device_name(0), flush=True)
    for arg in fmts:
        mode, _, names = arg.partition(":")
        fmt = mode.removeprefix("staged-").removeprefix("kept-").removeprefix("cu-").removesuffix("-act")
        act = "silu_mul" if mode.endswith("-act") else None
        # (the act rows: in the kernel where the tiles pair rows; the cu rows against the default two launches; the
        # kept rows: the tensor-core kernel's defaults, also where gemv.CU_W4 would take the CUDA C++ kernel)
        module = importlib.import_module("xelink.kernels.gemv")
        module.TC_ACT_FUSED = act is not None and not mode.startswith("cu-")
        module.CU_W4 = False
        for n, k, name in SHAPES[mode]:
            if names and name not in names.split(","):
                continue
            ws = []
            for _ in range(LAYERS):
                w = torch.randn(n, k, device=dev, generator=gen) * 0.02
                ws.append((w.to(torch.bfloat16), None) if fmt == "bf16" else pack_w4a16(w, torch.bfloat16))
                if fmt == "w4a16t":
                    ws[-1] = (tile_w4a16(ws[-1][0]), ws[-1][1])
                del w
            nbytes = sum(t.numel() * t.element_size() for t in ws[0] if t is not None)
            x = torch.randn(1, k, device=dev, generator=gen).to(torch.bfloat16)
            want = gemv(ws[0][0], x, ws[0][1], fmt, "cuda", act=act).float()
            rows = []
            for cfg in [None] + CONFIGS[mode]:
                try:
                    got = gemv(ws[0][0], x, ws[0][1], fmt, "cuda", config=cfg, act=act).float()
                    err = float((got - want).norm() / want.norm())
                    calls = [lambda w=w, s=s: gemv(w, x, s, fmt, "cuda", config=cfg, act=act) for w, s in ws]
                    graph, _, _ = cuda_graph(calls, 1)
                    us = statistics.median(time_cuda_events(graph.replay, warmup=3, iters=20)) * 1e6 / LAYERS
                    del graph
                except Exception as e:  # noqa: BLE001 - a config that does not compile is a row, not the end
                    print(f"{fmt} {name} {n}x{k} {cfg}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
                    continue
                rows.append((us, cfg))
                print(f"{fmt} {name} {n}x{k} {'kept' if cfg is None else cfg}: {us:6.2f} us a call "
                      f"({nbytes / us / 1e3:6.0f} GB/s), rel diff {err:.1e}{'  WRONG' if err > 1e-2 else ''}",
                      flush=True)
            best = min(rows, key=lambda r: r[0])
            print(f"{fmt} {name}: best {best[0]:.2f} us {best[1] or 'kept'} (kept {rows[0][0]:.2f})", flush=True)
            del ws


if __name__ == "__main__":
    main()

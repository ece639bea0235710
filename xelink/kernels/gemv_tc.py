"""GEMV on the tensor cores with both operands loaded straight into registers (CUDA, Gluon).

``y = x @ W^T`` for 1-8 activation rows, the ``KERNEL="tc"`` path of :func:`xelink.kernels.gemv.gemv`
(``impl="cuda"``, compute capability >= 8.0). Triton's ``tl.dot`` moves a dequantized weight tile
through shared memory into the tensor-core operand layout; on the H200 that shared-memory traffic,
not DRAM, bounded the quantized kernels at 5-8 rows. Gluon (Triton's layout-explicit dialect) lets
each thread load exactly the weights its ``mma.sync`` fragment holds, so the data path is
DRAM -> registers -> (PTX dequantization) -> tensor cores, with no shared memory in the loop.

How (one ``m16n8k16`` per 16 rows of W and 16 columns of K):

- Weights are the A operand (16 rows a tile, ``ROW_TILES`` tiles a warp), the activations the B
  operand: n = 8 is the most rows gemv takes, so nothing is padded; rows past M repeat row M - 1 (never stored).
- A dot product does not care about the order of K. Within each 128-column step every thread of a
  quad loads 32 consecutive columns of its row (16-byte loads), and the step's column order is
  permuted (``_mma_order``: a reshape/permute that only relabels registers, checked by
  ``convert_layout(..., assert_trivial=True)``) so that those columns are exactly the ones its A and
  B fragments hold. Weights and activations get the same permutation.
- The warps of a program split K (a batched ``mma_v2``, one batch a warp) and their partial sums are
  added once at the end, so a program is 16 x ``ROW_TILES`` output rows and many programs stream W
  with no second launch; ``SPLIT`` > 1 (few rows, long K) adds a grid split and a sum kernel.
  ``UNROLL`` steps of a warp are loaded at once as more batches of the same mma (warp = batch % warps),
  so a warp has UNROLL x 16 bytes a thread of W in flight; ``PIPE`` loads the next iteration's weights
  before this one's math (two iterations in flight, twice the registers). ``STAGES`` (2-8) keeps the
  weights in flight in shared memory instead: cp.async ``STAGES - 1`` iterations ahead of the math, each
  thread copying and reading back its own 16-byte pieces, so the bytes in flight no longer cost registers
  (the W4A16 kernels were found waiting on memory with too few bytes in flight: h200-issue26). Measured
  slower than the kept kernels at every shape of the Llama step on an H200 (W4A16 10-15%, bf16 40-60%;
  gemv_chain_sweep_staged_*.log), so only a config for benchmarks; rows Triton cannot prove 16-byte
  aligned run without it.
- ``ACT`` (``gemv.TC_ACT_FUSED``, off): W is [gate; up] and a program's rows are (gate, up) halves (``_w_row``), so
  SwiGLU is applied at the store (one launch instead of the GEMV then silu_mul); measured no faster on an H100.
- W8A16: the prmt trick of gemv.py (exact int8 -> bf16/fp16), the row scale applied at the end.
  W4A16: one prmt puts a byte's two nibbles into the two halves of a register, one lop3 puts them
  under the magic exponent, one packed fma removes the offset (exactly nibble - 8): 13 instructions
  for 8 weights. Each 128-column group is its own mma chain, scaled in fp32 when added. ``BIASED``
  (bf16) drops the fma and removes the bias with an mma of a constant tile instead.

H200 measurements and what limits the kernel (L1 traffic of the activations at 8 rows):
benchmarks/results/h200-kernels/README.md, runs 12-13.
"""
from __future__ import annotations

import torch

from .pdl import prefetch_args

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    from .pdl import PREFETCH_ASM, pdl_launch, pdl_wait

    _PREFETCH_ASM = gl.constexpr(PREFETCH_ASM)
    # Gluon is experimental and its API moves between releases: only the release this was built and
    # tested with (3.6) and later ones take this path; older ones keep gemv.py's kernels.
    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 6):
        gluon = None
except Exception:  # noqa: BLE001 - no Triton, or a Triton without Gluon (older, Intel's): the path is absent
    gluon = None

__all__ = ["TC_AVAILABLE", "tc_config", "tc_fuses_act", "tc_launch_args"]

TC_AVAILABLE = gluon is not None
STEP = 128  # columns of K a warp takes per iteration (one W4A16 scale group)
_STAGED_SMEM = 200 * 1024  # the most shared memory STAGES may take a program (sm90 has 227 KB a block)
# Tiled W4A16 at 1-4 rows (the decode step's GEMVs), as two H100 sweeps of the step's chain found
# (benchmarks/results/h100-rows/gemv_tiled_sweep.log, thirtieth and thirty-second sessions): a warp's whole slice of
# K in flight where it is at most 4 steps (O, 4096 x 4096: 5.85 -> 5.35 and 5.81 -> 5.33 us a call), and 2 warps a
# program where the programs outnumber what is resident at once (gate/up, 28672 x 4096: 24.96 -> 23.72 and
# 24.51 -> 23.03). False: the rules before them (the step's A/B: step_ab.py gemv_tc.TILED_SLICE_RULES=False,True).
TILED_SLICE_RULES = True

# PTX shared with gemv.py's kernels (plain strings; each kernel wraps them as constexprs). W8: four
# int8 in, two registers of 16-bit pairs out, in order, exact: bf16 through fp32 (the byte q + 128
# prmt'ed under 2^23, 2^23 + 128 subtracted, pairs rounded to bf16: |q| <= 128 fits), fp16 under 1024
# (1024 + q + 128 in each half, one f16x2 subtraction). W4_MAGIC: per activation dtype, the 16-bit
# float B a nibble is put under (B + nibble exact), 1.0, -(B + 8), and the packed type: bf16 0x4300 =
# 128, 0x3F80 = 1, 0xC308 = -136; fp16 0x6400 = 1024, 0x3C00 = 1, 0xE408 = -1032.
W8_PTX = {"bf16": """{
        .reg .b32 v, m, f0, f1, f2, f3;
        xor.b32 v, $2, 0x80808080;
        mov.b32 m, 0x4B000000;
        prmt.b32 f0, v, m, 0x7440;
        prmt.b32 f1, v, m, 0x7441;
        prmt.b32 f2, v, m, 0x7442;
        prmt.b32 f3, v, m, 0x7443;
        sub.f32 f0, f0, 0f4B000080;
        sub.f32 f1, f1, 0f4B000080;
        sub.f32 f2, f2, 0f4B000080;
        sub.f32 f3, f3, 0f4B000080;
        cvt.rn.bf16x2.f32 $0, f1, f0;
        cvt.rn.bf16x2.f32 $1, f3, f2;
    }""",
          "fp16": """{
        .reg .b32 v, m, b;
        xor.b32 v, $2, 0x80808080;
        mov.b32 m, 0x64646464;
        mov.b32 b, 0x64806480;
        prmt.b32 $0, v, m, 0x4140;
        prmt.b32 $1, v, m, 0x4342;
        sub.f16x2 $0, $0, b;
        sub.f16x2 $1, $1, b;
    }"""}
W4_MAGIC = {"bf16": ("0x43004300", "0x3F803F80", "0xC308C308", "bf16x2"),
            "fp16": ("0x64006400", "0x3C003C00", "0xE408E408", "f16x2")}


# The exact finish of the W4 dequantizers (gemv.py's and this module's): each template leaves its four
# packed pairs B + nibble in u0..u3 (in its kernel's weight order) and one = 1.0, off = -(B + 8) in
# registers; one packed fma a pair gives nibble - 8 exactly.
W4_EXACT = """fma.rn.TY $0, u0, one, off;
        fma.rn.TY $1, u1, one, off;
        fma.rn.TY $2, u2, one, off;
        fma.rn.TY $3, u3, one, off;"""


def w4_ptx(template: str, finish: str, ty: str) -> str:
    """A W4 dequantizer template (placeholders FINISH, MAGIC2, ONE2, OFF2, TY) filled for activation
    dtype ``ty`` ("bf16" or "fp16") with the ``finish`` lines."""
    magic, one, off, op = W4_MAGIC[ty]
    return (template.replace("FINISH", finish).replace("MAGIC2", magic).replace("ONE2", one)
            .replace("OFF2", off).replace("TY", op))


if gluon is not None:
    _STEP = gl.constexpr(STEP)

    @gluon.constexpr_function
    def _load_layout(warps, unroll, rows, cols):
        """[warps * unroll, rows, cols]: warp w owns batches w + warps * u (its slice of K, ``unroll`` steps of
        it); lane (g, t) of a warp holds row g (+ 8 r for more row tiles) and cols / 4 consecutive columns
        from t * cols / 4 (16-byte loads)."""
        per_thread = cols // 4
        reg = [[0, 0, 1 << i] for i in range(per_thread.bit_length() - 1)]
        reg += [[0, 8 << i, 0] for i in range((rows // 8).bit_length() - 1)]
        reg += [[warps << i, 0, 0] for i in range(unroll.bit_length() - 1)]
        lane = [[0, 0, per_thread], [0, 0, 2 * per_thread], [0, 1, 0], [0, 2, 0], [0, 4, 0]]
        warp = [[1 << i, 0, 0] for i in range(warps.bit_length() - 1)]
        return gl.DistributedLinearLayout(reg, lane, warp, [], [warps * unroll, rows, cols])

    @gluon.jit
    def _mma_order(t, B: gl.constexpr, ROWS: gl.constexpr):
        """Permute the 128 columns of a step so that lane t's 32 consecutive columns land where its
        mma fragments are: column c = 32 t + 8 v + 4 h + 2 i + e goes to e + 2 t + 8 i + 16 (h + 2 v)
        (e: the pair in a register, i: the fragment's first or second register, h + 2 v: the k16 chunk).
        Each element stays in its thread; only the register order changes."""
        t = gl.reshape(t, [B, ROWS, 2, 2, 2, 2, 2, 2, 2])
        t = gl.permute(t, [0, 1, 4, 5, 6, 7, 2, 3, 8])
        return gl.reshape(t, [B, ROWS, _STEP])

    _W4_PAIRS = """{
        .reg .b32 s, u0, u1, u2, u3, one, off;
        mov.b32 one, ONE2;
        mov.b32 off, OFF2;
        shr.b32 s, $4, 4;
        prmt.b32 u0, $4, s, 0x4400;
        prmt.b32 u1, $4, s, 0x5511;
        prmt.b32 u2, $4, s, 0x6622;
        prmt.b32 u3, $4, s, 0x7733;
        lop3.b32 u0, u0, 0x000F000F, MAGIC2, 0xEA;
        lop3.b32 u1, u1, 0x000F000F, MAGIC2, 0xEA;
        lop3.b32 u2, u2, 0x000F000F, MAGIC2, 0xEA;
        lop3.b32 u3, u3, 0x000F000F, MAGIC2, 0xEA;
        FINISH
    }"""
    # Four bytes in, their eight weights out as (low, high) nibble pairs of each byte, in order: the
    # first output holds weights 0-3 of the word, the second 4-7. prmt copies byte j into the low half
    # and byte j of (word >> 4) into the high half; lop3 keeps the two nibbles under the 16-bit float
    # B (bf16 128 = 0x4300, fp16 1024 = 0x6400), which is then B + nibble exactly. Exact finish
    # (W4_EXACT): fma subtracts B + 8. Biased finish (bf16): B + nibble as is, the offset removed in the mma.
    _W4_BIASED = """mov.b32 $0, u0;
        mov.b32 $1, u1;
        mov.b32 $2, u2;
        mov.b32 $3, u3;"""

    _W4_BF16, _W4_FP16, _W4_BF16_BIASED = (gl.constexpr(w4_ptx(_W4_PAIRS, W4_EXACT, "bf16")),
                                           gl.constexpr(w4_ptx(_W4_PAIRS, W4_EXACT, "fp16")),
                                           gl.constexpr(w4_ptx(_W4_PAIRS, _W4_BIASED, "bf16")))
    _W8_BF16, _W8_FP16 = gl.constexpr(W8_PTX["bf16"]), gl.constexpr(W8_PTX["fp16"])
    @gluon.jit
    def _weights(p, FMT: gl.constexpr, BIASED: gl.constexpr, x_dtype: gl.constexpr, B: gl.constexpr,
                 BN: gl.constexpr):
        """The loaded tile as [B, BN, 128] weights of x_dtype in column order (W4A16: nibble - 8, or
        128 + nibble if BIASED; W8A16: q)."""
        if FMT == 2:
            if BIASED:
                lo, hi = gl.inline_asm_elementwise(_W4_BF16_BIASED, "=r,=r,=r,=r,r", [p],
                                                   dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
            elif x_dtype == gl.bfloat16:
                lo, hi = gl.inline_asm_elementwise(_W4_BF16, "=r,=r,=r,=r,r", [p],
                                                   dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
            else:
                lo, hi = gl.inline_asm_elementwise(_W4_FP16, "=r,=r,=r,=r,r", [p],
                                                   dtype=(gl.float16, gl.float16), is_pure=True, pack=4)
            # lo[4q + r] is weight 8q + r, hi[4q + r] weight 8q + 4 + r.
            w = gl.reshape(gl.join(lo, hi), [B, BN, 16, 4, 2])
            return gl.reshape(gl.permute(w, [0, 1, 2, 4, 3]), [B, BN, _STEP])
        elif FMT == 1:
            if x_dtype == gl.bfloat16:
                return gl.inline_asm_elementwise(_W8_BF16, "=r,=r,r", [p], dtype=gl.bfloat16, is_pure=True,
                                                 pack=4)
            else:
                return gl.inline_asm_elementwise(_W8_FP16, "=r,=r,r", [p], dtype=gl.float16, is_pure=True,
                                                 pack=4)
        else:
            return p

    @gluon.jit
    def _step_scales(s_ptrs, s_k, k, K, FMT: gl.constexpr):
        """The W4A16 group scales ``k`` columns on, [batch, row] in fp32 (masked: a warp's steps may run past
        K); 0.0 for the other formats."""
        if FMT == 2:
            return gl.load(s_ptrs + k // _STEP, mask=(s_k + k < K)[:, None], other=0.0).to(gl.float32)
        else:
            return 0.0

    @gluon.jit
    def _step_weights(w_ptrs, s_ptrs, w_kb, s_k, k, K, FMT: gl.constexpr, EVEN: gl.constexpr,
                      W_ADV: gl.constexpr = 1):
        """The raw weight tiles and (W4A16) group scales ``k`` columns on, loaded into registers (every
        batch: ``UNROLL`` steps of each warp; ``W_ADV``: 16 where W is stored in tiles of 16 rows)."""
        W_DIV: gl.constexpr = 2 if FMT == 2 else 1
        if EVEN:
            p = gl.load(w_ptrs + k // W_DIV * W_ADV)
        else:
            p = gl.load(w_ptrs + k // W_DIV * W_ADV, mask=w_kb + k // W_DIV < K // W_DIV, other=0)
        return p, _step_scales(s_ptrs, s_k, k, K, FMT)

    @gluon.jit
    def _stage_weights(buf, w_ptrs, w_kb, k, K, live, FMT: gl.constexpr, EVEN: gl.constexpr):
        """cp.async of the weight tiles ``k`` columns on into the shared-memory stage ``buf`` (zeros where
        ``live`` is false or past K), as one commit group. Each thread copies the 16-byte pieces it later
        reads back itself, so no barrier between warps is needed."""
        W_DIV: gl.constexpr = 2 if FMT == 2 else 1
        if EVEN:
            async_copy.async_copy_global_to_shared(buf, w_ptrs + k // W_DIV, mask=live)
        else:
            async_copy.async_copy_global_to_shared(buf, w_ptrs + k // W_DIV,
                                                   mask=(w_kb + k // W_DIV < K // W_DIV) & live)
        async_copy.commit_group()

    @gluon.jit
    def _step_x(x_ptrs, x_kk, k, K, EVEN: gl.constexpr):
        """The activation tiles ``k`` columns on."""
        if EVEN:
            return gl.load(x_ptrs + k)
        else:
            return gl.load(x_ptrs + k, mask=x_kk + k < K, other=0.0)

    @gluon.jit
    def _step_mma(acc, p, x, s, offset, zero_acc, FMT: gl.constexpr, BIASED: gl.constexpr,
                  a_layout: gl.constexpr, b_layout: gl.constexpr, B: gl.constexpr, BN: gl.constexpr):
        """acc plus one step: the weights dequantized, both tiles put in mma order (registers only) and
        multiplied; W4A16: one mma chain a 128-column group, scaled in fp32 as it is added (BIASED: the
        constant tile ``offset`` = -136 multiplied into the chain removes the weights' bias)."""
        w = _weights(p, FMT, BIASED, x.dtype, B, BN)
        a = gl.convert_layout(_mma_order(w, B, BN), a_layout, assert_trivial=True)
        b = gl.convert_layout(gl.permute(_mma_order(x, B, 8), [0, 2, 1]), b_layout, assert_trivial=True)
        if FMT == 2:
            part = mma_v2(a, b, zero_acc)
            if BIASED:
                part = mma_v2(offset, b, part)
            return acc + part * s[:, :, None]
        else:
            return mma_v2(a, b, acc)

    @gluon.jit
    def _w_row(pid_n, r, N, BN: gl.constexpr, ACT: gl.constexpr):
        """Row of W (of N; or 16-row block of N blocks) that row (block) ``r`` of program ``pid_n``'s BN reads,
        clamped to the last: BN from pid_n * BN; ACT (W is [gate; up]): the first BN / 2 from gate row
        pid_n * BN / 2, the others the matching up rows, N / 2 on."""
        if ACT:
            H: gl.constexpr = BN // 2
            return (r // H) * (N // 2) + gl.minimum(pid_n * H + r % H, N // 2 - 1)
        else:
            return gl.minimum(pid_n * BN + r, N - 1)

    @gluon.jit
    def _prefetch_tc(w_ptr, pid_n, N, stride_wn, first, nbytes, BN: gl.constexpr, WARPS: gl.constexpr,
                     LIMIT: gl.constexpr, ACT: gl.constexpr):
        """Before the PDL wait: ``nbytes`` (at most LIMIT) of each of the program's BN rows of W (``_w_row``) from
        byte ``first`` into L2, a piece a thread (pdl.py's prefetch_l2, in Gluon's explicit layouts)."""
        E: gl.constexpr = max(32 * WARPS, BN)
        PIECES: gl.constexpr = E // BN
        layout: gl.constexpr = gl.BlockedLayout([E // (32 * WARPS)], [32], [WARPS], [0])
        i = gl.arange(0, E, layout=layout)
        rows = _w_row(pid_n, i // PIECES, N, BN, ACT)
        n = gl.minimum(nbytes, LIMIT)
        piece = (gl.cdiv(n, PIECES) + 15) // 16 * 16
        at = (i % PIECES) * piece
        ptrs = w_ptr.to(gl.pointer_type(gl.uint8), bitcast=True) + rows * stride_wn + first + at
        gl.inline_asm_elementwise(_PREFETCH_ASM, "=r,l,r", [ptrs, gl.minimum(piece, n - at)], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit(do_not_specialize=["STEPS"])
    def _gemv_tc_kernel(w_ptr, x_ptr, s_ptr, y_ptr, M, N, K, STEPS,
                        stride_wn, stride_xm, stride_sn, stride_ym, stride_ys,
                        FMT: gl.constexpr, EVEN: gl.constexpr, PARTIAL: gl.constexpr, UNROLL: gl.constexpr,
                        BIASED: gl.constexpr, ROW_TILES: gl.constexpr, PDL: gl.constexpr,
                        num_warps: gl.constexpr, PREFETCH: gl.constexpr = 0, LIMIT: gl.constexpr = 0,
                        PIPE: gl.constexpr = False, STAGES: gl.constexpr = 0, TILED: gl.constexpr = False,
                        ACT: gl.constexpr = False):
        WARPS: gl.constexpr = num_warps
        BN: gl.constexpr = 16 * ROW_TILES
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1, 1],
                                                      instr_shape=[1, 16, 8])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        # Elements (bytes for W4A16, two weights a byte) of a W row a step.
        W_DIV: gl.constexpr = 2 if FMT == 2 else 1
        W_COLS: gl.constexpr = _STEP // W_DIV
        B: gl.constexpr = WARPS * UNROLL  # batches of the mma: UNROLL steps of each warp (warp = batch % WARPS)
        wl: gl.constexpr = _load_layout(WARPS, UNROLL, BN, W_COLS)
        xl: gl.constexpr = _load_layout(WARPS, UNROLL, 8, _STEP)
        sl: gl.constexpr = gl.SliceLayout(2, mma)

        pid_n = gl.program_id(0)
        pid_s = gl.program_id(1)
        # TILED (fmt "w4a16t", gemv.tile_w4a16): W stored as tiles of 16 rows x one step (16 x W_COLS elements,
        # contiguous), a 16-row block's tiles in column order: a warp's load of a step is one contiguous piece.
        W_ADV: gl.constexpr = 16 if TILED else 1
        if PREFETCH:
            if pid_n + pid_s * gl.num_programs(0) < PREFETCH:  # the first PREFETCH programs' columns: their
                # warps' STEPS steps each, from (s * WARPS) * STEPS * 128
                k_lo = pid_s * WARPS * STEPS * _STEP
                k_n = gl.minimum(K - k_lo, WARPS * STEPS * _STEP)
                if TILED:  # a program's columns of each of its 16-row blocks are one contiguous range
                    _prefetch_tc(w_ptr, pid_n, gl.cdiv(N, 16), stride_wn * 16, k_lo // W_DIV * 16,
                                 k_n // W_DIV * 16, ROW_TILES, WARPS, LIMIT * 16, ACT)
                else:
                    _prefetch_tc(w_ptr, pid_n, N, stride_wn, k_lo // W_DIV, k_n // W_DIV, BN, WARPS, LIMIT, ACT)
        pdl_wait(PDL)
        # Warp w of split s takes STEPS steps from column (s * WARPS + w) * STEPS * 128, UNROLL at a time:
        # batch b holds step u = b // WARPS of each iteration of warp w = b % WARPS.
        bw = gl.arange(0, B, layout=gl.SliceLayout(1, gl.SliceLayout(2, wl)))
        k_w = ((pid_s * WARPS + bw % WARPS) * STEPS + bw // WARPS) * _STEP
        # rows past N re-read row N-1 (dropped at the store): no row mask; ACT: (gate, up) halves (_w_row)
        rn = _w_row(pid_n, gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(2, wl))), N, BN, ACT)
        rc = gl.arange(0, W_COLS, layout=gl.SliceLayout(0, gl.SliceLayout(1, wl)))
        w_kb = (k_w // W_DIV)[:, None, None] + rc[None, None, :]  # element (byte) offset within a row
        if TILED:
            w_ptrs = (w_ptr + ((rn // 16) * (16 * stride_wn) + (rn % 16) * W_COLS)[None, :, None]
                      + (k_w // W_DIV * 16)[:, None, None] + rc[None, None, :])
        else:
            w_ptrs = w_ptr + rn[None, :, None] * stride_wn + w_kb

        bx = gl.arange(0, B, layout=gl.SliceLayout(1, gl.SliceLayout(2, xl)))
        x_w = ((pid_s * WARPS + bx % WARPS) * STEPS + bx // WARPS) * _STEP
        rm = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, xl)))
        rk = gl.arange(0, _STEP, layout=gl.SliceLayout(0, gl.SliceLayout(1, xl)))
        x_kk = x_w[:, None, None] + rk[None, None, :]
        # rows past M re-read row M-1 (their outputs are not stored): no row mask, no zeroing a step
        x_ptrs = x_ptr + gl.minimum(rm, M - 1)[None, :, None] * stride_xm + x_kk

        # W4A16 group scales [batch, row] (masked: a warp's steps may run past K).
        bs = gl.arange(0, B, layout=gl.SliceLayout(1, sl))
        s_k = ((pid_s * WARPS + bs % WARPS) * STEPS + bs // WARPS) * _STEP
        s_n = _w_row(pid_n, gl.arange(0, BN, layout=gl.SliceLayout(0, sl)), N, BN, ACT)
        s_ptrs = s_ptr + s_n[None, :] * stride_sn + (s_k // _STEP)[:, None]
        acc = gl.zeros([B, BN, 8], gl.float32, layout=mma)
        zero_acc = gl.zeros([B, BN, 8], gl.float32, layout=mma)
        offset = gl.full([B, BN, _STEP], -136.0, gl.bfloat16, layout=a_layout)
        ITERS = STEPS // UNROLL
        KI: gl.constexpr = UNROLL * _STEP  # columns a warp advances an iteration
        if PIPE:
            # The next iteration's weights are loaded before this one's math: two iterations in flight a warp
            # (the last loads its own tiles again, from L2). The activations (L1 / L2) are loaded when used.
            p, s = _step_weights(w_ptrs, s_ptrs, w_kb, s_k, 0, K, FMT, EVEN, W_ADV)
            for it in range(ITERS):
                pn, sn = _step_weights(w_ptrs, s_ptrs, w_kb, s_k, gl.minimum(it + 1, ITERS - 1) * KI, K, FMT, EVEN,
                                       W_ADV)
                x = _step_x(x_ptrs, x_kk, it * KI, K, EVEN)
                acc = _step_mma(acc, p, x, s, offset, zero_acc, FMT, BIASED, a_layout, b_layout, B, BN)
                p = pn
                s = sn
        elif STAGES > 0:
            # W's bytes in flight in shared memory instead of registers: cp.async STAGES - 1 iterations ahead
            # of the math (unswizzled: a warp's 16-byte pieces are 512 contiguous bytes, no bank conflict)
            buf = gl.allocate_shared_memory(w_ptr.dtype.element_ty, [STAGES, B, BN, W_COLS],
                                            gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))
            for i in gl.static_range(STAGES - 1):
                _stage_weights(buf.index(i), w_ptrs, w_kb, i * KI, K, i < ITERS, FMT, EVEN)
            for it in range(ITERS):
                ahead = it + STAGES - 1
                _stage_weights(buf.index(ahead % STAGES), w_ptrs, w_kb, ahead * KI, K, ahead < ITERS, FMT, EVEN)
                async_copy.wait_group(STAGES - 1)
                p = buf.index(it % STAGES).load(wl)
                s = _step_scales(s_ptrs, s_k, it * KI, K, FMT)
                x = _step_x(x_ptrs, x_kk, it * KI, K, EVEN)
                acc = _step_mma(acc, p, x, s, offset, zero_acc, FMT, BIASED, a_layout, b_layout, B, BN)
        else:
            for it in range(ITERS):
                # each warp's UNROLL steps loaded before any is used: more bytes in flight a warp
                p, s = _step_weights(w_ptrs, s_ptrs, w_kb, s_k, it * KI, K, FMT, EVEN, W_ADV)
                x = _step_x(x_ptrs, x_kk, it * KI, K, EVEN)
                acc = _step_mma(acc, p, x, s, offset, zero_acc, FMT, BIASED, a_layout, b_layout, B, BN)

        pdl_launch(PDL)
        y = gl.sum(acc, axis=0)  # the warps' partial sums: [BN, 8]
        if ACT:  # silu(gate) * up of each (gate, up) row pair, each sum rounded to y's dtype first (gemv.py)
            ol: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [WARPS, 1], [1, 0])
            if FMT == 1:
                rs = _w_row(pid_n, gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(0, mma))), N, BN, ACT)
                y = y * gl.load(s_ptr + rs * stride_sn).to(gl.float32)[:, None]
            pairs: gl.constexpr = gl.BlockedLayout([2, 1, 8], [1, 32, 1], [1, WARPS, 1], [2, 1, 0])
            y = gl.convert_layout(gl.reshape(y, [2, BN // 2, 8]), pairs)  # a pair's two rows in one thread
            g, u = gl.split(gl.permute(y, [1, 2, 0]))
            g = g.to(y_ptr.dtype.element_ty).to(gl.float32)
            u = u.to(y_ptr.dtype.element_ty).to(gl.float32)
            y = gl.convert_layout(g / (1.0 + gl.exp(-g)) * u, ol)
            rno = pid_n * (BN // 2) + gl.arange(0, BN // 2, layout=gl.SliceLayout(1, ol))
            rmo = gl.arange(0, 8, layout=gl.SliceLayout(0, ol))
            n_out = N // 2
        else:
            ol: gl.constexpr = gl.SliceLayout(0, mma)
            rno = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, ol))
            rmo = gl.arange(0, 8, layout=gl.SliceLayout(0, ol))
            if FMT == 1:
                y = y * gl.load(s_ptr + gl.minimum(rno, N - 1) * stride_sn).to(gl.float32)[:, None]
            n_out = N
        y_ptrs = y_ptr + pid_s * stride_ys + rmo[None, :] * stride_ym + rno[:, None]
        y_ok = (rmo < M)[None, :] & (rno < n_out)[:, None]
        if PARTIAL:
            gl.store(y_ptrs, y, mask=y_ok)
        else:
            gl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=y_ok)


def tc_config(M: int, N: int, K: int, fmt: str, sms: int, row_tiles: int | None = None,
              num_warps: int | None = None, unroll: int | None = None) -> dict:
    """Tile for the tensor-core GEMV (defaults from the H200 sweeps, benchmarks/results/h200-kernels runs 12,
    13 and 15; W4A16 at 1-4 rows: the decode step's chain, h200-issue26): ``ROW_TILES`` (16 rows of W each) a
    program (more on large matrices: 4 for W4A16 at 5-8 rows from 65536 rows, 2 above 4096 rows; 2 for W8A16
    from 65536 rows), ``num_warps`` warps splitting K (8 on matrices of at most 4096 rows, where programs are
    few; 4 for W4A16 at 1-4 rows where every program is resident at once), ``UNROLL`` steps a warp loaded at
    once (4 in that case), ``BIASED`` (W4A16) where 4 row tiles make the kernel instruction-bound, and a grid
    ``SPLIT`` of K (a second launch) only when the programs would leave the GPU short of 8 warps a
    multiprocessor while every warp keeps at least 2 steps (not in that case). Tiled W4A16 ("w4a16t") at 1-4 rows
    with every warp resident: 8 warps of 1 step (2 above 4096 rows; up to 4, a warp's whole slice of K, where that
    is at most 4 steps), K split while a warp would have 12 steps or more; with more programs than are resident, 2
    warps a program (the H100 sweeps, benchmarks/results/h100-rows/gemv_tiled_sweep.log; ``TILED_SLICE_RULES``)."""
    big = N >= 65536
    w4 = fmt in ("w4a16", "w4a16t")
    split = 1
    if row_tiles is None:
        if w4:
            row_tiles = 1 if M <= 4 or N <= 4096 else 4 if big else 2
        else:
            row_tiles = 2 if big else 1
    if w4 and M <= 4 and row_tiles == 1 and num_warps is None and unroll is None and -(-N // 16) * 4 <= 16 * sms:
        # W4A16, 1-4 rows, every warp resident at once: 4 warps a program, 4 steps a warp in flight and no
        # grid split (gemv_chain_sweep, 658a747: 6144 x 4096 9.02 -> 6.46 us a call; 4096 x 4096 5.61 us, as
        # fast as 8 warps x 2 steps, and 8.43 us split in two)
        num_warps, unroll, may_split = 4, 4, False
        if fmt == "w4a16t":  # (N > 4096: two steps a warp in flight; H100 sweeps, gemv_tiled_sweep.log)
            num_warps, unroll = 8, 2 if N > 4096 else 1
            while -(-K // STEP) // (2 * split * num_warps) >= 6:
                split *= 2
            per_warp = -(-K // STEP) // (split * num_warps)
            if TILED_SLICE_RULES and N <= 4096 and 1 <= per_warp <= 4:  # the warp's whole slice at once
                unroll = 1 << (per_warp.bit_length() - 1)
    else:
        may_split = True  # a grid split while warps are few
        if TILED_SLICE_RULES and fmt == "w4a16t" and M <= 4 and row_tiles == 1 and not big and num_warps is None:
            num_warps = 2  # (more programs resident a multiprocessor)
    if num_warps is None:
        num_warps = 8 if N <= 4096 else 4
    if unroll is None:
        unroll = 2 if (w4 and (N <= 4096 or row_tiles == 1 and big)) or row_tiles == 2 else 1
    programs, steps = -(-N // (16 * row_tiles)), -(-K // STEP)
    while may_split and programs * split * num_warps < 8 * sms and steps // (2 * split * num_warps) >= 2:
        split *= 2
    cfg = dict(ROW_TILES=row_tiles, num_warps=num_warps, UNROLL=unroll, SPLIT=split)
    if w4:
        cfg["BIASED"] = row_tiles >= 4
    return cfg


def tc_fuses_act(cfg: dict, N: int, tiled: bool) -> bool:
    """Whether config ``cfg`` (its ``ROW_TILES``) applies ``act="silu_mul"`` in the kernel for W [gate; up] of N
    rows: a program's rows split into (gate, up) halves, which for tiled weights must be whole 16-row blocks (N / 2
    a multiple of 16, ROW_TILES >= 2); else gemv runs the kernel, then silu_mul."""
    return N % 2 == 0 and (not tiled or (N // 2) % 16 == 0 and cfg.get("ROW_TILES", 1) >= 2)


def tc_launch_args(w: torch.Tensor, x: torch.Tensor, scales, fmt_code: int, cfg: dict, y_stride: int,
                   tiled: bool = False, act: bool = False) -> tuple:
    """How the tensor-core GEMV launches for W ``w [N, *]`` and activations ``x [M, K]`` (x taken
    contiguous, M <= 8; checks done by the caller) into ``y [M, N]`` of row stride ``y_stride``: (kernel,
    grid, the integer arguments after (w, x, scales, out), the options, the grid split: > 1 means ``out``
    is a float32 ``[split, M, N]`` partial-sum buffer the caller adds into y). Reads shapes, strides and
    whether w's base is 16-byte aligned (as the launch plans' keys). ``cfg``: ``ROW_TILES``, ``num_warps``,
    ``SPLIT`` (powers of two), ``UNROLL`` (1, 2, 4, 8), ``BIASED`` (W4A16 with bf16 activations: the
    nibbles' bias removed by a constant mma instead of a packed fma a weight pair; default False), ``PDL``
    (0, 1 or 2: programmatic dependent launch, see pdl.py, sm90+; default 0), ``PIPE`` (the next iteration's
    weights loaded into registers early) or ``STAGES`` (0, or 2-8 shared-memory stages of cp.async; taken where
    K and W's row stride are multiples of 16 elements and its base 16-byte aligned, else off), each defaulted.
    ``tiled``: W4A16 weights in ``tile_w4a16``'s layout (fmt "w4a16t"; N a multiple of 16, contiguous: checked by
    the caller). ``act``: W is [gate; up] and y gets silu(gate) * up (``[M, N / 2]``; where :func:`tc_fuses_act`,
    checked by the caller; no grid split)."""
    if gluon is None:
        raise RuntimeError("gemv: KERNEL='tc' needs Triton's Gluon (triton >= 3.5 for CUDA)")
    cfg = dict(cfg)
    row_tiles, warps = cfg.pop("ROW_TILES", 1), cfg.pop("num_warps", 4)
    split, unroll = cfg.pop("SPLIT", 1), cfg.pop("UNROLL", 1)
    biased, pipe, stages = cfg.pop("BIASED", False), cfg.pop("PIPE", False), cfg.pop("STAGES", 0)
    pdl = cfg.pop("PDL", 0)
    if cfg:
        raise ValueError(f"gemv: unknown KERNEL='tc' config keys {sorted(cfg)}")
    for name, v in (("ROW_TILES", row_tiles), ("num_warps", warps), ("SPLIT", split)):
        if not isinstance(v, int) or v < 1 or v & (v - 1):
            raise ValueError(f"gemv: KERNEL='tc' config {name}={v!r} must be a power of two >= 1")
    if unroll not in (1, 2, 4, 8):
        raise ValueError(f"gemv: KERNEL='tc' config UNROLL={unroll!r} must be 1, 2, 4 or 8")
    if pipe not in (False, True):
        raise ValueError(f"gemv: KERNEL='tc' config PIPE={pipe!r} must be a bool")
    if not isinstance(stages, int) or isinstance(stages, bool) or not 0 <= stages <= 8 or stages == 1:
        raise ValueError(f"gemv: KERNEL='tc' config STAGES={stages!r} must be 0 (off) or 2-8")
    if tiled and stages:
        raise ValueError("gemv: KERNEL='tc' config STAGES does not take fmt='w4a16t' (copies of row pieces)")
    if stages and pipe:
        raise ValueError("gemv: KERNEL='tc' config takes PIPE or STAGES, not both (two ways to load ahead)")
    # a stage is a warp's UNROLL steps of 16 * ROW_TILES rows of W, every warp's
    stage_bytes = warps * unroll * 16 * row_tiles * STEP * w.element_size() // (2 if fmt_code == 2 else 1)
    if stages * stage_bytes > _STAGED_SMEM:
        raise ValueError(f"gemv: KERNEL='tc' config STAGES={stages} needs {stages * stage_bytes} bytes of shared "
                         f"memory a program (num_warps={warps}, UNROLL={unroll}, ROW_TILES={row_tiles}), more than "
                         f"{_STAGED_SMEM}")
    M, K = x.shape
    N = w.shape[0]
    if stages and (K % 16 or w.stride(0) % 16 or w.data_ptr() % 16):
        # cp.async moves whole 4-16 byte pieces, which Triton must prove aligned from its specialisation
        # (arguments divisible by 16): other rows are loaded into registers (STAGES off).
        stages = 0
    steps = -(-K // STEP)
    if act:
        split = 1  # (the (gate, up) pairs combine at the store)
    split = max(1, min(split, -(-steps // warps)))
    per_warp = -(-steps // (split * warps))
    split = -(-steps // (per_warp * warps))
    per_warp = -(-per_warp // unroll) * unroll  # whole unrolled iterations; steps past K are masked
    even = K == split * warps * per_warp * STEP
    stride_sn = scales.stride(0) if scales is not None else 0
    x_stride = x.stride(0) if x.is_contiguous() else K
    grid = (-(-(N // 2) // (8 * row_tiles)) if act else -(-N // (16 * row_tiles)), split)
    ints = (M, N, K, per_warp, w.stride(0), x_stride, stride_sn, N if split > 1 else y_stride,
            M * N if split > 1 else 0)
    kwargs = dict(FMT=fmt_code, EVEN=even, PARTIAL=split > 1, UNROLL=unroll, PIPE=bool(pipe), STAGES=stages,
                  BIASED=bool(biased) and fmt_code == 2 and x.dtype == torch.bfloat16, ROW_TILES=row_tiles, PDL=pdl,
                  TILED=bool(tiled), ACT=bool(act),
                  num_warps=warps, launch_pdl=pdl > 0)
    # the first programs' weights into L2 before the PDL wait (pdl.py)
    kwargs.update(prefetch_args(pdl, x.device, 16 * row_tiles,
                                warps * per_warp * STEP * w.element_size() // (2 if fmt_code == 2 else 1),
                                gemv=True))
    return _gemv_tc_kernel, grid, ints, kwargs, split

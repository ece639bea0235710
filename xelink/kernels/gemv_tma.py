"""GEMV (W4A16, bf16, fp16) with W streamed into shared memory by TMA from a producer warp (CUDA sm90, Gluon).

The tensor-core GEMV's ``TMA`` config (``gemv(config=dict(KERNEL="tc", TMA=stages, ...))``, planned by
``gemv._GemvLaunch``; not a default): the same math as ``gemv_tc`` (its dequantization, its mma order, one mma
chain a 128-column group scaled in fp32), fed another way. The register-loading kernel was measured waiting on memory with too few bytes in flight (each
byte in flight costs a register; h200-issue26), and its cp.async stages (``STAGES``, a copy a thread) were
slower still. Here one warp keeps ``TMA`` stages of W in flight with bulk copies, and the consumer warps only
read shared memory (and the small group scales and activations), dequantize and multiply:

- A program is persistent: it takes row tiles ``pid, pid + grid, ...`` of 16 x ``ROW_TILES`` rows each (the grid
  is ``PROGRAMS`` a multiprocessor), so the copies run on across tiles with no prologue a tile and no
  partial last wave of programs.
- A stage is B = ``num_warps`` x ``UNROLL`` consecutive 128-column steps of the tile's rows: one box of B steps
  x 16 ``ROW_TILES`` rows x a step's row (W4A16 64 bytes, dense 256; W seen as [step, row, column], so a step's
  rows lie next to each other in shared memory, as the consumers' 16-byte reads want them); a "ready" barrier a
  stage counts its bytes, an "empty" barrier is released by the consumers once every warp's mma has used what
  it read (a release as soon as the reads were issued let the next copy overwrite bytes still being read).
- Steps past K are zeros (TMA's fill), their scales zeros: they add nothing. Rows past N are zeros, not stored.

Limits (:func:`tma_applies`; the caller takes the register kernel otherwise): W4A16 or dense bf16 / fp16 weights
(not W8A16) with 1-8 activation rows, W's base and row stride 16-byte aligned, K a multiple of 128, an sm90 GPU.
"""
from __future__ import annotations

import torch

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

    from .gemv_tc import _load_layout, _step_mma
    from .pdl import pdl_launch, pdl_wait

    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 6):
        gluon = None
except Exception:  # noqa: BLE001 - no Triton, or one without Gluon's Hopper API: the path is absent
    gluon = None

__all__ = ["TMA_AVAILABLE", "tma_applies", "tma_launch_args", "tma_options"]

TMA_AVAILABLE = gluon is not None
STEP = 128  # columns of K a step (one W4A16 scale group)
_SMEM = 200 * 1024  # the most shared memory the stages may take a program


if gluon is not None:
    _STEP = gl.constexpr(STEP)

    @gluon.jit
    def _producer(w_desc, w_smem, ready, empty, n_tiles, tile_steps, BN: gl.constexpr, B: gl.constexpr,
                  STAGES: gl.constexpr):
        """Every stage of every tile of this program, in order: wait for its slot to be empty, then its box of B
        steps of W onto the slot's ready barrier."""
        c = 0
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            for j in range(tile_steps):
                slot = c % STAGES
                mbarrier.wait(empty.index(slot), ((c // STAGES) & 1) ^ 1)  # a slot's first use passes
                mbarrier.expect(ready.index(slot), w_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(w_desc, [j * B, t * BN, 0], ready.index(slot), w_smem.index(slot))
                c += 1

    @gluon.jit
    def _consumer(w_smem, ready, empty, x_ptr, s_ptr, y_ptr, M, N, K, n_tiles, tile_steps, stride_xm, stride_sn,
                  stride_ym, FMT: gl.constexpr, EVEN: gl.constexpr, BIASED: gl.constexpr, ROW_TILES: gl.constexpr,
                  UNROLL: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr):
        """The tiles' math: each stage's W from shared memory, its group scales (W4A16, asked for before the stage's
        wait) and activations (L1) from global memory, gemv_tc's mma step, then the slot released; a tile's warps'
        sums stored."""
        BN: gl.constexpr = 16 * ROW_TILES
        B: gl.constexpr = WARPS * UNROLL
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1, 1],
                                                      instr_shape=[1, 16, 8])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        wl: gl.constexpr = _load_layout(WARPS, UNROLL, BN, _STEP // 2 if FMT == 2 else _STEP)
        xl: gl.constexpr = _load_layout(WARPS, UNROLL, 8, _STEP)
        sl: gl.constexpr = gl.SliceLayout(2, mma)
        ol: gl.constexpr = gl.SliceLayout(0, mma)

        # batch b of a stage is its step b (any order of K does: the warps' sums are added at the end)
        bx = gl.arange(0, B, layout=gl.SliceLayout(1, gl.SliceLayout(2, xl)))
        rm = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, xl)))
        rk = gl.arange(0, _STEP, layout=gl.SliceLayout(0, gl.SliceLayout(1, xl)))
        x_kk = bx[:, None, None] * _STEP + rk[None, None, :]
        # rows past M re-read row M-1 (their outputs are not stored)
        x_ptrs = x_ptr + gl.minimum(rm, M - 1)[None, :, None] * stride_xm + x_kk
        bs = gl.arange(0, B, layout=gl.SliceLayout(1, sl))
        rs = gl.arange(0, BN, layout=gl.SliceLayout(0, sl))
        zero_acc = gl.zeros([B, BN, 8], gl.float32, layout=mma)
        offset = gl.full([B, BN, _STEP], -136.0, gl.bfloat16, layout=a_layout)
        rmo = gl.arange(0, 8, layout=gl.SliceLayout(0, ol))
        c = 0
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            acc = gl.zeros([B, BN, 8], gl.float32, layout=mma)
            s_ptrs = s_ptr + gl.minimum(t * BN + rs, N - 1)[None, :] * stride_sn + bs[:, None]
            for j in range(tile_steps):
                slot = c % STAGES
                k = j * B * _STEP
                if FMT == 2:  # [batch, row], 0 past K
                    s = gl.load(s_ptrs + j * B, mask=(k + bs * _STEP < K)[:, None], other=0.0).to(gl.float32)
                else:
                    s = 0.0
                if EVEN:
                    x = gl.load(x_ptrs + k)
                else:
                    x = gl.load(x_ptrs + k, mask=x_kk + k < K, other=0.0)
                mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
                p = w_smem.index(slot).load(wl)
                acc = _step_mma(acc, p, x, s, offset, zero_acc, FMT, BIASED, a_layout, b_layout, B, BN)
                # The slot is released once every warp has used what it read (its mma took the registers): a
                # shared-memory load is not complete when it is issued, and a release right after it let the
                # next copy overwrite bytes still being read (H100: wrong sums where a program took two tiles).
                gl.thread_barrier()
                mbarrier.arrive(empty.index(slot))
                c += 1
            y = gl.sum(acc, axis=0)  # the warps' partial sums: [BN, 8]
            rno = t * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, ol))
            y_ptrs = y_ptr + rmo[None, :] * stride_ym + rno[:, None]
            gl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=(rmo < M)[None, :] & (rno < N)[:, None])

    @gluon.jit(do_not_specialize=["n_tiles", "tile_steps"])
    def _gemv_tma_kernel(w_desc, x_ptr, s_ptr, y_ptr, M, N, K, n_tiles, tile_steps, stride_xm, stride_sn, stride_ym,
                         FMT: gl.constexpr, EVEN: gl.constexpr, BIASED: gl.constexpr, ROW_TILES: gl.constexpr,
                         UNROLL: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr):
        BN: gl.constexpr = 16 * ROW_TILES
        B: gl.constexpr = num_warps * UNROLL
        pdl_wait(PDL)  # x (and, for all this kernel knows, W) may be the previous kernel's output
        W_COLS: gl.constexpr = _STEP // 2 if FMT == 2 else _STEP  # elements of a row a step (W4A16: bytes)
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, B, BN, W_COLS], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()
        gl.warp_specialize([
            (_consumer, (w_smem, ready, empty, x_ptr, s_ptr, y_ptr, M, N, K, n_tiles, tile_steps, stride_xm,
                         stride_sn, stride_ym, FMT, EVEN, BIASED, ROW_TILES, UNROLL, STAGES, num_warps)),
            (_producer, (w_desc, w_smem, ready, empty, n_tiles, tile_steps, BN, B, STAGES)),
        ], [1], [24])
        pdl_launch(PDL)


def tma_options(cfg: dict) -> dict | None:
    """Pop the TMA kernel's keys from a ``KERNEL="tc"`` config (``cfg`` is changed) and check them: ``TMA`` (0: off,
    else the shared-memory stages, 2-8), ``PROGRAMS`` (a multiprocessor, 1-4) and ``REGS`` (registers a thread
    at launch, 0: what lets ``PROGRAMS`` fit). None where TMA is off; raises ValueError on bad values (on any
    machine, whether or not the kernel would run)."""
    stages, programs, regs = cfg.pop("TMA", 0), cfg.pop("PROGRAMS", 1), cfg.pop("REGS", 0)
    if not isinstance(stages, int) or isinstance(stages, bool) or not 0 <= stages <= 8 or stages == 1:
        raise ValueError(f"gemv: KERNEL='tc' config TMA={stages!r} must be 0 (off) or 2-8 stages")
    if not isinstance(programs, int) or isinstance(programs, bool) or not 1 <= programs <= 4:
        raise ValueError(f"gemv: KERNEL='tc' config PROGRAMS={programs!r} must be 1-4 (a multiprocessor)")
    if not isinstance(regs, int) or isinstance(regs, bool) or regs and not (24 <= regs <= 256 and regs % 8 == 0):
        raise ValueError(f"gemv: KERNEL='tc' config REGS={regs!r} must be 0 (fit PROGRAMS) or 24-256, a multiple of 8")
    if not stages:
        return None
    if cfg.get("PIPE") or cfg.get("STAGES"):
        raise ValueError("gemv: KERNEL='tc' config takes TMA or PIPE / STAGES, not both (ways to load ahead)")
    return dict(TMA=stages, PROGRAMS=programs, REGS=regs)


def tma_applies(w: torch.Tensor, x: torch.Tensor, scales, fmt_code: int) -> bool:
    """Whether the TMA kernel takes these operands (module docstring: format, alignment, K, sm90)."""
    K = x.shape[1]
    if not (TMA_AVAILABLE and fmt_code in (0, 2) and w.is_cuda and K > 0 and K % STEP == 0 and w.stride(1) == 1
            and w.stride(0) * w.element_size() % 16 == 0 and w.data_ptr() % 16 == 0
            and torch.cuda.get_device_capability(w.device)[0] == 9):
        return False
    return fmt_code == 0 or (scales is not None and scales.stride(1) == 1)


def tma_launch_args(w: torch.Tensor, x: torch.Tensor, scales, fmt_code: int, cfg: dict, opts: dict, sms: int,
                    y_stride: int) -> tuple:
    """The TMA kernel's launch for ``w [N, K]`` (dense, ``fmt_code`` 0) or ``[N, K/2]`` (W4A16, uint8, with group
    ``scales [N, K/128]``) and ``x [M, K]`` (taken contiguous, M <= 8) into ``y [M, N]`` of row stride
    ``y_stride``: (kernel, grid, the integer arguments after (w, x, scales, y), the options, the descriptor
    view of w as ``launcher.Descriptor`` fields). Reads shapes and strides only, as the launch plans' keys.
    ``cfg``: the tc kernel's ``ROW_TILES``, ``num_warps`` (consumer warps), ``UNROLL`` (steps a warp a stage),
    ``BIASED``, ``PDL`` (``SPLIT`` is not used: programs are persistent, K is not split); ``opts``:
    :func:`tma_options`'. Checks of the operands (:func:`tma_applies`) are the caller's."""
    stages, programs = opts["TMA"], opts["PROGRAMS"]
    tiles, warps, unroll = cfg.get("ROW_TILES", 1), cfg.get("num_warps", 4), cfg.get("UNROLL", 1)
    M, K = x.shape
    N = w.shape[0]
    B, BN = warps * unroll, 16 * tiles
    if warps % 4:
        raise ValueError(f"gemv: KERNEL='tc' config TMA takes num_warps a multiple of 4 (warp specialization's "
                         f"warpgroups), got {warps}")
    if B > 256 or BN > 256:
        raise ValueError(f"gemv: KERNEL='tc' config TMA: num_warps x UNROLL = {B} and 16 x ROW_TILES = {BN} must be "
                         f"at most 256 (a TMA box's sides)")
    w4 = fmt_code == 2
    cols = STEP // 2 if w4 else STEP  # elements of a row a step (W4A16: bytes, two weights each)
    smem = stages * B * BN * cols * w.element_size()
    if smem > _SMEM:
        raise ValueError(f"gemv: KERNEL='tc' config TMA={stages} needs {smem} bytes of shared memory a program "
                         f"(num_warps={warps}, UNROLL={unroll}, ROW_TILES={tiles}), more than {_SMEM}")
    n_tiles = -(-N // BN)
    steps = K // STEP
    # W as [step, row, column]: a box of B steps lands as the consumers' [B, BN, cols]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 * w.element_size(), rank=3)
    view = ((steps, N, cols), (cols, w.stride(0), 1), (B, BN, cols), "zero", layout)
    grid = (min(n_tiles, programs * sms),)
    x_stride = x.stride(0) if x.is_contiguous() else K  # (the call reads x.contiguous())
    ints = (M, N, K, n_tiles, -(-steps // B), x_stride, scales.stride(0) if w4 else 0, y_stride)
    # Registers a thread at launch: the program's warps (the consumers and the producer, in whole warpgroups, as
    # Triton's warp specialization allocates them) times these must let PROGRAMS programs share a multiprocessor.
    threads = -(-(warps + 1) // 4) * 128
    regs = opts["REGS"] or min(256, 65536 // (programs * threads) // 8 * 8)
    pdl = cfg.get("PDL", 0)
    kwargs = dict(FMT=fmt_code, EVEN=steps % B == 0, BIASED=bool(cfg.get("BIASED", False)) and w4
                  and x.dtype == torch.bfloat16, ROW_TILES=tiles, UNROLL=unroll, STAGES=stages, PDL=pdl,
                  num_warps=warps, maxnreg=regs, launch_pdl=pdl > 0)
    return _gemv_tma_kernel, grid, ints, kwargs, view

"""Flash attention forward for Hopper with a producer warp and asynchronous wgmma (CUDA sm90, Gluon).

The kernel ``flash_attention(impl="cuda")`` runs on an sm90 GPU where it applies (issue 23; the tile shapes
and measurements: benchmarks/results/h200-issue23). One program per (128 query rows, batch x head), three
partitions:

- the **producer** (one warp, 24 registers): the Q tile, then each K and V tile through TMA into a ring of
  ``STAGES`` shared-memory slots, with its own "ready" barrier for K and for V (QK^T starts before V lands)
  and its own "empty" barrier for each, which both consumers release.
- two **consumers** (a warpgroup each, 64 of the query rows each, each its own partition so that they drift
  apart and one's softmax runs while the other's products hold the tensor cores): S = Q K^T and O += P V on
  ``warpgroup_mma`` (P straight from registers), the online softmax in the log2 domain. Tile j+1's QK^T and
  tile j's PV are queued together and tile j+1's softmax runs under the PV; nothing is in flight at the end
  of an iteration (a wgmma result carried round the loop makes ptxas serialize every wgmma).

Limits (``ws_applies``; the caller takes the TMA or portable Triton kernels otherwise): bf16/fp16, head dim
64, 128 or 256, contiguous (B, H, S, D) q, k, v with 16-byte aligned bases, ``Sk`` a multiple of ``BLOCK_N`` (a
tile never crosses into the next head's keys, so only causal rows and windows need a mask). A sliding window
(``WINDOWED``, ``WINDOW`` keys a row) starts each block's key loop at the tile of its first row's first key and
masks the tiles before the block's last row's first key. Query rows past ``Sq`` (the
last block of a head) read the next head's rows and are never stored. ``out`` is contiguous (B, H, Sq, D),
the LSE (B, H, Sq) float32.
"""
from __future__ import annotations

import torch

from .common import interpreting

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

    from .pdl import pdl_launch, pdl_wait

    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 6):
        gluon = None
except Exception:  # noqa: BLE001 - no Triton, or one without Gluon's Hopper API: the path is absent
    gluon = None

__all__ = ["WS_AVAILABLE", "WS_CONFIGS", "ws_applies", "ws_flash_forward", "ws_plan"]

WS_AVAILABLE = gluon is not None
BLOCK_M = 128
_BM = gl.constexpr(BLOCK_M) if gluon is not None else BLOCK_M
_HM = gl.constexpr(BLOCK_M // 2) if gluon is not None else BLOCK_M // 2  # a warpgroup's rows
# (BLOCK_N, STAGES) per head dim: a 128 x D Q tile and STAGES x (K + V) tiles of BLOCK_N x D in shared memory
# (head dim 256: 64-key tiles, two stages, 192 KB).
WS_CONFIGS = {64: (128, 3), 128: (128, 2), 256: (64, 2)}


def ws_applies(q, k, v) -> bool:
    """Whether the kernel takes these tensors (module docstring: dtype, head dim, layout, Sk; CUDA sm90, not
    interpreted)."""
    D = q.shape[3]
    if (not WS_AVAILABLE or not q.is_cuda or interpreting() or D not in WS_CONFIGS
            or q.dtype not in (torch.bfloat16, torch.float16) or torch.cuda.get_device_capability(q.device)[0] != 9):
        return False
    return (k.shape[2] % WS_CONFIGS[D][0] == 0 and k.shape[2] > 0 and q.shape[2] > 0
            and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (q, k, v)))


if gluon is not None:

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                  q_row, kv_row, n_tiles, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem)
        for j in range(n_tiles):
            s = j % STAGES
            # a slot's first use waits on the phase before its first (complete by definition)
            phase = ((j // STAGES) & 1) ^ 1
            mbarrier.wait(k_empty.index(s), phase)
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [kv_row + j * BLOCK_N, 0], k_ready.index(s), k_smem.index(s))
            mbarrier.wait(v_empty.index(s), phase)
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [kv_row + j * BLOCK_N, 0], v_ready.index(s), v_smem.index(s))

    @gluon.jit
    def _softmax(s, m_i, l_i, start_n, qk_scale, full, row_last, row_first, head, BLOCK_N: gl.constexpr,
                 CAUSAL: gl.constexpr, WINDOWED: gl.constexpr, s_layout: gl.constexpr, p_layout: gl.constexpr,
                 DTYPE: gl.constexpr):
        """The online-softmax step (log2 domain) of the key tile at ``start_n`` on its scores ``s``: (P as the PV
        operand, the rescale of the rows so far, m, l). Causal: keys past ``row_last`` hidden in the tiles from
        ``full`` on; WINDOWED: keys before ``row_first`` hidden in the tiles before ``head``."""
        if CAUSAL:
            if start_n + BLOCK_N > full:
                offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                s = gl.where(gl.expand_dims(offs_n, 0) <= gl.expand_dims(row_last, 1), s, float("-inf"))
        if WINDOWED:
            if start_n < head:
                offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                s = gl.where(gl.expand_dims(offs_n, 0) >= gl.expand_dims(row_first, 1), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        # a row that saw no key yet keeps m = -inf: subtract 0 instead, so p = 0 and not NaN
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return gl.convert_layout(p.to(DTYPE), p_layout), alpha, m_new, l_i

    @gluon.jit
    def _consumer(q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, O, LSE, row0, m_block, SQ,
                  SK, n0, n_tiles, qk_scale, WINDOW, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr, CAUSAL: gl.constexpr, WINDOWED: gl.constexpr, WG: gl.constexpr):
        """One warpgroup's 64 query rows (WG 0 or 1 of the block) over the ``n_tiles`` key tiles from key ``n0``:
        its own partition, so the two warpgroups drift apart and one's softmax runs while the other's products
        hold the tensor cores."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        m0 = m_block + WG * _HM
        q_smem = q_smem.slice(WG * _HM, _HM)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        offs_m = m0 + gl.arange(0, _HM, layout=row_s)
        row_last = offs_m + (SK - SQ)  # causal: the last key each row sees
        full = gl.maximum(gl.minimum(m0 + SK - SQ + 1, SK), 0) // BLOCK_N * BLOCK_N  # tiles below need no mask
        # a window: each row's first key (its last one less WINDOW - 1), and the first key every row sees
        row_first = row_last
        head = 0
        if not WINDOWED:
            n0 = 0  # (a constant: the unwindowed loop's tile offsets as before)
        else:
            if CAUSAL:
                row_first = row_last - WINDOW + 1
                head = m0 + _HM - 1 + SK - SQ - WINDOW + 1
            else:
                row_first = offs_m * 0 + (SK - WINDOW)
                head = SK - WINDOW
        m_i = gl.full([_HM], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([_HM], gl.float32, layout=row_s)
        acc = gl.zeros([_HM, HEAD_DIM], gl.float32, layout=o_layout)
        s_zero = gl.zeros([_HM, BLOCK_N], gl.float32, layout=s_layout)

        mbarrier.wait(q_bar, 0)
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False)
        mbarrier.arrive(k_empty.index(0))
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, n0, qk_scale, full, row_last, row_first, head, BLOCK_N, CAUSAL,
                                      WINDOWED, s_layout, p_layout, q_smem.dtype)
        for j in range(n_tiles - 1):
            # tile j+1's QK^T and tile j's PV queued on the tensor cores; tile j+1's softmax runs under the PV.
            # Nothing is in flight at the end of an iteration (a wgmma result carried round the loop would be
            # copied while the tensor cores write it, and ptxas then serializes every wgmma).
            nxt = (j + 1) % STAGES
            mbarrier.wait(k_ready.index(nxt), ((j + 1) // STAGES) & 1)
            s = warpgroup_mma(q_smem, k_smem.index(nxt).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            slot = j % STAGES
            mbarrier.wait(v_ready.index(slot), (j // STAGES) & 1)
            acc = warpgroup_mma(p, v_smem.index(slot), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s, ))
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, n0 + (j + 1) * BLOCK_N, qk_scale, full, row_last, row_first,
                                          head, BLOCK_N, CAUSAL, WINDOWED, s_layout, p_layout, q_smem.dtype)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(k_empty.index(nxt))
            mbarrier.arrive(v_empty.index(slot))
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        last = (n_tiles - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(last), acc)

        empty_row = l_i == 0.0
        inv = 1.0 / gl.where(empty_row, 1.0, l_i)
        out = acc * gl.expand_dims(gl.convert_layout(inv, row_o), 1)
        lse = gl.where(empty_row, float("-inf"), (m_i + gl.log2(gl.where(empty_row, 1.0, l_i))) * 0.6931471805599453)
        rows_o = m0 + gl.arange(0, _HM, layout=row_o)
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        o_ptrs = O + (row0 + gl.expand_dims(rows_o, 1)).to(gl.int64) * HEAD_DIM + gl.expand_dims(cols, 0)
        gl.store(o_ptrs, out.to(v_smem.dtype), mask=gl.expand_dims(rows_o < SQ, 1))
        gl.store(LSE + row0 + offs_m, lse, mask=offs_m < SQ)

    @gluon.jit
    def _flash_ws_kernel(q_desc, k_desc, v_desc, O, LSE, H, HKV, SQ, SK, qk_scale, WINDOW,
                         HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                         CAUSAL: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr,
                         WINDOWED: gl.constexpr = False):
        pdl_wait(PDL)  # q, k and v may be the previous kernel's output
        pid_m = gl.program_id(0)
        if CAUSAL:  # the longest query blocks first, so the short ones fill the tail of the grid
            pid_m = gl.num_programs(0) - 1 - pid_m
        bh = gl.program_id(1)
        b = bh // H
        kvh = (bh % H) // (H // HKV)
        m0 = pid_m * _BM
        if CAUSAL:
            end = gl.minimum(m0 + _BM + SK - SQ, SK)
        else:
            end = SK
        n0 = 0
        if WINDOWED:  # from the tile of the block's first row's first key (the window's start, or the keys' last)
            if CAUSAL:
                n0 = gl.maximum(m0 + SK - SQ - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
            else:
                n0 = gl.maximum(SK - WINDOW, 0) // BLOCK_N * BLOCK_N
        n_tiles = gl.maximum(gl.cdiv(end - n0, BLOCK_N), 1)  # at least one tile (masked to nothing if end <= 0)

        q_smem = gl.allocate_shared_memory(q_desc.dtype, [_BM, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)  # both warpgroups release a slot
            mbarrier.init(v_empty.index(i), count=2)
        fence_async_shared()

        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, O, LSE, bh * SQ, m0,
                         SQ, SK, n0, n_tiles, qk_scale, WINDOW, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WINDOWED, 0)),
            (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, O, LSE, bh * SQ, m0,
                         SQ, SK, n0, n_tiles, qk_scale, WINDOW, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WINDOWED, 1)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                         bh * SQ + m0, (b * HKV + kvh) * SK + n0, n_tiles, BLOCK_N, STAGES)),
        ], [4, 1], [232, 24])
        pdl_launch(PDL)


def ws_plan(q, k, causal: bool, qk_scale: float, pdl_args: dict, config=None, window: int = 0):
    """How the kernel launches for one geometry, as ``attention._FlashLaunch`` keeps it: (kernel, grid, the
    descriptor views of q, k, v as ``launcher.Descriptor`` fields with their Gluon layouts, the integer
    arguments after ``out, lse``, the options). ``out`` must be contiguous (B, H, Sq, D) and ``lse``
    contiguous (B, H, Sq) float32; ``qk_scale`` is the softmax scale times log2(e); ``pdl_args``:
    ``pdl.pdl_launch_args``'s; ``config``: (BLOCK_N, STAGES) instead of the table; ``window``: 0, or a sliding
    window (``flash_attention``'s: each row sees the ``window`` keys ending at its last visible one), whose
    blocks start at the tile of their first row's first key."""
    B, H, SQ, D = q.shape
    HKV, SK = k.shape[1], k.shape[2]
    block_n, stages = config or WS_CONFIGS[D]
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], gdt)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, D], gdt)
    views = (((B * H * SQ, D), (D, 1), (BLOCK_M, D), "zero", q_layout),
             ((B * HKV * SK, D), (D, 1), (block_n, D), "zero", kv_layout),
             ((B * HKV * SK, D), (D, 1), (block_n, D), "zero", kv_layout))
    kwargs = dict(HEAD_DIM=D, BLOCK_N=block_n, STAGES=stages, CAUSAL=causal, num_warps=4, **pdl_args)
    if window:
        kwargs["WINDOWED"] = True
    return _flash_ws_kernel, (triton.cdiv(SQ, BLOCK_M), B * H), views, (H, HKV, SQ, SK, qk_scale, window), kwargs


def ws_flash_forward(q, k, v, out, lse, causal: bool, qk_scale: float, config=None, window: int = 0):
    """One plain launch (no PDL) into ``out`` / ``lse`` as :func:`ws_plan` takes them (benchmarks, A/B). Raises
    ValueError, before launching, for tensors the kernel does not take (:func:`ws_applies`) or outputs of
    another shape, dtype or layout."""
    from .launcher import Descriptor, launch

    fn = "ws_flash_forward"
    if not (q.dim() == k.dim() == v.dim() == 4 and k.shape == v.shape and q.shape[0] == k.shape[0]
            and q.shape[3] == k.shape[3] and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0
            and q.dtype == k.dtype == v.dtype and ws_applies(q, k, v)):
        raise ValueError(f"{fn}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} ({q.dtype} on {q.device}) "
                         f"are not what the kernel takes: (B, H, S, D) contiguous bf16/fp16 on an sm90 GPU, head dim "
                         f"in {sorted(WS_CONFIGS)}, H a multiple of k's heads, Sk a multiple of the key tile")
    if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous() or \
            lse.shape != q.shape[:3] or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"{fn}: out must be contiguous {tuple(q.shape)} {q.dtype} and lse contiguous "
                         f"{tuple(q.shape[:3])} float32, got {tuple(out.shape)} {out.dtype} and {tuple(lse.shape)} "
                         f"{lse.dtype}")

    fn, grid, views, ints, kwargs = ws_plan(q, k, causal, qk_scale, dict(PDL=0), config, window)
    launch(fn, grid, *(Descriptor(t, *view) for t, view in zip((q, k, v), views)), out, lse, *ints, **kwargs)
    return out, lse

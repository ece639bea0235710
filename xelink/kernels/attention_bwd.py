"""Flash attention backward in Triton (``flash_attention_backward(impl="triton")``): FlashAttention-2's two
passes, no atomics, portable (plain masked loads and ``tl.dot``, the features Intel's Triton has too).

Given the forward's LSE and ``delta`` (each row's dot product of output and output gradient, less the LSE's
gradient; ``_delta_kernel``, one launch), a row's probabilities are recomputed tile by tile as ``exp(s - lse)``:

- ``_dkdv_kernel``: one program per (key tile, batch x KV head); it walks every query tile of each q head of
  its KV head (GQA summed in the program) that can see the tile and accumulates
  ``dv += p^T dout`` and ``dk += ds^T q``, ``ds = p * (dout v^T - delta)``, computing p^T and ds^T directly
  (``s^T = k q^T``, q read transposed) so that no register tile is transposed.
- ``_dq_kernel``: one program per (query tile, batch x q head); it walks the key tiles the rows can see and
  accumulates ``dq += ds k``.

Masks follow the forward's: query i sees keys ``0 .. i + Sk - Sq`` (causal, end-aligned) or all keys, and with a
sliding window (``WINDOWED``, ``WINDOW`` keys) only the last ``WINDOW`` of those: keys after ``last - WINDOW``, last
= ``i + Sk - Sq`` (causal) or ``Sk - 1``. A windowed pass visits only the tiles some row's window reaches: dk/dv
stops its query loop after the last row whose window still reaches its key tile (non-causal: a key tile before
every window sees no query and stores zeros), dq starts its key loop at the tile of its first row's first key, so
the work is O(Sq x (window + a tile)), not O(Sq x Sk). The unwindowed kernels are compiled without any of it (a
constexpr). A row whose LSE is -inf (it sees no key anywhere) gets no gradient. The dots take p and ds rounded
to the inputs' dtype (bfloat16 / float16), accumulating in float32; the results are stored in the dtype asked for
(float32 by default).

``VARLEN`` (``flash_backward_varlen``, ``flash_attention_varlen_backward``'s kernel path): packed sequences of
different lengths, sequence b's queries and keys the rows ``CU_Q[b] ..`` / ``CU_K[b] ..`` of (total, heads, D)
tensors, the LSE and delta (Hq, total_q); each program reads its sequence's offsets and lengths, the grids are
(B x heads, tiles of the longest sequence), and a tile past its own sequence returns at once (a sequence's own tiles
store every row of its results, so the results still start empty). Compiled only where asked for (a constexpr).

Tiles (``BWD_CONFIGS``), from H100 A/Bs (``benchmarks/scripts/flash_bwd_ab.py``, results in
``benchmarks/results/h100-flash-backward``): at head dim 128, 64 x 128 key tiles for dk/dv (ptxas spills 224
bytes a thread, and they are still 1.26-1.33x faster than the spill-free 16 x 128) and 128 x 32 query tiles for
dq; at 64, the spill-free 64 x 128 and 128 x 64, the fastest there; at 256, 32 x 32 in one stage (the larger
tiles spill) over 4 warps, 1.4-1.5x faster there than 8. A one-pass variant that added dq with float32 atomics
from the dk/dv kernel (5 dots instead of 7) was no faster: 0.96-1.16x the two passes' time at head dim 128, slower
at 256 (94582cb; ``h100-flash-backward/flash_bwd_ab_onepass.log``).
"""
from __future__ import annotations

import torch

from .common import cdiv, tl, triton
from .launcher import launch
from .varlen import packed_strides

__all__ = ["BWD_CONFIGS", "flash_backward", "flash_backward_varlen"]

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head dim and pass (module docstring).
BWD_CONFIGS = {64: {"dkdv": (64, 128, 8, 2), "dq": (128, 64, 8, 2)},
               128: {"dkdv": (64, 128, 8, 2), "dq": (128, 32, 8, 2)},
               256: {"dkdv": (32, 32, 4, 1), "dq": (32, 32, 4, 1)}}
_LOG2E = 1.4426950408889634

if triton is not None:
    from .varlen import varlen_ids, varlen_sequence

    @triton.jit
    def _visible(rows, keys, SQ, SK, WINDOW, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr):
        """Which (query row, key) pairs attend, for ``rows`` and ``keys`` already broadcast against each other
        (either orientation): both in range, under CAUSAL the key at most the row's last (row + SK - SQ), and
        WINDOWED the key after that last one less WINDOW (non-causal, the last is SK - 1)."""
        keep = (keys < SK) & (rows < SQ)
        if CAUSAL:
            keep = keep & (keys <= rows + (SK - SQ))
        if WINDOWED:
            if CAUSAL:
                keep = keep & (keys > rows + (SK - SQ) - WINDOW)
            else:
                keep = keep & (keys > SK - 1 - WINDOW)
        return keep

    @triton.jit
    def _probs_and_ds(q, k, v, do, lse2, delta, offs_m, offs_n, SQ, SK, qk_scale, WINDOW, CAUSAL: tl.constexpr,
                      WINDOWED: tl.constexpr):
        """p (BLOCK_M, BLOCK_N) of the rows offs_m over keys offs_n, and ds = p * (do v^T - delta)."""
        s = tl.dot(q, tl.trans(k))
        keep = _visible(offs_m[:, None], offs_n[None, :], SQ, SK, WINDOW, CAUSAL, WINDOWED)
        p = tl.where(keep, tl.math.exp2(s * qk_scale - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        return p, ds

    @triton.jit
    def _load_rows(base, rows, n_rows, stride_row, stride_d, HEAD_DIM: tl.constexpr):
        """The (len(rows), HEAD_DIM) tile of rows ``rows`` at ``base`` (zeros past ``n_rows``)."""
        offs_d = tl.arange(0, HEAD_DIM)
        ptrs = base + rows[:, None].to(tl.int64) * stride_row + offs_d[None, :] * stride_d
        return tl.load(ptrs, mask=(rows < n_rows)[:, None], other=0.0)

    @triton.jit
    def _row_stats(LSE, DELTA, row0, offs_m, SQ):
        """The rows' LSE in log2 (+inf where -inf or past SQ: p = 0 there) and delta."""
        ok = offs_m < SQ
        lse = tl.load(LSE + row0 + offs_m, mask=ok, other=float("inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        delta = tl.load(DELTA + row0 + offs_m, mask=ok, other=0.0)
        return lse2, delta

    @triton.jit(do_not_specialize=["H", "SQ"])
    def _delta_kernel(
        O, DO, DLSE, DELTA,
        stride_ob, stride_oh, stride_om, stride_od,
        stride_gb, stride_gh, stride_gm, stride_gd,
        stride_lb, stride_lh, stride_lm,
        H, SQ,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr, VARLEN: tl.constexpr = False,
        CU_Q=None,
    ):
        """delta of BLOCK_M rows: dot(dout, out) in float32, less the LSE's gradient (stored contiguous).
        VARLEN: sequence b's rows ``CU_Q[b] .. CU_Q[b + 1]`` of the packed tensors (batch strides 0), SQ total_q
        (delta is (H, total_q), as the LSE)."""
        pid_m, _, bh = varlen_ids(VARLEN)  # VARLEN: grid (B * H, row blocks)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        if VARLEN:
            q0, _, sq, _ = varlen_sequence(CU_Q, CU_Q, b)  # (no keys here)
            row0 = h * SQ + q0
            SQ = sq
            if pid_m * BLOCK_M >= SQ:
                return
            O += q0 * stride_om
            DO += q0 * stride_gm
            DLSE += q0 * stride_lm
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        o = _load_rows(O + b * stride_ob + h * stride_oh, offs_m, SQ, stride_om, stride_od, HEAD_DIM)
        do = _load_rows(DO + b * stride_gb + h * stride_gh, offs_m, SQ, stride_gm, stride_gd, HEAD_DIM)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
        ok = offs_m < SQ
        if HAS_DLSE:
            dlse = tl.load(DLSE + b * stride_lb + h * stride_lh + offs_m.to(tl.int64) * stride_lm, mask=ok, other=0.0)
            delta -= dlse.to(tl.float32)
        if VARLEN:
            tl.store(DELTA + row0 + offs_m, delta, mask=ok)
        else:
            tl.store(DELTA + bh.to(tl.int64) * SQ + offs_m, delta, mask=ok)

    @triton.jit
    def _load_cols(base, rows, n_rows, stride_row, stride_d, HEAD_DIM: tl.constexpr):
        """The rows ``rows`` at ``base`` as a transposed (HEAD_DIM, len(rows)) tile (zeros past ``n_rows``)."""
        offs_d = tl.arange(0, HEAD_DIM)
        ptrs = base + rows[None, :].to(tl.int64) * stride_row + offs_d[:, None] * stride_d
        return tl.load(ptrs, mask=(rows < n_rows)[None, :], other=0.0)

    @triton.jit(do_not_specialize=["HKV", "GROUP", "SQ", "SK", "WINDOW"])
    def _dkdv_kernel(
        Q, K, V, DO, LSE, DELTA, DK, DV,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_ob, stride_oh, stride_om, stride_od,
        HKV, GROUP, SQ, SK, scale, qk_scale, WINDOW,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
        WINDOWED: tl.constexpr = False, VARLEN: tl.constexpr = False, CU_Q=None, CU_K=None,
    ):
        # Everything in the key-major orientation: s^T = k q^T (BLOCK_N, BLOCK_M), so the dots that accumulate dv
        # and dk take p^T and ds^T as computed (no transpose of a register tile); q comes in transposed.
        # VARLEN: sequence b's queries and keys are rows CU_Q[b].. / CU_K[b].. of the packed tensors (batch strides
        # 0), SQ is total_q (LSE and delta are (H, total_q)); dk, dv are (total_k, HKV, D). A key tile past its
        # sequence's keys returns: it holds no row (the tiles of a sequence's keys store all of them).
        pid_n, _, bh = varlen_ids(VARLEN)  # VARLEN: grid (B * HKV, key tiles)
        b = (bh // HKV).to(tl.int64)
        kvh = (bh % HKV).to(tl.int64)
        n0 = pid_n * BLOCK_N
        if VARLEN:
            q0, k0, sq, sk = varlen_sequence(CU_Q, CU_K, b)
            total_q = SQ
            SQ, SK = sq, sk
            if n0 >= SK:
                return
            Q += q0 * stride_qm
            K += k0 * stride_kn
            V += k0 * stride_vn
            DO += q0 * stride_om
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        ok_n = (offs_n < SK)[:, None]
        k = _load_rows(K + b * stride_kb + kvh * stride_kh, offs_n, SK, stride_kn, stride_kd, HEAD_DIM)
        v = _load_rows(V + b * stride_vb + kvh * stride_vh, offs_n, SK, stride_vn, stride_vd, HEAD_DIM)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        m_lo = 0
        if CAUSAL:  # rows before n0 - (SK - SQ) see none of these keys
            m_lo = tl.maximum(n0 - (SK - SQ), 0) // BLOCK_M * BLOCK_M
        m_hi = SQ
        if WINDOWED:
            if CAUSAL:  # row i's window starts at key i + SK - SQ - WINDOW + 1: the rows from
                # n0 + BLOCK_N + WINDOW - 1 - (SK - SQ) on start past the tile's last key
                m_hi = tl.minimum(tl.maximum(n0 + BLOCK_N + WINDOW - 1 - (SK - SQ), 0), SQ)
            elif n0 + BLOCK_N <= SK - WINDOW:  # every row's window starts at key SK - WINDOW: none sees this tile
                m_hi = 0
        for g in range(GROUP):
            h = kvh * GROUP + g
            if VARLEN:
                row0 = h * total_q + q0
            else:
                row0 = (b * HKV * GROUP + h) * SQ
            for m0 in range(m_lo, m_hi, BLOCK_M):
                offs_m = m0 + tl.arange(0, BLOCK_M)
                qT = _load_cols(Q + b * stride_qb + h * stride_qh, offs_m, SQ, stride_qm, stride_qd, HEAD_DIM)
                do = _load_rows(DO + b * stride_ob + h * stride_oh, offs_m, SQ, stride_om, stride_od, HEAD_DIM)
                lse2, delta = _row_stats(LSE, DELTA, row0, offs_m, SQ)
                keep = _visible(offs_m[None, :], offs_n[:, None], SQ, SK, WINDOW, CAUSAL,
                                WINDOWED)  # (BLOCK_N, BLOCK_M)
                pT = tl.where(keep, tl.math.exp2(tl.dot(k, qT) * qk_scale - lse2[None, :]), 0.0)
                dv = tl.dot(pT.to(do.dtype), do, dv)
                dsT = pT * (tl.dot(v, tl.trans(do)) - delta[None, :])
                dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk)
        if VARLEN:
            out = ((k0 + offs_n[:, None]) * HKV + kvh) * HEAD_DIM + offs_d[None, :]
        else:
            out = (b * HKV + kvh) * SK * HEAD_DIM + offs_n[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :]
        tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=ok_n)
        tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=ok_n)

    @triton.jit(do_not_specialize=["H", "GROUP", "SQ", "SK", "WINDOW"])
    def _dq_kernel(
        Q, K, V, DO, LSE, DELTA, DQ,
        stride_qb, stride_qh, stride_qm, stride_qd,
        stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd,
        stride_ob, stride_oh, stride_om, stride_od,
        H, GROUP, SQ, SK, scale, qk_scale, WINDOW,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
        WINDOWED: tl.constexpr = False, VARLEN: tl.constexpr = False, CU_Q=None, CU_K=None,
    ):
        # VARLEN: as _dkdv_kernel's; dq is (total_q, H, D); a query tile past its sequence's queries returns.
        pid_m, _, bh = varlen_ids(VARLEN)  # VARLEN: grid (B * H, query tiles)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        kvh = h // GROUP
        m0 = pid_m * BLOCK_M
        if VARLEN:
            q0, k0, sq, sk = varlen_sequence(CU_Q, CU_K, b)
            row0 = h * SQ + q0
            SQ, SK = sq, sk
            if m0 >= SQ:
                return
            Q += q0 * stride_qm
            K += k0 * stride_kn
            V += k0 * stride_vn
            DO += q0 * stride_om
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        ok_m = (offs_m < SQ)[:, None]
        q = _load_rows(Q + b * stride_qb + h * stride_qh, offs_m, SQ, stride_qm, stride_qd, HEAD_DIM)
        do = _load_rows(DO + b * stride_ob + h * stride_oh, offs_m, SQ, stride_om, stride_od, HEAD_DIM)
        if not VARLEN:
            row0 = bh.to(tl.int64) * SQ
        lse2, delta = _row_stats(LSE, DELTA, row0, offs_m, SQ)
        end = SK
        if CAUSAL:  # no row of this tile sees keys past its last row's
            end = tl.minimum(tl.maximum(m0 + BLOCK_M + (SK - SQ), 0), SK)
        lo = 0
        if WINDOWED:  # from the tile of the first row's first key: no row of this tile sees keys before it
            if CAUSAL:
                lo = tl.maximum(m0 + (SK - SQ) - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
            else:
                lo = tl.maximum(SK - WINDOW, 0) // BLOCK_N * BLOCK_N
        dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for n0 in range(lo, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            k = _load_rows(K + b * stride_kb + kvh * stride_kh, offs_n, SK, stride_kn, stride_kd, HEAD_DIM)
            v = _load_rows(V + b * stride_vb + kvh * stride_vh, offs_n, SK, stride_vn, stride_vd, HEAD_DIM)
            p, ds = _probs_and_ds(q, k, v, do, lse2, delta, offs_m, offs_n, SQ, SK, qk_scale, WINDOW, CAUSAL,
                                  WINDOWED)
            dq = tl.dot(ds.to(k.dtype), k, dq)
        if VARLEN:
            rows = ((q0 + offs_m[:, None]) * H + h) * HEAD_DIM
        else:
            rows = row0 * HEAD_DIM + offs_m[:, None].to(tl.int64) * HEAD_DIM
        tl.store(DQ + rows + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=ok_m)


def _delta_block(D: int) -> int:
    """Rows a ``_delta_kernel`` program takes."""
    return 64 if D <= 128 else 32


def varlen_tiles(D: int, max_q: int, max_k: int) -> int:
    """The most tiles ``flash_backward_varlen``'s passes put on their grids' second dimension (a sequence's query or
    key tiles), for sequences of at most ``max_q`` queries and ``max_k`` keys at head dim ``D``."""
    return max(cdiv(max_q, _delta_block(D)), cdiv(max_k, BWD_CONFIGS[D]["dkdv"][1]),
               cdiv(max_q, BWD_CONFIGS[D]["dq"][0]))


def flash_backward(dout, q, k, v, out, lse, dlse, causal: bool, scale: float, dtype=torch.float32, window: int = 0):
    """(dq, dk, dv) in ``dtype``, contiguous: delta (one launch), then the two passes (arguments checked by the
    caller; ``lse`` float32 ``(B, Hq, Sq)``, contiguous; ``dlse`` None or any floating ``(B, Hq, Sq)``; ``window``
    0 (none) or the sliding window's keys, as the forward's). Every row of each result is stored (a row with
    nothing to add gets zeros), so they start empty."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if B == 0 or Sq == 0 or Sk == 0:
        return (torch.zeros((B, Hq, Sq, D), dtype=dtype, device=q.device),
                *(torch.zeros((B, Hkv, Sk, D), dtype=dtype, device=q.device) for _ in range(2)))
    delta = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
    block = _delta_block(D)
    dl = lse if dlse is None else dlse  # without a dlse, any (B, Hq, Sq) tensor stands in: HAS_DLSE=False reads none
    launch(_delta_kernel, (cdiv(Sq, block), B * Hq), out, dout, dl, delta, *out.stride(), *dout.stride(), *dl.stride(),
           Hq, Sq, HEAD_DIM=D, BLOCK_M=block, HAS_DLSE=dlse is not None, num_warps=4)
    dq = torch.empty((B, Hq, Sq, D), dtype=dtype, device=q.device)
    dk = torch.empty((B, Hkv, Sk, D), dtype=dtype, device=q.device)
    dv = torch.empty((B, Hkv, Sk, D), dtype=dtype, device=q.device)
    strides = (*q.stride(), *k.stride(), *v.stride(), *dout.stride())
    qk_scale = scale * _LOG2E

    def opts(kind):
        block_m, block_n, warps, stages = BWD_CONFIGS[D][kind]
        kw = dict(HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=bool(causal), num_warps=warps,
                  num_stages=stages)
        if window:  # (passed only when set: the unwindowed launch keeps its keywords)
            kw["WINDOWED"] = True
        return kw

    o = opts("dkdv")  # launcher.launch: Triton's JIT call without its tens of microseconds of host time
    launch(_dkdv_kernel, (cdiv(Sk, o["BLOCK_N"]), B * Hkv), q, k, v, dout, lse, delta, dk, dv, *strides, Hkv, Hq // Hkv,
           Sq, Sk, scale, qk_scale, window, **o)
    o = opts("dq")
    launch(_dq_kernel, (cdiv(Sq, o["BLOCK_M"]), B * Hq), q, k, v, dout, lse, delta, dq, *strides, Hq, Hq // Hkv, Sq,
           Sk, scale, qk_scale, window, **o)
    return dq, dk, dv



def flash_backward_varlen(dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q: int, max_k: int, causal: bool,
                          scale: float, dtype=torch.float32, window: int = 0):
    """``flash_backward`` of packed sequences (``flash_attention_varlen_backward``'s kernel path): q, dout, out
    (total_q, Hq, D), k, v (total_k, Hkv, D), any strides; ``lse`` float32 (Hq, total_q) contiguous; ``dlse`` None
    or any floating (Hq, total_q); ``cu_q`` / ``cu_k`` the sequences' row offsets (B + 1, on the device), ``max_q`` /
    ``max_k`` at least the longest sequence's lengths (grids (B x heads, tiles of those): a tile past its own
    sequence returns); the offsets may be strided views (the kernels get a contiguous copy).
    Returns (dq (total_q, Hq, D), dk, dv (total_k, Hkv, D)) in ``dtype``, contiguous. Every row of each result is
    still stored (each row belongs to a sequence, whose tiles store all their rows: zeros where nothing adds), so
    they start empty, as ``flash_backward``'s."""
    total_q, Hq, D = q.shape
    total_k, Hkv = k.shape[0], k.shape[1]
    B = cu_q.shape[0] - 1
    if total_q == 0 or total_k == 0:
        return (torch.zeros((total_q, Hq, D), dtype=dtype, device=q.device),
                *(torch.zeros((total_k, Hkv, D), dtype=dtype, device=q.device) for _ in range(2)))
    max_q, max_k = max(int(max_q), 1), max(int(max_k), 1)
    cu_q, cu_k = cu_q.contiguous(), cu_k.contiguous()  # the kernels read offset b at CU + b: no strided view

    delta = torch.empty((Hq, total_q), dtype=torch.float32, device=q.device)
    block = _delta_block(D)
    dl = lse if dlse is None else dlse
    launch(_delta_kernel, (B * Hq, cdiv(max_q, block)), out, dout, dl, delta, *packed_strides(out),
           *packed_strides(dout), 0, dl.stride(0), dl.stride(1), Hq, total_q, HEAD_DIM=D, BLOCK_M=block,
           HAS_DLSE=dlse is not None, VARLEN=True, CU_Q=cu_q, num_warps=4)
    dq = torch.empty((total_q, Hq, D), dtype=dtype, device=q.device)
    dk = torch.empty((total_k, Hkv, D), dtype=dtype, device=q.device)
    dv = torch.empty((total_k, Hkv, D), dtype=dtype, device=q.device)
    strides = (*packed_strides(q), *packed_strides(k), *packed_strides(v), *packed_strides(dout))
    qk_scale = scale * _LOG2E

    def opts(kind):
        block_m, block_n, warps, stages = BWD_CONFIGS[D][kind]
        kw = dict(HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=bool(causal), VARLEN=True, CU_Q=cu_q, CU_K=cu_k,
                  num_warps=warps, num_stages=stages)
        if window:
            kw["WINDOWED"] = True
        return kw

    o = opts("dkdv")
    launch(_dkdv_kernel, (B * Hkv, cdiv(max_k, o["BLOCK_N"])), q, k, v, dout, lse, delta, dk, dv, *strides, Hkv,
           Hq // Hkv, total_q, total_k, scale, qk_scale, window, **o)
    o = opts("dq")
    launch(_dq_kernel, (B * Hq, cdiv(max_q, o["BLOCK_M"])), q, k, v, dout, lse, delta, dq, *strides, Hq, Hq // Hkv,
           total_q, total_k, scale, qk_scale, window, **o)
    return dq, dk, dv

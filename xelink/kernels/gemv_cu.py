"""The W4A16 GEMV on ``tile_w4a16``'s tiles in CUDA C++ (``gemv(config=dict(KERNEL="cu"))``, fmt ``"w4a16t"``,
1-8 rows, bf16 or fp16): compiled at first use by NVRTC (``torch.cuda._compile_kernel``) and launched through the
CUDA driver (``cuLaunchKernelEx``), with programmatic dependent launch on sm90.

Why a second kernel: the Gluon tensor-core kernel (``gemv_tc.py``) reads W4A16 at 1.5-2.8 TB/s in the decode
step, waiting on memory with too few bytes in flight (benchmarks/results/h200-issue26: ncu, the sweeps). Here
the loads, their batching and the registers they take are written out:

- A program owns one 16-row block of W (``act``: a gate block and its up block, half the warps each); its warps
  split the block's 128-column groups (one tile of 1 KB each) evenly and add their sums through shared memory.
- A lane loads 16 bytes of row ``r`` and 16 of row ``r + 8`` of a tile (lane = 4 r + q; 32 columns from 32 q):
  exactly the rows the ``mma.m16n8k16`` A fragment gives that lane, in batches of ``UNROLL`` tiles loaded into
  registers (the default; ``PIPE``: the next batch's before this one's math). The PTX issues a batch's loads first;
  ptxas moves each next to its first use (sm_90 SASS of ``UNROLL=4``: about one tile a warp ahead), and the many
  resident warps (16 a program up to 4096 rows) keep the bytes in flight. ``STAGES`` copies batches into shared
  memory with ``cp.async`` instead, ``STAGES - 1`` in flight (each lane reads back its own bytes, so no barrier):
  slower in every shape of the first sweep (an H100: fewer programs resident).
- A 32-bit word of nibbles j = 0..7 (column j) is four A registers: ``lop3`` puts nibbles j and j + 4 under the
  16-bit 128.0 (bf16; fp16: 1024.0) and one packed fma removes 136 (1032), exact. A K-step of 16 takes the pairs
  (j, j + 4) of two such shifts, so no weight moves between registers; the activations (B fragment, the lane's 32
  columns of row ``min(r, M - 1)``) are paired to match by ``prmt``. The sum of a tile is scaled by its rows'
  scales in fp32.
- Under PDL (sm90) the first programs ask L2 for their first batch (``cp.async.bulk.prefetch.L2``, a hint: every
  load that counts comes after ``griddepcontrol.wait``) within ``pdl.prefetch_bytes``; the program waits, and lets
  the next kernel go at once ("early") or after its loop ("late").

- ``RMS`` (``gemv_norm.gemv_rms``): after its first batch's loads each program also sums ``h^2`` over each row of
  ``h`` (16-byte pieces, in L2: the kernel before wrote it) and scales its sums by ``rsqrt(mean + eps)`` at the end;
  ``RES`` (``gemv_norm.gemv_residual``): warp 0 reads its outputs' residual values (and the next norm's weights)
  before the loop, and its store adds the rounded sum into the residual in place (and writes the new residual times
  the weight). So an RMSNorm between two GEMVs needs no launch of its own.

Sums run in another order than the tensor-core kernel's: results agree within rounding, not bit for bit.
"""
from __future__ import annotations

import ctypes
import functools

import torch

__all__ = ["CU_AVAILABLE", "CuLaunch", "check_cu_config", "cu_available", "cu_config"]

CU_AVAILABLE = hasattr(torch.cuda, "_compile_kernel")  # torch >= 2.8's NVRTC front door
UNROLLS = (1, 2, 4, 8)
WARPS = (1, 2, 4, 8, 16)  # (act: 2 or more, a half for gate and one for up)
STAGES = (0, 2, 3, 4, 5, 6)
SMEM_MAX = 200 * 1024  # a program's stages at most (sm90 gives a block up to 227 KB)

SOURCE = r"""
#if FP16
#define MAGIC 0x64006400u
#define BIAS 0xE408E408u
#define ONE 0x3C003C00u
#define MMA "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
#define FMA2 "fma.rn.f16x2"
#define TO_F32 "cvt.f32.f16"
#define FROM_F32 "cvt.rn.f16.f32"
#else
#define MAGIC 0x43004300u
#define BIAS 0xC308C308u
#define ONE 0x3F803F80u
#define MMA "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
#define FMA2 "fma.rn.bf16x2"
#define TO_F32 "cvt.f32.bf16"
#define FROM_F32 "cvt.rn.bf16.f32"
#endif
typedef unsigned short u16;

__device__ __forceinline__ uint4 ld_w(const unsigned char* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ uint4 ld_x(const u16* p) {
    uint4 v;
    asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ float to_f32(u16 h) {
    float f;
    asm(TO_F32 " %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 from_f32(float f) {
    u16 h;
    asm(FROM_F32 " %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
// nibbles j and j + 4 of u (bits 0-3 and 16-19) as the pair (n_j - 8, n_{j+4} - 8): OR-ed under MAGIC, BIAS added
__device__ __forceinline__ unsigned dq(unsigned u) {
    unsigned t, r;
    asm("lop3.b32 %0, %1, 0x000F000F, %2, 0xEA;" : "=r"(t) : "r"(u), "r"(MAGIC));
    asm(FMA2 " %0, %1, %2, %3;" : "=r"(r) : "r"(t), "r"(ONE), "r"(BIAS));
    return r;
}
__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned s) {
    unsigned r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
    return r;
}
__device__ __forceinline__ void mma(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                    unsigned b1) {
    asm(MMA " {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// One 32-bit word of rows r (u) and r + 8 (v), columns c0..c7: two K-steps; x holds their activations as the
// pairs (c0,c1) (c2,c3) (c4,c5) (c6,c7).
__device__ __forceinline__ void word(float* d, unsigned u, unsigned v, uint4 x) {
    const unsigned x04 = prmt(x.x, x.z, 0x5410), x15 = prmt(x.x, x.z, 0x7632);
    const unsigned x26 = prmt(x.y, x.w, 0x5410), x37 = prmt(x.y, x.w, 0x7632);
    mma(d, dq(u), dq(v), dq(u >> 4), dq(v >> 4), x04, x15);
    mma(d, dq(u >> 8), dq(v >> 8), dq(u >> 12), dq(v >> 12), x26, x37);
}
#if STAGES
__device__ __forceinline__ void cp16(unsigned dst, const unsigned char* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ uint4 ld_s(unsigned a) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a)
                 : "memory");
    return v;
}
// Batch b's tiles (those below ng) copied into stage slot s of the warp's shared memory; one commit group.
__device__ __forceinline__ void stage(unsigned sbase, const unsigned char* wp, int b, int s, int ng) {
#pragma unroll
    for (int t = 0; t < UNROLL; ++t) {
        const int c = b * UNROLL + t;
        if (c < ng) {
            const unsigned d = sbase + (s * UNROLL + t) * 1024;
            cp16(d, wp + c * 1024);
            cp16(d + 512, wp + c * 1024 + 512);
        }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}
#endif
// One tile (group g of the warp's run): its sum for rows r, r + 8 (columns n = 2q, 2q + 1) scaled into acc.
__device__ __forceinline__ void tile(float* acc, uint4 a, uint4 b, const u16* xg, const u16* sg, int s8) {
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    word(d, a.x, b.x, ld_x(xg));
    word(d, a.y, b.y, ld_x(xg + 8));
    word(d, a.z, b.z, ld_x(xg + 16));
    word(d, a.w, b.w, ld_x(xg + 24));
    const float s0 = to_f32(sg[0]), s1 = to_f32(sg[s8]);
    acc[0] = fmaf(s0, d[0], acc[0]); acc[1] = fmaf(s0, d[1], acc[1]);
    acc[2] = fmaf(s1, d[2], acc[2]); acc[3] = fmaf(s1, d[3], acc[3]);
}

#if RMS
// the sum of the squares of 8 activations (16 bytes of h)
__device__ __forceinline__ float sq8(uint4 v) {
    const unsigned u[4] = {v.x, v.y, v.z, v.w};
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float a = to_f32((u16)(u[i] & 0xFFFFu)), b = to_f32((u16)(u[i] >> 16));
        s = fmaf(a, a, fmaf(b, b, s));
    }
    return s;
}
// The warp's share of each row's sum of h^2 into rss[warp][m]: rows two at a time, 16-byte pieces two a row at a
// time (four loads in flight a lane; h is in L2, the kernel before wrote it). Called after the first weights' loads.
__device__ __forceinline__ void rms_sums(float (*rss)[8], const u16* h, int ldh, int K, int M, int warp, int lane) {
    const int step = WARPS * 256;
    for (int m0 = 0; m0 < M; m0 += 2) {
        const u16* h0 = h + (size_t)m0 * ldh;
        const u16* h1 = m0 + 1 < M ? h0 + ldh : h0;  // (M odd: row m0 again, its sum dropped)
        float s0 = 0.f, s1 = 0.f;
        for (int k = (warp * 32 + lane) * 8; k < K; k += 2 * step) {
            const bool two = k + step < K;
            const uint4 a0 = ld_x(h0 + k), a1 = ld_x(h1 + k);
            const uint4 b0 = two ? ld_x(h0 + k + step) : make_uint4(0u, 0u, 0u, 0u);
            const uint4 b1 = two ? ld_x(h1 + k + step) : make_uint4(0u, 0u, 0u, 0u);
            s0 += sq8(a0) + sq8(b0);
            s1 += sq8(a1) + sq8(b1);
        }
#pragma unroll
        for (int o = 16; o; o >>= 1) {
            s0 += __shfl_xor_sync(0xFFFFFFFFu, s0, o);
            s1 += __shfl_xor_sync(0xFFFFFFFFu, s1, o);
        }
        if (lane == 0) {
            rss[warp][m0] = s0;
            if (m0 + 1 < M) rss[warp][m0 + 1] = s1;
        }
    }
}
#endif

// y[m, n] = sum_k x[m, k] (nibble - 8) scale[n, k / 128] over W's tiles; grid.x: 16-row blocks (ACT: pairs).
// RMS: each row's sums times rsqrt(mean_k h[m, k]^2 + eps) (before ACT's rounding); RES (not with ACT): the rounded
// y added into h[m, n] in place (rounded, as rmsnorm's residual add), and (RES 2) y = the new h[m, n] times gw[n]
// (rounded: the next RMSNorm's input before its 1 / rms, which an RMS launch applies).
extern "C" __global__ void __launch_bounds__(WARPS * 32) xelink_w4_gemv(
        const unsigned char* __restrict__ w, const u16* __restrict__ x, const u16* __restrict__ sc,
        u16* __restrict__ y, int N, int K, int M, int ldy, int ssn, int prefetch_programs, u16* h,
        const u16* __restrict__ gw, int ldh, float eps) {
    extern __shared__ uint4 smem[];  // STAGES: [WARPS][STAGES][UNROLL][2 halves][32 lanes] 16 bytes; then the sums
    float (*red)[32][4] = (float (*)[32][4])(smem + WARPS * STAGES * UNROLL * 64);
#if RMS
    float (*rss)[8] = (float (*)[8])(red + WARPS);  // each warp's sums of squares of rows 0..7
#endif
    const int G = K >> 7, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, q = lane & 3, r = lane >> 2;
#if ACT  // the first half of the warps on gate block b, the rest on up block b + N / 32
    const int parts = WARPS / 2, wk = warp % parts;
    const int rb = blockIdx.x + (warp >= parts ? (N >> 5) : 0);
#else
    const int parts = WARPS, wk = warp, rb = blockIdx.x;
#endif
    const int g0 = (int)((long long)G * wk / parts), ng = (int)((long long)G * (wk + 1) / parts) - g0;
    const unsigned char* wt = w + ((size_t)rb * G + g0) * 1024;
    const unsigned char* wp = wt + r * 64 + q * 16;
    const u16* xp = x + (size_t)min(r, M - 1) * K + g0 * 128 + q * 32;
    const u16* sp = sc + (size_t)(rb * 16 + r) * ssn + g0;
    const int s8 = 8 * ssn;
#if PDL  // 1: the next kernel goes at once ("early"); 2: after this kernel's loop ("late")
    if ((int)blockIdx.x < prefetch_programs && lane == 0 && ng > 0) {
        const unsigned bytes = (ng < UNROLL ? ng : UNROLL) * 1024;
        asm volatile("{\n.reg .b64 a;\ncvta.to.global.u64 a, %0;\ncp.async.bulk.prefetch.L2.global [a], %1;\n}"
                     :: "l"(wt), "r"(bytes) : "memory");
    }
    asm volatile("griddepcontrol.wait;" ::: "memory");
#if PDL == 1
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
#endif
#if RES  // the epilogue's residual values (and norm weights), read now, two to a register: their latency hidden
    unsigned hv[2] = {0u, 0u}, gv = 0u;  // hv[c]: rows 2 q, 2 q + 1 of column rb * 16 + r + 8 c; gv: both columns
    if (warp == 0) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int m = 2 * q + (i & 1);
            if (m < M) hv[i >> 1] |= (unsigned)h[(size_t)m * ldh + rb * 16 + r + (i >> 1) * 8] << (16 * (i & 1));
        }
#if RES == 2
        gv = (unsigned)gw[rb * 16 + r] | (unsigned)gw[rb * 16 + r + 8] << 16;
#endif
    }
#endif
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#if STAGES  // batches of UNROLL tiles copied into shared memory, STAGES - 1 in flight (each lane reads back its own)
    unsigned sbase;
    asm("{\n.reg .u64 a;\ncvta.to.shared.u64 a, %1;\ncvt.u32.u64 %0, a;\n}" : "=r"(sbase) : "l"(smem));
    sbase += (warp * STAGES * UNROLL * 64 + lane) * 16;
    const int nb = (ng + UNROLL - 1) / UNROLL;
#pragma unroll
    for (int b = 0; b < STAGES - 1; ++b) stage(sbase, wp, b, b, ng);
#if RMS
    rms_sums(rss, h, ldh, K, M, warp, lane);
#endif
#pragma unroll 1
    for (int b = 0; b < nb; ++b) {
        const int slot = b % STAGES;
        stage(sbase, wp, b + STAGES - 1, (b + STAGES - 1) % STAGES, ng);
        asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 1) : "memory");
#pragma unroll
        for (int t = 0; t < UNROLL; ++t) {
            const int c = b * UNROLL + t;
            if (c < ng) {
                const unsigned a = sbase + (slot * UNROLL + t) * 1024;
                tile(acc, ld_s(a), ld_s(a + 512), xp + c * 128, sp + c, s8);
            }
        }
    }
#else  // batches of UNROLL tiles loaded into registers (PIPE: the next batch's loads before this one's math)
    int c = 0;
#if RMS
    if (ng < UNROLL) rms_sums(rss, h, ldh, K, M, warp, lane);
#endif
    if (ng >= UNROLL) {
        uint4 wa[UNROLL], wb[UNROLL];
#pragma unroll
        for (int t = 0; t < UNROLL; ++t) { wa[t] = ld_w(wp + t * 1024); wb[t] = ld_w(wp + t * 1024 + 512); }
#if RMS
        rms_sums(rss, h, ldh, K, M, warp, lane);
#endif
#pragma unroll 1
        for (;;) {
            const bool more = c + 2 * UNROLL <= ng;
#if PIPE
            uint4 na[UNROLL], nb[UNROLL];
            if (more) {
#pragma unroll
                for (int t = 0; t < UNROLL; ++t) {
                    na[t] = ld_w(wp + (c + UNROLL + t) * 1024);
                    nb[t] = ld_w(wp + (c + UNROLL + t) * 1024 + 512);
                }
            }
#endif
#pragma unroll
            for (int t = 0; t < UNROLL; ++t) tile(acc, wa[t], wb[t], xp + (c + t) * 128, sp + c + t, s8);
            c += UNROLL;
            if (!more) break;
#pragma unroll
            for (int t = 0; t < UNROLL; ++t) {
#if PIPE
                wa[t] = na[t]; wb[t] = nb[t];
#else
                wa[t] = ld_w(wp + (c + t) * 1024); wb[t] = ld_w(wp + (c + t) * 1024 + 512);
#endif
            }
        }
    }
#pragma unroll 1
    for (; c < ng; ++c) tile(acc, ld_w(wp + c * 1024), ld_w(wp + c * 1024 + 512), xp + c * 128, sp + c, s8);
#endif
#if PDL == 2
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
#pragma unroll
    for (int i = 0; i < 4; ++i) red[warp][lane][i] = acc[i];
    __syncthreads();
    if (warp) return;
#if RMS  // lane 4 r + q stores rows 2 q and 2 q + 1
    float rs[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        float t = 0.f;
#pragma unroll
        for (int v = 0; v < WARPS; ++v) t += rss[v][min(2 * q + j, M - 1)];
        rs[j] = rsqrtf(t / (float)K + eps);
    }
#endif
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] = 0.f;
#pragma unroll
    for (int v = 0; v < parts; ++v)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] += red[v][lane][i];
#if ACT
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // each sum rounded to the output dtype first, as the GEMV then silu_mul
        float up = 0.f;
#pragma unroll
        for (int v = parts; v < WARPS; ++v) up += red[v][lane][i];
#if RMS
        acc[i] *= rs[i & 1];
        up *= rs[i & 1];
#endif
        const float g = to_f32(from_f32(acc[i])), u = to_f32(from_f32(up));
        acc[i] = g / (1.f + __expf(-g)) * u;
    }
    const int n0 = blockIdx.x * 16 + r;
#else
    const int n0 = rb * 16 + r;
#if RMS
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] *= rs[i & 1];
#endif
#endif
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int m = 2 * q + (i & 1);
        if (m < M) {
            const int n = n0 + (i >> 1) * 8;
            u16 o = from_f32(acc[i]);
#if RES
            const u16 hn = from_f32(to_f32(o) + to_f32((u16)(hv[i >> 1] >> (16 * (i & 1)))));
            h[(size_t)m * ldh + n] = hn;
#if RES == 2
            o = from_f32(to_f32(hn) * to_f32((u16)(gv >> (16 * (i >> 1)))));
#endif
#endif
            y[(size_t)m * ldy + n] = o;
        }
    }
}
"""


def cu_available(device: torch.device) -> bool:
    """Whether the kernel can run on ``device``: torch's NVRTC front door and a CUDA GPU of compute capability
    >= 8.0 (bf16 ``mma``)."""
    if not CU_AVAILABLE or device.type != "cuda" or torch.version.cuda is None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def cu_config(M: int, N: int, K: int, act: bool) -> dict:
    """Default warps and batches, from the first sweep of Llama-3.1-8B's one-row GEMVs in the step's chain (an H100,
    benchmarks/results/h100-gpu-tests/s37_cu_chain_sweep.log): the tiles in registers (every ``STAGES`` lost there),
    16 warps of 1 tile a batch up to 4096 rows (O 4.59 us, down 11.86, against the tensor-core kernel's 5.33 and
    13.97), 8 warps of 2 up to 8192 (QKV 6.06 against 6.99), 4 warps of 4 above (gate/up 22.34 against 23.04; with
    ``act`` 22.37 against the GEMV and silu_mul's 24.42)."""
    rows = N // 2 if act else N
    warps, unroll = (16, 1) if rows <= 4096 else (8, 2) if rows <= 8192 else (4, 4)
    per_warp = max(1, (K // 128) // (warps // 2 if act else warps))
    return dict(num_warps=warps, UNROLL=min(unroll, 1 << (per_warp.bit_length() - 1)), PIPE=False, STAGES=0)


def check_cu_config(cfg: dict, M: int, N: int, K: int, act: bool) -> dict:
    """``cfg`` (KERNEL popped) checked and completed by :func:`cu_config`'s values for this shape (PIPE given
    without STAGES: the registers): num_warps, UNROLL, PIPE, STAGES. ValueError naming gemv."""
    unknown = sorted(set(cfg) - {"num_warps", "UNROLL", "PIPE", "STAGES"})
    if unknown:
        raise ValueError(f"gemv: config KERNEL='cu' takes num_warps, UNROLL, PIPE and STAGES, not "
                         f"{', '.join(unknown)}")
    out = cu_config(M, N, K, act)
    if cfg.get("PIPE") and "STAGES" not in cfg:
        out["STAGES"] = 0
    out.update(cfg)
    if out["num_warps"] not in WARPS or act and out["num_warps"] < 2:
        raise ValueError(f"gemv: config KERNEL='cu' num_warps={out['num_warps']!r} must be one of {WARPS} (2 or "
                         f"more with act: a half of them for gate, one for up)")
    if out["UNROLL"] not in UNROLLS:
        raise ValueError(f"gemv: config KERNEL='cu' UNROLL={out['UNROLL']!r} must be one of {UNROLLS}")
    if not isinstance(out["PIPE"], bool):
        raise ValueError(f"gemv: config KERNEL='cu' PIPE={out['PIPE']!r} must be True or False")
    if out["STAGES"] not in STAGES:
        raise ValueError(f"gemv: config KERNEL='cu' STAGES={out['STAGES']!r} must be 0 (registers) or 2-6")
    if out["PIPE"] and out["STAGES"]:
        raise ValueError("gemv: config KERNEL='cu' takes PIPE (registers) or STAGES (shared memory), not both")
    if smem_bytes(out["num_warps"], out["UNROLL"], out["STAGES"]) > SMEM_MAX:
        raise ValueError(f"gemv: config KERNEL='cu' num_warps={out['num_warps']} x UNROLL={out['UNROLL']} x "
                         f"STAGES={out['STAGES']} KB of stages pass {SMEM_MAX >> 10} KB a program")
    return out


@functools.lru_cache(maxsize=None)
def _kernel(device_index: int, warps: int, unroll: int, pipe: bool, stages: int, act: bool, fp16: bool, pdl: int,
            rms: bool = False, res: int = 0):
    """The compiled kernel for these constants (``pdl``: 0 off, 1 early, 2 late; ``rms``, ``res``: the kernel's
    RMS and RES, :class:`CuLaunch`), loaded on device ``device_index``."""
    major, minor = torch.cuda.get_device_capability(device_index)
    head = "".join(f"#define {k} {int(v)}\n" for k, v in
                   dict(WARPS=warps, UNROLL=unroll, PIPE=pipe, STAGES=stages, ACT=act, FP16=fp16, PDL=pdl, RMS=rms,
                        RES=res).items())
    with torch.cuda.device(device_index):
        kernel = torch.cuda._compile_kernel(head + SOURCE, "xelink_w4_gemv", compute_capability=f"{major}{minor}")
    smem = smem_bytes(warps, unroll, stages)
    if smem > 48 * 1024:  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        rc = _libcuda().cuFuncSetAttribute(kernel.func, 8, smem)
        if rc:
            raise RuntimeError(f"gemv: cuFuncSetAttribute({smem} bytes of shared memory) failed (CUresult {rc})")
    return kernel


@functools.lru_cache(maxsize=1)
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def smem_bytes(warps: int, unroll: int, stages: int) -> int:
    """A program's shared memory: its warps' stages of tiles (1 KB each), then the warps' sums (and sums of
    squares)."""
    return warps * stages * unroll * 1024 + warps * 32 * 4 * 4 + warps * 8 * 4


class _AttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("i", ctypes.c_int)]


class _Attr(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte value
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint), ("bx", ctypes.c_uint),
                ("by", ctypes.c_uint), ("bz", ctypes.c_uint), ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("nattrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_...


class CuLaunch:
    """One launch, prepared from the shapes (``N`` rows of W, ``[gate; up]`` with ``act``), the config, the dtype,
    y's row stride and the scales' row stride; a call fills in the addresses and the current stream.

    ``rms``: each row's sums scaled by ``rsqrt(mean(h[m]^2) + eps)`` (``h [M, K]``, row stride ``ldh``; before
    ``act``'s rounding); ``res`` (not with ``act``): 1, the rounded y added into ``h [M, N]`` in place (rounded);
    2, that and y returned as the new ``h`` times ``g [N]`` (rounded)."""

    __slots__ = ("kernel", "config", "attr", "ptrs", "params", "device", "lib")

    def __init__(self, device: torch.device, N: int, K: int, M: int, cfg: dict, act: bool, fp16: bool, pdl: int,
                 ldy: int, ssn: int, prefetch: int, rms: bool = False, res: int = 0, ldh: int = 0,
                 eps: float = 0.0):
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        warps = cfg["num_warps"]
        self.kernel = _kernel(index, warps, cfg["UNROLL"], cfg["PIPE"], cfg["STAGES"], act, fp16, pdl, rms, res)
        self.lib = _libcuda()
        self.attr = _Attr()
        self.attr.id = _PROGRAMMATIC_STREAM_SERIALIZATION
        self.attr.value.i = 1
        programs = N // (32 if act else 16)
        self.config = _Config(programs, 1, 1, 32 * warps, 1, 1, smem_bytes(warps, cfg["UNROLL"], cfg["STAGES"]),
                              None, ctypes.pointer(self.attr) if pdl else None, 1 if pdl else 0)
        # the programs whose warps ask L2 for their first batch within ``prefetch`` bytes
        parts = warps // 2 if act else warps
        first = warps * min(max(1, (K // 128) // parts), cfg["UNROLL"]) * 1024
        prefetch_programs = min(programs, prefetch // first)
        self.ptrs = [ctypes.c_void_p() for _ in range(6)]
        ints = [ctypes.c_int(v) for v in (N, K, M, ldy, ssn, prefetch_programs)]
        values = self.ptrs[:4] + ints + self.ptrs[4:] + [ctypes.c_int(ldh), ctypes.c_float(eps)]
        self.params = ((ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p)
                                                         for v in values]), values)

    def __call__(self, w: torch.Tensor, x: torch.Tensor, scales: torch.Tensor, y: torch.Tensor, h=None,
                 g=None) -> torch.Tensor:
        """y = the GEMV (``act``: its silu_mul) of contiguous ``w``, ``x`` (16-byte aligned) and ``scales``;
        ``h`` (``rms``: 16-byte aligned rows), ``g``: as the launch was made for."""
        for slot, t in zip(self.ptrs, (w, x, scales, y, h, g)):
            slot.value = None if t is None else t.data_ptr()
        self.config.stream = torch.cuda.current_stream(self.device).cuda_stream
        rc = self.lib.cuLaunchKernelEx(ctypes.byref(self.config), self.kernel.func, self.params[0], None)
        if rc:
            raise RuntimeError(f"gemv: the CUDA C++ W4A16 kernel's launch failed (CUresult {rc})")
        return y

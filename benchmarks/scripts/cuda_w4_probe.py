"""Probe (issue 26, W4A16 <= 1.8 ms): a CUDA C++ W4A16 GEMV on the "w4a16t" tiles, compiled with NVRTC
(torch.cuda._compile_kernel) and launched through the driver (cuLaunchKernelEx, PDL optional), against
xelink's kept Gluon kernel on Llama-3.1-8B's four projection shapes, 32 layers' weights in one CUDA graph
(as gemv_chain_sweep.py times them). Each warp owns one 16-row block's run of 128-column groups; a lane
loads 16 bytes of row r and of row r + 8 a group (the mma A fragment's rows), so a group is two 16-byte
loads a lane, with U groups' loads issued before any math; nibbles become bf16 by lop3 into 128.0 and one
packed fma (exact), the columns of a lane's 16 bytes paired so that no weight moves between registers, and
the activations are paired to match by prmt. Warps of a program split K and add through shared memory.

python3 benchmarks/scripts/cuda_w4_probe.py [shape,...]   (qkv, o, gate_up (also with silu_mul), down)
"""
import ctypes
import statistics
import sys

import torch

from xelink.bench.harness import time_cuda_events
from xelink.bench.kernel_timing import cuda_graph
from xelink.kernels import gemv
from xelink.kernels.gemv import pack_w4a16, reference_gemv, tile_w4a16
from xelink.kernels.norm import reference_silu_mul

LAYERS = 32
SHAPES = [(6144, 4096, "qkv"), (4096, 4096, "o"), (28672, 4096, "gate_up"), (4096, 14336, "down")]

SOURCE = r"""
#ifndef WARPS
#define WARPS 8
#endif
__device__ __forceinline__ uint4 ldw(const unsigned char* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ uint4 ldx(const unsigned short* p) {
    uint4 v;
    asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
// nibbles j and j + 4 of u (bits 0-3, 16-19) as the bf16 pair (n_j - 8, n_{j+4} - 8): OR-ed under 128.0, then -136
__device__ __forceinline__ unsigned dq(unsigned u) {
    unsigned t, r;
    asm("lop3.b32 %0, %1, 0x000F000F, 0x43004300, 0xEA;" : "=r"(t) : "r"(u));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(t), "r"(0x3F803F80u), "r"(0xC308C308u));
    return r;
}
__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned s) {
    unsigned r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
    return r;
}
__device__ __forceinline__ void mma(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                    unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// One 32-bit word of rows r (u) and r + 8 (v): 8 columns c0..c7 (nibble j = column j), two k-steps of 16 over the
// quad; x holds the same columns' activations as bf16 pairs (c0,c1) (c2,c3) (c4,c5) (c6,c7).
__device__ __forceinline__ void word(float* d, unsigned u, unsigned v, uint4 x) {
    const unsigned x04 = prmt(x.x, x.z, 0x5410), x15 = prmt(x.x, x.z, 0x7632);
    const unsigned x26 = prmt(x.y, x.w, 0x5410), x37 = prmt(x.y, x.w, 0x7632);
    mma(d, dq(u), dq(v), dq(u >> 4), dq(v >> 4), x04, x15);
    mma(d, dq(u >> 8), dq(v >> 8), dq(u >> 12), dq(v >> 12), x26, x37);
}
__device__ __forceinline__ float bf(unsigned short h) { return __uint_as_float(((unsigned)h) << 16); }
__device__ __forceinline__ unsigned short f2bf(float f) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// y[m, n] = sum_k x[m, k] * (nibble - 8) * scale[n, k / 128]; grid.x = N / 16 row blocks, WARPS warps a program,
// warp w takes GPW groups from w * GPW; U groups' weights loaded before their math.
extern "C" __global__ void __launch_bounds__(WARPS * 32) w4gemv(
        const unsigned char* __restrict__ w, const unsigned short* __restrict__ x,
        const unsigned short* __restrict__ sc, unsigned short* __restrict__ y, int N, int K, int M) {
    __shared__ float red[WARPS][32][4];
    const int G = K >> 7, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, q = lane & 3, r = lane >> 2;
#if ACT  // silu(gate) * up: the first half of the warps on gate block b, the rest on up block b + N / 32
    const int rb = blockIdx.x + (warp >= WARPS / 2 ? (N >> 5) : 0), g0 = (warp % (WARPS / 2)) * GPW;
#else
    const int rb = blockIdx.x, g0 = warp * GPW;
#endif
    const unsigned char* wp = w + ((size_t)rb * G + g0) * 1024 + r * 64 + q * 16;
    const unsigned short* xp = x + (size_t)min(r, M - 1) * K + g0 * 128 + q * 32;
    const unsigned short* sp = sc + (size_t)(rb * 16 + r) * G + g0;
    uint4 wa[U], wb[U];
#pragma unroll
    for (int t = 0; t < U; ++t) { wa[t] = ldw(wp + t * 1024); wb[t] = ldw(wp + t * 1024 + 512); }
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
#endif
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
    for (int c = 0; c < GPW; c += U) {
#if PIPE
        uint4 na[U], nb[U];  // the next U groups' weights in flight during this U's math
        if (c + U < GPW) {
#pragma unroll
            for (int t = 0; t < U; ++t) { na[t] = ldw(wp + (c + U + t) * 1024); nb[t] = ldw(wp + (c + U + t) * 1024 + 512); }
        }
#endif
#pragma unroll
        for (int t = 0; t < U; ++t) {
            const unsigned short* xg = xp + (c + t) * 128;
            float d[4] = {0.f, 0.f, 0.f, 0.f};
            word(d, wa[t].x, wb[t].x, ldx(xg));
            word(d, wa[t].y, wb[t].y, ldx(xg + 8));
            word(d, wa[t].z, wb[t].z, ldx(xg + 16));
            word(d, wa[t].w, wb[t].w, ldx(xg + 24));
            const float s0 = bf(sp[c + t]), s1 = bf(sp[c + t + 8 * G]);
            acc[0] = fmaf(s0, d[0], acc[0]); acc[1] = fmaf(s0, d[1], acc[1]);
            acc[2] = fmaf(s1, d[2], acc[2]); acc[3] = fmaf(s1, d[3], acc[3]);
        }
        if (c + U < GPW) {
#pragma unroll
            for (int t = 0; t < U; ++t) {
#if PIPE
                wa[t] = na[t]; wb[t] = nb[t];
#else
                wa[t] = ldw(wp + (c + U + t) * 1024); wb[t] = ldw(wp + (c + U + t) * 1024 + 512);
#endif
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) red[warp][lane][i] = acc[i];
    __syncthreads();
    if (warp) return;
#if ACT
    float up[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w2 = 1; w2 < WARPS / 2; ++w2)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] += red[w2][lane][i];
#pragma unroll
    for (int w2 = WARPS / 2; w2 < WARPS; ++w2)
#pragma unroll
        for (int i = 0; i < 4; ++i) up[i] += red[w2][lane][i];
    const int n0 = blockIdx.x * 16 + r, ldy = N >> 1;
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // each sum rounded to bf16 first, as the GEMV then silu_mul computes
        const float g = bf(f2bf(acc[i])), u = bf(f2bf(up[i]));
        acc[i] = g / (1.f + __expf(-g)) * u;
    }
#else
#pragma unroll
    for (int w2 = 1; w2 < WARPS; ++w2)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] += red[w2][lane][i];
    const int n0 = rb * 16 + r, ldy = N;
#endif
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int m = 2 * q + (i & 1), n = n0 + (i >> 1) * 8;
        if (m < M) y[(size_t)m * ldy + n] = f2bf(acc[i]);
    }
}
"""


class _AttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("i", ctypes.c_int)]


class _Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class _Config(ctypes.Structure):
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint), ("bx", ctypes.c_uint),
                ("by", ctypes.c_uint), ("bz", ctypes.c_uint), ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("nattrs", ctypes.c_uint)]


_LIBCUDA = None


def compile_variant(warps, gpw, u, pdl, pipe=False, act=False):
    src = (f"#define WARPS {warps}\n#define GPW {gpw}\n#define U {u}\n#define PDL {int(pdl)}\n#define PIPE {int(pipe)}\n"
           f"#define ACT {int(act)}\n" + SOURCE)
    return torch.cuda._compile_kernel(src, "w4gemv", compute_capability="90a")


def launch(kern, warps, pdl, w, x, s, y, n, k, m, act=False):
    global _LIBCUDA
    if _LIBCUDA is None:
        _LIBCUDA = torch.cuda._utils._get_gpu_runtime_library()
    attr = _Attr()
    attr.id = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.i = 1
    cfg = _Config(n // (32 if act else 16), 1, 1, warps * 32, 1, 1, 0, torch.cuda.current_stream().cuda_stream,
                  ctypes.pointer(attr) if pdl else None, 1 if pdl else 0)
    vals = [ctypes.c_void_p(t.data_ptr()) for t in (w, x, s, y)] + [ctypes.c_int(v) for v in (n, k, m)]
    params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in vals])
    rc = _LIBCUDA.cuLaunchKernelEx(ctypes.byref(cfg), kern.func, params, None)
    if rc:
        raise RuntimeError(f"cuLaunchKernelEx: CUresult {rc}")


def variants(k, act=False):
    """(warps, groups a warp, groups a load batch, PDL, next batch in flight during the math, act)."""
    g = k // 128
    out = []
    for warps in (4, 8, 16):
        split = warps // 2 if act else warps  # warps along K of one row block
        if split == 0 or g % split:
            continue
        gpw = g // split
        for u in (1, 2, 4, 7):
            if gpw % u == 0:
                out += [(warps, gpw, u, True, pipe, act) for pipe in (False, True)[:1 + (gpw > u)]]
    return out


def func_attr(kern, attr):
    value = ctypes.c_int()
    torch.cuda._utils._get_gpu_runtime_library().cuFuncGetAttribute(ctypes.byref(value), attr, kern.func)
    return value.value


def graph_us(calls):
    graph, _, _ = cuda_graph(calls, 1)
    return statistics.median(time_cuda_events(graph.replay, warmup=3, iters=20)) * 1e6 / len(calls)


def sweep(name, ws, x, act):
    (n, k), m = ws[0][0].shape, x.shape[0]
    k *= 2
    nbytes = sum(t.numel() * t.element_size() for t in ws[0])
    what = f"{name}{'+silu_mul' if act else ''} {n}x{k} M={m}"
    xact = "silu_mul" if act else None
    ref = reference_gemv(ws[0][0], x, ws[0][1], "w4a16t").float()
    if act:
        ref = reference_silu_mul(ref.to(torch.bfloat16)).float()
    kept = graph_us([lambda w=w, s=s: gemv(w, x, s, "w4a16t", "cuda", act=xact) for w, s in ws])
    err = float((gemv(ws[0][0], x, ws[0][1], "w4a16t", "cuda", act=xact).float() - ref).norm() / ref.norm())
    print(f"{what} xelink kept: {kept:6.2f} us ({nbytes / kept / 1e3:5.0f} GB/s) err {err:.1e}", flush=True)
    rows = [(kept, "kept")]
    extra = [(8, k // 128 // 8, 4, False, False, act)] if k == 4096 and not act else []
    for warps, gpw, u, pdl, pipe, act in variants(k, act) + extra:
        tag = f"cuda w{warps} gpw{gpw} u{u} pdl{int(pdl)} pipe{int(pipe)}"
        try:
            kern = compile_variant(warps, gpw, u, pdl, pipe, act)
            ys = [torch.empty(m, n // 2 if act else n, device=x.device, dtype=torch.bfloat16) for _ in ws]
            launch(kern, warps, pdl, ws[0][0], x, ws[0][1], ys[0], n, k, m, act)
            err = float((ys[0].float() - ref).norm() / ref.norm())
            us = graph_us([lambda w=w, s=s, yy=yy: launch(kern, warps, pdl, w, x, s, yy, n, k, m, act)
                           for (w, s), yy in zip(ws, ys)])
        except Exception as e:  # noqa: BLE001 - a variant that fails is a row
            print(f"{what} {tag}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        rows.append((us, tag))
        print(f"{what} {tag} ({func_attr(kern, 4)} regs, {func_attr(kern, 3)} B local): {us:6.2f} us "
              f"({nbytes / us / 1e3:5.0f} GB/s) err {err:.1e}{'  WRONG' if err > 1e-2 else ''}", flush=True)
    best = min(rows)
    print(f"{what}: best {best[0]:.2f} us {best[1]} (kept {kept:.2f}, {kept / best[0]:.2f}x)", flush=True)


def main():
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else None
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(5)
    print(torch.cuda.get_device_name(0), flush=True)
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    sec = statistics.median(time_cuda_events(lambda: dst.copy_(src), warmup=3, iters=10))
    print(f"copy ceiling: {2 * src.numel() / sec / 1e12:.2f} TB/s (bytes read + written)", flush=True)
    src = dst = None
    for n, k, name in SHAPES:
        if names and name not in names:
            continue
        ws = []
        for _ in range(LAYERS):
            w = torch.randn(n, k, device=dev, generator=gen) * 0.02
            p, s = pack_w4a16(w, torch.bfloat16)
            ws.append((tile_w4a16(p), s))
            del w, p
        x = torch.randn(1, k, device=dev, generator=gen).to(torch.bfloat16)
        sweep(name, ws, x, False)
        if name == "gate_up":
            sweep(name, ws, x, True)
        del ws


if __name__ == "__main__":
    main()

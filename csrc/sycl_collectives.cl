// xelink's SYCL collective kernels (OpenCL C 1.2), built by xelink.symm.sycl once per (context, device).
//
// reduce_<dtype>_<op>(d, s0..s7, k, n): d[i] = s0[i] op s1[i] op ... op s{k-1}[i] for i < n, 1 <= k <= 8.
// Sources are separate pointer arguments rather than a table of addresses so that every USM pointer a
// kernel touches is a kernel argument (a GPU runtime tracks those; indirect USM access needs extra flags).
// Unused sources are passed as s0 and never read. d may equal s0 (each work-item reads before it writes).
// 16-bit floats are stored as 16-bit words and reduced in float32, rounded to nearest even once at the end.

inline float bf16_load(__global const ushort* p, size_t i) { return as_float(((uint)p[i]) << 16); }
inline void bf16_store(__global ushort* p, size_t i, float v) {
    uint u = as_uint(v);
    if (isnan(v)) { p[i] = (ushort)((u >> 16) | 0x40u); return; }
    u += 0x7fffu + ((u >> 16) & 1u);
    p[i] = (ushort)(u >> 16);
}

#define TY_f32 float
#define TY_f16 half
#define TY_bf16 ushort
#define TY_i32 int
#define TY_i64 long
#define ACC_f32 float
#define ACC_f16 float
#define ACC_bf16 float
#define ACC_i32 int
#define ACC_i64 long
#define LD_f32(p, i) ((p)[i])
#define LD_f16(p, i) vload_half((i), (p))
#define LD_bf16(p, i) bf16_load((p), (i))
#define LD_i32(p, i) ((p)[i])
#define LD_i64(p, i) ((p)[i])
#define ST_f32(p, i, v) ((p)[i] = (v))
#define ST_f16(p, i, v) vstore_half_rte((v), (i), (p))
#define ST_bf16(p, i, v) bf16_store((p), (i), (v))
#define ST_i32(p, i, v) ((p)[i] = (v))
#define ST_i64(p, i, v) ((p)[i] = (v))
#define OP_sum(a, b) ((a) + (b))
/* NaN wins, whichever source holds it (as numpy's and torch's max/min): a != a only for a NaN (never for ints) */
#define OP_max(a, b) (((a) > (b) || (a) != (a)) ? (a) : (b))
#define OP_min(a, b) (((a) < (b) || (a) != (a)) ? (a) : (b))

#define STEP(T, O, j) if (k > j) a = OP_##O(a, LD_##T(s##j, i));

#define DEF_REDUCE(T, O)                                                                                  \
__kernel void reduce_##T##_##O(__global TY_##T* d, __global const TY_##T* s0, __global const TY_##T* s1,  \
                               __global const TY_##T* s2, __global const TY_##T* s3,                    \
                               __global const TY_##T* s4, __global const TY_##T* s5,                    \
                               __global const TY_##T* s6, __global const TY_##T* s7, uint k, ulong n) {  \
    size_t i = get_global_id(0);                                                                          \
    if (i >= n) return;                                                                                   \
    ACC_##T a = LD_##T(s0, i);                                                                            \
    STEP(T, O, 1) STEP(T, O, 2) STEP(T, O, 3) STEP(T, O, 4) STEP(T, O, 5) STEP(T, O, 6) STEP(T, O, 7)    \
    ST_##T(d, i, a);                                                                                      \
}

#define DEF_OPS(T) DEF_REDUCE(T, sum) DEF_REDUCE(T, max) DEF_REDUCE(T, min)
DEF_OPS(f32)
DEF_OPS(f16)
DEF_OPS(bf16)
DEF_OPS(i32)
DEF_OPS(i64)

// copy_<w>(d, s, n): n words of w bytes; the host picks the widest w that divides both addresses and the
// length. Used where a queue memcpy cannot run (between two devices' allocations: xelink.symm.sycl).
#define DEF_COPY(W, T) \
__kernel void copy_##W(__global T* d, __global const T* s, ulong n) { size_t i = get_global_id(0); if (i < n) d[i] = s[i]; }
DEF_COPY(1, uchar)
DEF_COPY(2, ushort)
DEF_COPY(4, uint)
DEF_COPY(8, ulong)

// The device barrier, in two kernels so that every arrival is enqueued before any wait spins (kernels on
// one CPU OpenCL device run one at a time: a spinning wait would hold back the arrivals queued after it).
// words: [0, n) arrival epochs, one per rank; [n] the abort word the host sets at the deadline;
// [n + 1 + r] rank r's outcome (1: everyone arrived, 2: aborted, 3: spin bound reached).
__kernel void barrier_arrive(__global volatile int* words, int rank, int epoch) {
    atomic_xchg(&words[rank], epoch);
}

__kernel void barrier_wait(__global volatile int* words, int rank, int n, int epoch, ulong max_spins) {
    ulong spins = 0;
    for (;;) {
        int all = 1;
        for (int j = 0; j < n; j++) {
            if (atomic_or(&words[j], 0) - epoch < 0) { all = 0; break; }
        }
        if (all) { atomic_xchg(&words[n + 1 + rank], 1); return; }
        if (atomic_or(&words[n], 0) != 0) { atomic_xchg(&words[n + 1 + rank], 2); return; }
        if (++spins >= max_spins) { atomic_xchg(&words[n + 1 + rank], 3); return; }
    }
}

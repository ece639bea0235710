"""A/B on one GPU: decode attention in CUDA graphs (caches rotated past L2) and eager host time (the GPU kept
busy by two 8192^3 GEMMs, 20 calls timed, median of 30 rounds, interleaved), the one-launch kernel (this
tree) against the two-launch one of 7c5172a (split kernel + merge kernel) and SDPA's default. The old module
is read from git into an untracked file first (do not commit it):

    git show 7c5172a:xelink/kernels/attention.py > xelink/kernels/_old_attention.py
    PYTHONPATH=$PWD python3 benchmarks/scripts/decode_ab.py; rm xelink/kernels/_old_attention.py
"""
import math, time, torch
import torch.nn.functional as F
from xelink.kernels import attention as new
from xelink.kernels import _old_attention as old

def graph_time(fn, reps, iters=20):
    for i in range(reps): fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [fn(i) for i in range(reps)]
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        e0.record()
        for _ in range(iters): g.replay()
        e1.record(); torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / (iters * reps))
    return sorted(ts)[2], outs

for b, s in [(1, 8192), (1, 32768), (1, 131072), (8, 32768)]:
    hq, hkv, d = 32, 8, 128
    reps = max(1, min(16, math.ceil((512 << 20) / (2 * b * hkv * s * d * 2))))
    qs = [torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16) for _ in range(reps)]
    ks = [torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(reps)]
    vs = [torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(reps)]
    lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    row = {}
    for name, fn in (("new", lambda i: new.decode_attention(qs[i], ks[i], vs[i], lens, impl="triton")),
                     ("old", lambda i: old.decode_attention(qs[i], ks[i], vs[i], lens, impl="triton")),
                     ("sdpa", lambda i: F.scaled_dot_product_attention(qs[i], ks[i], vs[i], enable_gqa=True))):
        t, outs = graph_time(fn, reps)
        ref = F.scaled_dot_product_attention(qs[0].float(), ks[0].float(), vs[0].float(), enable_gqa=True)
        err = float((outs[0].float() - ref).norm() / ref.norm())
        row[name] = (t, err)
    print(f"B={b} S={s}: " + ", ".join(f"{k} {v[0]:.2f} us (err {v[1]:.1e})" for k, v in row.items())
          + f"; new/old {row['old'][0] / row['new'][0]:.3f}x, sdpa/new {row['sdpa'][0] / row['new'][0]:.3f}")
# eager host time with the GPU busy (a long kernel queued first), interleaved
q, k, v = qs[0][:1], ks[0][:1, :, :4096].contiguous(), vs[0][:1, :, :4096].contiguous()
l1 = torch.full((1,), 4096, dtype=torch.int32, device="cuda")
fns = {"new": lambda: new.decode_attention(q, k, v, l1, impl="triton"),
       "old": lambda: old.decode_attention(q, k, v, l1, impl="triton"),
       "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)}
for f in fns.values(): f()
big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
host = {n: [] for n in fns}
for _ in range(30):
    for n, f in fns.items():
        torch.cuda.synchronize(); big @ big; big @ big
        t0 = time.perf_counter()
        for _ in range(20): f()
        host[n].append((time.perf_counter() - t0) / 20 * 1e6)
torch.cuda.synchronize()
print("host us per eager call (median): " + ", ".join(f"{n} {sorted(v)[15]:.1f}" for n, v in host.items()))

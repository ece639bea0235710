# One-off: the TMA variant with one box a program (fewest mbarrier/CTA barriers) against the default.
import sys
sys.path.insert(0, ".")
import xelink.bench.kernels as B
def sweep(N, K, fmt, M, s):
    if fmt != "w4a16":
        return
    for box in (2, 4, 8):
        yield dict(KERNEL="tc", ROW_TILES=1, num_warps=4, UNROLL=1, SPLIT=1, TMA=box)
    yield dict(KERNEL="tc", ROW_TILES=1, num_warps=4, UNROLL=2, SPLIT=1)
    yield dict(KERNEL="tc", ROW_TILES=1, num_warps=4, UNROLL=1, SPLIT=1)
B._gemv_sweep = sweep
rep = B._Report(None)
for rnd in range(2):
    B.run_gemv(rep, shapes=[(128256, 4096), (4096, 4096)], rows=(1,), rounds=3, sweep="x")
print(B.format_table(rep.rows))

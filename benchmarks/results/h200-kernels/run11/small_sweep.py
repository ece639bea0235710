import sys, torch
import xelink.bench.kernels as B
from xelink.kernels.gemv import split_k
SMS = torch.cuda.get_device_properties(0).multi_processor_count
TILES = {
    ("bf16", 8): [("mma", t) for t in [(16, 128, 4, 3), (16, 128, 4, 4), (32, 128, 4, 3), (32, 128, 4, 4), (16, 256, 4, 4), (32, 256, 2, 3), (16, 256, 2, 3)]],
    ("w4a16", 1): [("words", t) for t in [(4, 512, 1, 1), (4, 256, 1, 1), (8, 256, 1, 1), (8, 1024, 1, 1), (8, 512, 2, 1), (16, 1024, 2, 1)]],
    ("w8a16", 1): [("fma", (2, 1024, 4, 3)), ("fma", (4, 512, 4, 3)), ("fma", (2, 2048, 4, 3)), ("words", (8, 1024, 2, 1)), ("words", (4, 512, 1, 1))],
}
def sweep(N, K, fmt, M):
    for kernel, (bn, bk, w, st) in TILES.get((fmt, M), []):
        yield dict(KERNEL=kernel, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st, SPLIT_K=split_k(N, K, bn, bk, SMS, w))
B._gemv_sweep = sweep
sys.argv = ["kernels", "--only", "gemv", "--sweep", "gemv", "--out", sys.argv[1], "--commit", open(".commit").read().strip()]
B.GEMV_SHAPES = ((4096, 4096), (4096, 14336))
B.main()

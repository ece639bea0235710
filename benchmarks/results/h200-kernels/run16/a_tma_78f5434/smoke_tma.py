import torch, sys
sys.path.insert(0, ".")
from xelink.kernels.gemv import gemv, pack_w4a16, pack_w8a16, unpack_w4a16, unpack_w8a16
torch.manual_seed(0)
for N, K in ((4096, 4096), (300, 1024), (4096, 14336)):
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.05
    for fmt, pack, unpack in (("w4a16", pack_w4a16, unpack_w4a16), ("w8a16", pack_w8a16, unpack_w8a16)):
        q, s = pack(w)
        for M in (1, 8):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ unpack(q, s).T
            for box in (1, 2, 4):
                y = gemv(q, x, s, fmt, "cuda", config=dict(KERNEL="tc", TMA=box))
                torch.cuda.synchronize()
                err = ((y.float() - ref).norm() / ref.norm()).item()
                print(N, K, fmt, M, box, f"{err:.2e}", flush=True)
                assert err < 1e-2
print("SMOKE OK")

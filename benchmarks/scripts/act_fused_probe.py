"""Where gemv(act="silu_mul") with the SiLU in the tensor-core kernel (gemv.TC_ACT_FUSED, off by default) differs
from the GEMV then silu_mul on tiled W4A16 weights (the H100 run at 0aedc40 failed
test_gpu_tiled_w4_tensor_core_kernel's bit-for-bit checks of it): over seeds, the count of outputs differing from the
GEMV without a K split then silu_mul (the kernel with act never splits K) and from the GEMV as tc_config completes the
config (which may split K: the test's reference), and how many of the GEMV's own sums the split changes.

    PYTHONPATH=$PWD python3 benchmarks/scripts/act_fused_probe.py
"""
import torch

import xelink.kernels.gemv as G
from xelink.kernels import gemv, pack_w4a16, silu_mul, tile_w4a16


def main() -> None:
    dev = torch.device("cuda", 0)
    print(torch.cuda.get_device_name(0), flush=True)
    G.TC_ACT_FUSED = True
    configs = [dict(KERNEL="tc", **G.TC_ACT_TILES), dict(KERNEL="tc", ROW_TILES=2, num_warps=8, UNROLL=1),
               dict(KERNEL="tc", ROW_TILES=4, num_warps=4, UNROLL=2, BIASED=True)]
    for dtype in (torch.bfloat16, torch.float16):
        for seed in range(6):
            gen = torch.Generator(device=dev).manual_seed(seed)
            w = torch.randn(4096, 4096, device=dev, generator=gen)
            q, s = pack_w4a16(w * 0.05, dtype)
            t = tile_w4a16(q)
            x = torch.randn(2, 4096, device=dev, generator=gen).to(dtype)
            for cfg in configs:
                split = gemv(q, x, s, "w4a16", config=cfg)  # the test's reference: tc_config may split K
                y = gemv(q, x, s, "w4a16", config={**cfg, "SPLIT": 1})  # [2, 4096]: gate | up, K not split
                want = silu_mul(y, impl="triton")
                g, u = y[:, :2048].float(), y[:, 2048:].float()
                torch_want = (g / (1.0 + torch.exp(-g)) * u).to(dtype)
                got = gemv(t, x, s, "w4a16t", config=cfg, act="silu_mul")
                bad = (got != want).nonzero()
                ulp = ((got.float() - want.float()).abs() / torch.finfo(dtype).eps
                       / want.float().abs().clamp_min(torch.finfo(dtype).tiny)).max().item()
                line = (f"{str(dtype)[6:]} seed {seed} {cfg}: {len(bad)} of {got.numel()} differ from the unsplit "
                        f"GEMV then silu_mul (max {ulp:.2f} ulp-ish), "
                        f"{int((got != silu_mul(split, impl='triton')).sum())} from the split-K one's, sums split vs "
                        f"not {int((split != y).sum())}; silu_mul vs torch {int((want != torch_want).sum())}")
                for r, c in bad[:3].tolist():
                    line += (f"\n    [{r},{c}] g={y[r, c].item()!r} u={y[r, 2048 + c].item()!r} "
                             f"fused={got[r, c].item()!r} silu_mul={want[r, c].item()!r} "
                             f"torch={torch_want[r, c].item()!r}")
                print(line, flush=True)
    G.TC_ACT_FUSED = False


if __name__ == "__main__":
    main()

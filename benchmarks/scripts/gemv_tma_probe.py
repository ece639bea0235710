"""Where the TMA GEMV (``gemv_tma.py``) goes wrong, if it does: for each configuration, W4A16 and bf16 weights of
4096 rows (256 row tiles: programs take one tile or several) and K = 4096 / 14336, against float64; the relative
error, the share of wrong outputs, which row tiles hold them (and whether those are the tiles a program took after
its first), and whether three runs give the same bits. Rows of a program's later tiles going wrong alone is what a
stage released too early looked like on the H100 (the first run, 5109e47).

python3 benchmarks/scripts/gemv_tma_probe.py
"""
import importlib

import torch

from xelink.kernels import gemv
from xelink.kernels.common import sm_count
from xelink.kernels.gemv import pack_w4a16, unpack_w4a16

gemv_mod = importlib.import_module("xelink.kernels.gemv")


def _tma(st, nw, un, rt=1, pr=1):
    return dict(KERNEL="tc", TMA=st, ROW_TILES=rt, num_warps=nw, UNROLL=un, PROGRAMS=pr)


CONFIGS = {"bf16": [_tma(3, 4, 2), _tma(2, 4, 2, pr=2), _tma(3, 8, 1), _tma(2, 8, 2), _tma(3, 4, 4),
                    _tma(2, 4, 2, rt=2)],
           "w4a16": [_tma(4, 4, 4), _tma(4, 4, 2, pr=2), _tma(6, 4, 2, pr=3), _tma(4, 8, 2), _tma(3, 4, 4, rt=2, pr=2),
                     _tma(4, 4, 1)]}


def main():
    dev = torch.device("cuda", 0)
    print(torch.cuda.get_device_name(0), flush=True)
    sms = sm_count(dev)
    gen = torch.Generator(device=dev).manual_seed(11)
    for fmt, cfgs in CONFIGS.items():
        for N, K in ((4096, 4096), (4096, 14336)):
            w = torch.randn(N, K, device=dev, generator=gen) * 0.05
            if fmt == "w4a16":
                q, s = pack_w4a16(w, torch.bfloat16)
                exact = unpack_w4a16(q, s).double()
            else:
                q, s = w.to(torch.bfloat16), None
                exact = q.double()
            x = torch.randn(1, K, device=dev, generator=gen).to(torch.bfloat16)
            ref = x.double() @ exact.T
            for cfg in cfgs:
                plan = gemv_mod._GemvLaunch(q, x, s, fmt, cfg, True, "auto", None, False)
                if plan.views is None:
                    print(f"{fmt} {N}x{K} {cfg}: the TMA kernel was not planned", flush=True)
                    continue
                runs = [gemv(q, x, s, fmt, "cuda", config=cfg) for _ in range(3)]
                torch.cuda.synchronize()
                y = runs[0].double()
                err = float((y - ref).norm() / ref.norm())
                bad = ((y - ref).abs() > 0.02 * ref.abs().max()).reshape(-1)
                bn = 16 * cfg["ROW_TILES"]
                tiles = sorted({int(i) // bn for i in bad.nonzero().reshape(-1).tolist()})
                grid = plan.grid[0]
                later = sum(t >= grid for t in tiles)
                same = all(torch.equal(r, runs[0]) for r in runs[1:])
                print(f"{fmt} {N}x{K} {cfg}: grid {grid} ({sms} SMs), rel err {err:.2e}, wrong outputs "
                      f"{int(bad.sum())}/{N} in {len(tiles)} tiles ({later} of them a program's later tiles; first "
                      f"{tiles[:8]}), 3 runs bit-equal: {same}{'  WRONG' if err > 1e-2 else ''}", flush=True)


if __name__ == "__main__":
    main()

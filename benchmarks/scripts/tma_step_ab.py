"""The TMA GEMV (``gemv_tma.py``) in the decode step (issue 26): for each GEMV shape of the Llama-3.1-8B step (qkv, o,
gate_up, down, head), the kept configuration and the TMA candidates are timed as the step calls them (32 calls over
the layers' own weights in one CUDA graph; the head once), every output checked against the kept one's; then the
whole step's graph (``DecodeGraph``) with the kept GEMVs, with the TMA kernel where it beat the kept one by more
than 1%, and with the TMA kernel everywhere, captured on their own and replayed interleaved; the next tokens and
the logits compared. bf16 at 1K and 8K of context, W4A16 at 1K (random weights).

python3 benchmarks/scripts/tma_step_ab.py [bf16|w4a16 ...]
"""
import functools
import gc
import importlib
import statistics
import sys

import torch

from xelink.bench.families.decode import _fill_caches
from xelink.bench.harness import co_measure, time_cuda_events
from xelink.bench.kernel_timing import cuda_graph
from xelink.kernels import gemv
from xelink.models import Llama
from xelink.models.llama import DecodeGraph

gemv_mod = importlib.import_module("xelink.kernels.gemv")
CONTEXTS = {"bf16": [1024, 8192], "w4a16": [1024]}
_KEPT = gemv_mod._default_config


def _tma(st, nw, un, rt=1, pr=1):
    return dict(KERNEL="tc", TMA=st, ROW_TILES=rt, num_warps=nw, UNROLL=un, PROGRAMS=pr)


CANDIDATES = {"bf16": [_tma(3, 4, 2), _tma(4, 4, 2), _tma(2, 4, 2, pr=2), _tma(3, 8, 1), _tma(2, 8, 2),
                       _tma(3, 4, 4), _tma(2, 4, 2, rt=2)],
              "w4a16": [_tma(4, 4, 4), _tma(4, 4, 4, pr=2), _tma(6, 4, 4, pr=2), _tma(4, 4, 2, pr=2),
                        _tma(6, 4, 2, pr=3), _tma(4, 8, 2), _tma(4, 8, 2, pr=2), _tma(3, 4, 4, rt=2, pr=2)]}


def chain_us(calls):
    graph, _, _ = cuda_graph(calls, 1)
    us = statistics.median(time_cuda_events(graph.replay, warmup=3, iters=20)) * 1e6 / len(calls)
    del graph
    return us


def pick(model, fmt, gen):
    """{(N, K, fmt): the fastest TMA configuration} and {(N, K, fmt): its time / the kept one's} over the step's
    GEMV shapes."""
    x_dt = model.dtype
    lins = {name: [ly[name] for ly in model.layers] for name in ("qkv", "o", "gate_up", "down")}
    lins["head"] = [model.head]
    best, ratio = {}, {}
    for name, ls in lins.items():
        w0 = ls[0]
        K = w0.weight.shape[1] * (2 if w0.scales is not None and w0.weight.dtype == torch.uint8 else 1)
        x = torch.randn(1, K, device=model.device, generator=gen).to(x_dt)
        wfmt = model.ops.gemv_format(w0, x)
        want = gemv(w0.weight, x, w0.scales, wfmt, "cuda").float()
        kept = chain_us([lambda li=li: gemv(li.weight, x, li.scales, wfmt, "cuda") for li in ls])
        rows = []
        for cfg in CANDIDATES[fmt]:
            try:
                got = gemv(w0.weight, x, w0.scales, wfmt, "cuda", config=cfg).float()
                err = float((got - want).norm() / want.norm())
                us = chain_us([lambda li=li: gemv(li.weight, x, li.scales, wfmt, "cuda", config=cfg) for li in ls])
            except Exception as e:  # noqa: BLE001 - a candidate that fails is a row
                print(f"  {fmt} {name} {cfg}: failed ({type(e).__name__}: {str(e)[:100]})", flush=True)
                continue
            print(f"  {fmt} {name} {tuple(w0.weight.shape)} {cfg}: {us:.2f} us a call (kept {kept:.2f}), rel diff "
                  f"{err:.1e}{'  WRONG' if err > 1e-2 else ''}", flush=True)
            if err <= 1e-2:
                rows.append((us, cfg))
        if rows:
            us, cfg = min(rows, key=lambda r: r[0])
            best[(w0.weight.shape[0], K, wfmt)] = cfg
            ratio[(w0.weight.shape[0], K, wfmt)] = us / kept
            print(f"{fmt} {name}: best TMA {us:.2f} us {cfg}, kept {kept:.2f} us ({us / kept:.3f}x)", flush=True)
    return best, ratio


def patched(table):
    def config(M, N, K, fmt, sms, ptx):
        cfg = table.get((N, K, fmt)) if M == 1 else None
        return tuple(cfg.items()) if cfg else _KEPT(M, N, K, fmt, sms, ptx)
    return config


def main():
    fmts = sys.argv[1:] or ["bf16", "w4a16"]
    dev = torch.device("cuda", 0)
    print(torch.cuda.get_device_name(0), flush=True)
    for fmt in fmts:
        model = Llama.random("llama-3.1-8b", weights=fmt, impl="xelink", device=dev, max_batch=1,
                             max_seq_len=max(CONTEXTS[fmt]) + 16)
        gen = torch.Generator(device=dev).manual_seed(3)
        best, ratio = pick(model, fmt, gen)
        variants = {"kept": {}, "tma-where-faster": {k: v for k, v in best.items() if ratio[k] < 0.99},
                    "tma-everywhere": best}
        for L in CONTEXTS[fmt]:
            _fill_caches(model, 1, L, gen)
            tokens = torch.randint(0, model.config.vocab_size, (1,), device=dev, generator=gen)
            positions = torch.full((1,), L - 1, dtype=torch.int64, device=dev)
            graphs, logits = {}, {}
            for name, table in variants.items():
                gemv_mod._default_config = patched(table)
                gemv_mod._PATHS.clear()
                g = DecodeGraph(model, 1)
                logits[name] = g.step(tokens, positions).float().clone()
                graphs[name] = g
            gemv_mod._default_config = _KEPT
            gemv_mod._PATHS.clear()
            times = co_measure({n: g.graph.replay for n, g in graphs.items()}, warmup=2, iters=10, rounds=5,
                               timing=functools.partial(time_cuda_events, warmup=0))
            ref = logits["kept"]
            checks = ", ".join(f"{n}: next token {'same' if torch.equal(lg.argmax(-1), ref.argmax(-1)) else 'DIFFERS'},"
                               f" logits rel diff {float((lg - ref).norm() / ref.norm()):.1e}"
                               for n, lg in logits.items() if n != "kept")
            line = ", ".join(f"{n} {statistics.median(t) * 1e3:.3f}" for n, t in times.items())
            print(f"{fmt} ctx {L} step ms (median of 50 replays): {line}; {checks}", flush=True)
            del graphs, logits
            gc.collect()
        del model
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""A left-padded prompt batch through the Llama model on the xelink path: its attention as one call over the rows'
packed real tokens (``Ops.packed_attention``, ``flash_attention_varlen``: the model's path) against a call a row
(``flash_attention``; the path before the thirty-first session), the whole prefill timed (host time included: it
is an eager call), the last position's logits compared (``logits_to_keep=1``, as a prompt's prefill asks).

    python3 benchmarks/scripts/ragged_prefill_ab.py [--config llama-3.2-1b] [--batches 4 16] [--seq 512]

(a GPU script: CUDA, bf16, random weights; rows' real lengths spread evenly from seq / 4 to seq.)
"""
import argparse
import statistics
import time

import torch

from xelink.models import Llama
from xelink.models.llama import Ops


def per_row(self, q, k, v, pads, window=None):
    """The baseline: each row's real tokens attended on their own (one flash_attention call a row)."""
    out = q.new_zeros(q.shape)
    for b, p in enumerate(pads):
        if p < q.shape[2]:
            out[b:b + 1, :, p:] = self.attention(q[b:b + 1, :, p:], k[b:b + 1, :, p:], v[b:b + 1, :, p:], causal=True,
                                                 window=window)
    return out


def timed(model, ids, mask, reps: int) -> tuple[float, torch.Tensor]:
    out = model(ids, 0, mask, logits_to_keep=1)
    ms = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model(ids, 0, mask, logits_to_keep=1)
        torch.cuda.synchronize()
        ms.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ms), out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="llama-3.2-1b")
    ap.add_argument("--batches", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    packed = Ops.packed_attention
    model = Llama.random(args.config, seed=1, dtype=torch.bfloat16, impl="xelink", device="cuda",
                         max_batch=max(args.batches), max_seq_len=args.seq + 8)
    print(f"{torch.cuda.get_device_name()}: {args.config} prefill of a left-padded batch, S={args.seq}, "
          f"median of {args.reps} eager calls (ms)")
    for B in args.batches:
        lens = torch.linspace(args.seq // 4, args.seq, B).long()
        mask = (torch.arange(args.seq)[None, :] >= (args.seq - lens)[:, None]).long()
        ids = torch.randint(0, model.config.vocab_size, (B, args.seq), generator=torch.Generator().manual_seed(B))
        ids = ids.masked_fill(mask == 0, 0)
        Ops.packed_attention = per_row
        base, want = timed(model, ids, mask, args.reps)
        Ops.packed_attention = packed
        new, got = timed(model, ids, mask, args.reps)
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        print(f"B={B:3d}: a call a row {base:8.2f}  packed {new:8.2f}  ({base / new:.2f}x); "
              f"logits rel. diff {err:.2e}")


if __name__ == "__main__":
    main()

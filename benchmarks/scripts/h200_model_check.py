"""The cost model against the 2 x H200 GPU-collectives measurements (offline, no GPU needed).

Predicts each measured xelink row (benchmarks/results/h200x2-gpu-collectives/gpu_collectives.jsonl)
with ``xelink.cost`` on the shipped ``nvidia-h200x2`` topology (NVLink 390 GB/s each way, measured by
a copy-engine peer copy on that machine; 3 us latency, estimated) and prints predicted vs measured.
Rows: CUDA-graph times up to 16 MiB, eager beyond; copy_engine paths have no model algorithm.

    python benchmarks/scripts/h200_model_check.py [--out DIR]
"""
import argparse
import json
from pathlib import Path

from xelink import cost, topology

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "benchmarks" / "results" / "h200x2-gpu-collectives" / "gpu_collectives.jsonl"


def rows():
    for line in SRC.read_text().splitlines():
        r = json.loads(line)
        variant, mode = r["extra"]["variant"], r["extra"]["mode"]
        if not variant.startswith("xelink:") or "copy_engine" in variant:
            continue
        if (mode == "graph") != (r["size_bytes"] <= 16 << 20 or r["op"] == "all_gather" and r["size_bytes"] <= 1 << 20):
            continue
        yield r, variant.split(":", 1)[1].split("/")[0], variant.split("/")[1], mode


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    topo = topology.load("nvidia-h200x2")
    place = topology.place(topo, 2, 1)
    lines = [f"{'op':11s} {'algo':9s} {'tensor':6s} {'mode':5s} {'bytes':>10s} {'pred us':>9s} {'meas us':>9s} "
             f"{'pred/meas':>9s}  within 30%"]
    count = {"latency": [0, 0], "bandwidth": [0, 0]}
    for r, algo, tensor, mode in rows():
        pred = cost.predict(topo, place, r["op"], algo, r["size_bytes"]).time_s * 1e6
        ratio = pred / r["time_us"]
        ok = abs(ratio - 1) <= 0.3
        cls = "bandwidth" if r["size_bytes"] >= 4 << 20 else "latency"
        count[cls][0] += ok
        count[cls][1] += 1
        lines.append(f"{r['op']:11s} {algo:9s} {tensor:6s} {mode:5s} {r['size_bytes']:10d} {pred:9.1f} "
                     f"{r['time_us']:9.1f} {ratio:9.2f}  {'yes' if ok else 'no'}")
    for cls, (ok, n) in count.items():
        lines.append(f"{cls}-bound rows (>= 4 MiB is bandwidth-bound): {ok}/{n} within +-30%")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "model_vs_measured.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()

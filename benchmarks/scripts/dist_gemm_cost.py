"""The cost model's distributed GEMM on 12 Intel Max stacks next to the SyclKittens paper (issue 21).

    PYTHONPATH=. python3 benchmarks/scripts/dist_gemm_cost.py

At the reference code's shapes (6144^3 and 12288^3, bf16, A row-sharded over 12 stacks, full C on
every stack) it prints the model's topo / flat pipelined ratio, the like-for-like ratio of the paper's
measurement (a topology-aware gather, then the GEMM, against a flat gather, then the GEMM), the
paper's 1.42x / 2.15x and 84% / 93% of GEMM-only, and the gather times the paper's
figures imply for the two gathers (with the model's GEMM time; their ratio does not depend on it). No device needed: the model only.
"""
from xelink import cost
from xelink import topology as T

PAPER = {6144: (1.42, 0.84), 12288: (2.15, 0.93)}  # topo / flat gather; topo share of GEMM-only (§H)


def main() -> None:
    t = T.load("intel-max-1550x6")
    op, n = "all_gather_matmul", 12
    print(cost.dist_gemm_table(t, n, op, [(s, s, s) for s in PAPER]))
    print()
    rows = [["shape", "pipelined/topo", "flat-seq/topo-seq", "paper", "topo-seq % GEMM", "paper %",
             "topo gather: model / paper", "flat gather: model / paper", "flat/topo gather: model / paper"]]
    for s, (paper_ratio, paper_share) in PAPER.items():
        p = {a: cost.predict_dist_gemm(t, n, op, a, s, s, s) for a in ("pipelined", "topo")}
        seq = {c: cost.predict_dist_gemm(t, n, op, "sequential", s, s, s, collective_algo=c) for c in ("direct", "topo")}
        gemm = seq["topo"].compute_s
        gather = {c: seq[c].time_s - gemm for c in seq}
        # The paper's paths are materialise-then-GEMM: share = C / (G_topo + C), ratio = (G_flat + C) /
        # (G_topo + C). With the model's GEMM time C they give the gather times below; their ratio,
        # (ratio - share) / (1 - share), does not depend on C.
        topo_paper = gemm * (1 - paper_share) / paper_share
        flat_paper = paper_ratio * gemm / paper_share - gemm
        rows.append([f"{s}^3", f"{p['pipelined'].time_s / p['topo'].time_s:.2f}x",
                     f"{seq['direct'].time_s / seq['topo'].time_s:.2f}x", f"{paper_ratio:.2f}x",
                     f"{100 * gemm / seq['topo'].time_s:.0f}%", f"{100 * paper_share:.0f}%",
                     f"{gather['topo'] * 1e3:.2f} / {topo_paper * 1e3:.2f} ms",
                     f"{gather['direct'] * 1e3:.2f} / {flat_paper * 1e3:.2f} ms",
                     f"{gather['direct'] / gather['topo']:.2f}x / {flat_paper / topo_paper:.1f}x"])
    print("topo against a flat gather, 12 stacks (model: 19 GB/s XeLink per stack, 152 GB/s MDFI, "
          f"GEMM {cost.GEMM_TFLOPS['xpu']:g} TFLOP/s a stack)")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)))


if __name__ == "__main__":
    main()

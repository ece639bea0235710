"""Issue 22 at 2048x4096x4096: the gated rows with 4, 8 and 16 chunks of rows / column slices (run_gated's chunks).

    python3 benchmarks/scripts/gated_chunks_ab.py
"""
from xelink.bench.families.gemm import run_gated
from xelink.bench.kernel_timing import KernelReport
for chunks in (4, 8, 16):
    report = KernelReport()
    run_gated(report, [(2048, 4096, 4096)], chunks=chunks, rounds=5)
    for r in report.rows:
        if "triton" in r.path:
            continue
        vs = r.extra.get("vs_flags_set")
        print(f"chunks {chunks:>2} {r.path:<62} {r.time_us:8.1f} us {(r.ratio or 1.0):6.3f}x torch"
              f"{'' if vs is None else f' {vs:6.3f} of flags set'} #wrong {r.wrong}", flush=True)

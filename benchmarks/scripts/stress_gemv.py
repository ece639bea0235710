"""Repeat the random-seed GPU gemv checks of tests/kernels/test_gemv.py for a time budget, in one process
(the kernels compile once), and print every failure with its seed: a hunt for a rare failure.

``python3 benchmarks/scripts/stress_gemv.py SECONDS [SUBSTRING]`` (only the cases whose
function name and arguments contain SUBSTRING)
"""
import itertools
import sys
import time

import torch

sys.path.insert(0, "tests/kernels")
import test_gemv as T  # noqa: E402

budget = float(sys.argv[1]) if len(sys.argv) > 1 else 120.0
cases = [(T.test_gpu_kernels_match_reference, dict(fmt=f, dtype=d, impl=i))
         for f, d, i in itertools.product(["bf16", "w8a16", "w4a16"], [torch.bfloat16, torch.float16],
                                          ["triton", "cuda"])]
cases += [(T.test_gpu_tensor_core_kernel, dict(fmt=f, dtype=d))
          for f, d in itertools.product(["bf16", "w8a16", "w4a16"], [torch.bfloat16, torch.float16])]
if len(sys.argv) > 2:
    cases = [(fn, kw) for fn, kw in cases if sys.argv[2] in f"{fn.__name__} {kw}"]
start, runs, failures = time.time(), 0, 0
for fn, kw in itertools.cycle(cases):
    if time.time() - start > budget:
        break
    try:
        fn(lambda n: None, **kw)
    except AssertionError as e:
        failures += 1
        print(f"FAIL {fn.__name__} {kw}: {str(e).splitlines()[0]}", flush=True)
    runs += 1
print(f"{runs} test calls ({runs / len(cases):.1f} rounds of {len(cases)}), {failures} failed, "
      f"{time.time() - start:.0f} s")

"""The Triton kernels run in CI, not only compile: every interpreter test of tests/kernels (each portable kernel
against its reference on tiny CPU shapes: flash, decode and rope decode attention, merge, gemv, norms, gemm,
gated and scatter GEMMs) in a child pytest with ``TRITON_INTERPRET=1``, which must be set before Triton is
imported and so cannot be turned on inside this session. Skips where Triton is missing."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# Fewer passing interpreter tests than this means a module stopped collecting them (the run has 72 on Intel's
# Triton 3.3, where the TMA variants skip).
_AT_LEAST = 60


def test_triton_kernels_run_on_the_cpu():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs Triton (the test extra installs Intel's)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this session interprets already: its own interpreter tests are those")
    here = Path(__file__).resolve().parent
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here), "-k",
                          "interpreter or interpreted"], env=dict(os.environ, TRITON_INTERPRET="1"),
                         capture_output=True, text=True, timeout=900, cwd=here.parent.parent)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= _AT_LEAST, out[-3000:]

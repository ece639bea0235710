"""xelink without Triton (a plain ``pip install xelink`` on a CPU machine: numpy, torch and mpi4py only): every module
imports, the CPU paths run, and a Triton path asked for by name says it needs Triton.

CI installs Intel's Triton for the compile check, so the job hides it: ``sys.modules["triton"] = None`` makes every
``import triton`` raise ImportError, as where it is not installed."""
import subprocess
import sys

_SCRIPT = r"""
import sys
sys.modules["triton"] = None
import importlib, pkgutil
import torch
import xelink
from xelink import kernels as K
from xelink.kernels.common import triton
assert triton is None
names = [m.name for m in pkgutil.walk_packages(xelink.__path__, "xelink.") if not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
print("imported", len(names))
torch.manual_seed(0)
a, b = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(16, 4, dtype=torch.bfloat16)
assert torch.equal(K.gemm(a, b), K.reference_gemm(a, b))
q = torch.randn(1, 2, 5, 8)
k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
assert torch.allclose(K.flash_attention(q, k, v, causal=True), ref, atol=1e-5)
x, w = torch.randn(1, 16, dtype=torch.bfloat16), torch.randn(4, 16, dtype=torch.bfloat16)
assert torch.equal(K.gemv(w, x), K.reference_gemv(w, x))
for call in (lambda: K.gemm(a, b, impl="triton"), lambda: K.flash_attention(q, k, v, impl="triton")):
    try:
        call()
    except RuntimeError as exc:
        assert "impl='triton' needs Triton, which is not installed" in str(exc), exc
    else:
        raise AssertionError("impl='triton' ran without Triton")
from xelink.models import Llama
model = Llama.random("tiny", device="cpu", dtype=torch.float32, max_seq_len=24)
ids = torch.tensor([[1, 5, 9, 2]])
assert torch.equal(model.generate(ids, 6), Llama.random("tiny", impl="reference", device="cpu", dtype=torch.float32,
                                                         max_seq_len=24).generate(ids, 6))
world = xelink.init()
t = torch.ones(3)
xelink.all_reduce(t)
assert t.tolist() == [1.0, 1.0, 1.0]
xelink.finalize()
print("ok")
"""


def test_every_module_imports_and_the_cpu_paths_run_without_triton():
    """Before: ``import xelink`` raised ImportError without Triton (the gated and scatter GEMMs imported the gemm
    kernel's jitted helpers, which exist only where Triton does)."""
    r = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.rstrip().endswith("ok"), r.stdout

"""Issue 27's stretch: the SPIR-V that ``xelink.kernels.intel_aot`` compiles for Intel GPUs (Intel's Triton),
run through dpctl on the CPU OpenCL device against a numpy reference. Never skipped.

As compiled, the CPU runtime refuses every module: Triton's Intel backend declares the
``KernelAttributesINTEL`` capability (5892) for its ``MaxWorkgroupSizeINTEL`` execution mode;
``intel_aot.without_kernel_attributes`` drops both, and then RMSNorm (one pass, with and without the
residual) runs and matches. Kernels with DPAS or 2D block IO are not tried (CPU devices have neither)."""
import ctypes
import os
import sys

os.environ["OCL_ICD_FILENAMES"] = os.path.join(sys.prefix, "lib", "libintelocl.so")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from xelink.kernels import intel_aot  # noqa: E402
from xelink.symm import sycl as S  # noqa: E402

ROWS, H = 4, 4096  # the launch intel_aot compiles: H = 4096, one pass, strides H


def _bf16(a):
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even


def _f32(u):
    return (u.astype(np.uint32) << 16).view(np.float32)


@pytest.fixture(scope="module")
def queue():
    return S.dpctl_module().SyclQueue("opencl:cpu")


def _compiled(name):
    launch = {la.name: la for la in intel_aot.LAUNCHES}[name]
    return launch, intel_aot.compile_launch(launch, "xe2", 16)


def test_as_compiled_the_cpu_runtime_refuses_the_kernel_attributes_capability(queue):
    import dpctl.program as dp

    _, c = _compiled("norm._rmsnorm_kernel")
    spv = c.asm["spv"]
    assert 5892 in intel_aot.spirv_capabilities(spv)
    with pytest.raises(dp.SyclProgramCompilationError):
        dp.create_program_from_spirv(queue, spv)
    stripped = intel_aot.without_kernel_attributes(spv)
    assert 5892 not in intel_aot.spirv_capabilities(stripped) and len(stripped) < len(spv)
    dp.create_program_from_spirv(queue, stripped)  # builds


@pytest.mark.parametrize("residual", [False, True])
def test_rmsnorm_spirv_runs_on_the_cpu_device_and_matches_numpy(queue, residual):
    import dpctl
    import dpctl.memory as dm
    import dpctl.program as dp

    name = "norm._rmsnorm_kernel[residual]" if residual else "norm._rmsnorm_kernel"
    launch, c = _compiled(name)
    prog = dp.create_program_from_spirv(queue, intel_aot.without_kernel_attributes(c.asm["spv"]))
    kernel = prog.get_sycl_kernel("_rmsnorm_kernel")
    rng = np.random.default_rng(1 + residual)
    x, r, w = _bf16(rng.standard_normal((ROWS, H))), _bf16(rng.standard_normal((ROWS, H))), _bf16(rng.standard_normal(H))
    poison = np.full((ROWS, H), 0x7FC0, np.uint16)  # NaN
    mem = {}
    for key, arr in (("x", x), ("r", r), ("w", w), ("o", poison), ("h", poison)):
        m = dm.MemoryUSMShared(arr.nbytes, queue=queue)
        np.frombuffer(m, dtype=np.uint16)[:] = arr.ravel()
        mem[key] = m
    args = [mem["x"], mem["r"], mem["w"], mem["o"], mem["h"], *[ctypes.c_int32(H)] * 5, ctypes.c_float(1e-6),
            dpctl.LocalAccessor("u1", (max(c.metadata.shared, 1),))]
    lws = launch.num_warps * 16  # work-items of one program: warps x the sub-group size compiled for
    queue.submit(kernel, args, [ROWS * lws], [lws]).wait()
    h = _f32(x) + _f32(r) if residual else _f32(x)
    h = _f32(_bf16(h))  # the kernel rounds the sum to bf16 before normalizing and stores it
    want = _f32(_bf16(h / np.sqrt((h.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * _f32(w)))
    got = _f32(np.frombuffer(mem["o"], dtype=np.uint16).reshape(ROWS, H))
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= 2 ** -7 * np.abs(want).max(), "RMSNorm's Intel SPIR-V differs from numpy"
    if residual:
        assert np.array_equal(np.frombuffer(mem["h"], dtype=np.uint16).reshape(ROWS, H), _bf16(_f32(x) + _f32(r)))

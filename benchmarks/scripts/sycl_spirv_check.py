"""Issue 27's stretch: hand the SPIR-V that ``xelink.kernels.intel_aot`` compiles for the kernels without DPAS
(RMSNorm, RoPE, the attention merge, the split-K sum) to the CPU OpenCL device and report what it says.

dpctl's ``create_program_from_spirv`` raises ``SyclProgramCompilationError`` with an empty message, so this
builds through the OpenCL C API (ctypes on the wheel's ``libOpenCL.so.1``) to read the build log. For each
kernel: the runtime's verdict on the module as compiled and without the kernel-attributes capability
(``intel_aot.without_kernel_attributes``), and the capabilities it declares. ``tests/sycl/test_intel_spirv.py``
runs RMSNorm's stripped module and checks it against numpy.

    LD_LIBRARY_PATH=.venv/lib OCL_ICD_FILENAMES=$PWD/.venv/lib/libintelocl.so \\
        .venv/bin/python benchmarks/scripts/sycl_spirv_check.py [--target xe2] [--sub-group 16]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys

from xelink.kernels import intel_aot

KERNELS = ("norm._rmsnorm_kernel", "norm._rmsnorm_kernel[residual]", "norm._rope_kernel",
           "attention._merge_kernel[hd128]", "gemv._splitk_sum_kernel")
def build_log(spv: bytes) -> tuple[int, str]:
    """(clBuildProgram's status, the build log) of ``spv`` on the first CPU device."""
    cl = ctypes.CDLL(os.path.join(sys.prefix, "lib", "libOpenCL.so.1"))
    vp, sz, u32, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32, ctypes.c_int32
    n = u32()
    cl.clGetPlatformIDs(0, None, ctypes.byref(n))
    plats = (vp * n.value)()
    cl.clGetPlatformIDs(n.value, plats, None)
    dev, err = vp(), i32()
    if cl.clGetDeviceIDs(vp(plats[0]), ctypes.c_uint64(2), 1, ctypes.byref(dev), None):  # CL_DEVICE_TYPE_CPU
        raise RuntimeError("no CPU OpenCL device (set OCL_ICD_FILENAMES)")
    cl.clCreateContext.restype = vp
    ctx = cl.clCreateContext(None, 1, ctypes.byref(dev), None, None, ctypes.byref(err))
    cl.clCreateProgramWithIL.restype = vp
    prog = cl.clCreateProgramWithIL(vp(ctx), spv, sz(len(spv)), ctypes.byref(err))
    if err.value:
        return err.value, f"clCreateProgramWithIL failed ({err.value})"
    status = cl.clBuildProgram(vp(prog), 1, ctypes.byref(dev), b"", None, None)
    size = sz()
    cl.clGetProgramBuildInfo(vp(prog), dev, u32(0x1183), sz(0), None, ctypes.byref(size))  # CL_PROGRAM_BUILD_LOG
    buf = ctypes.create_string_buffer(size.value)
    cl.clGetProgramBuildInfo(vp(prog), dev, u32(0x1183), size, buf, None)
    return status, buf.value.decode(errors="replace").strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="xe2", choices=sorted(intel_aot.TARGETS))
    ap.add_argument("--sub-group", type=int, default=16, choices=intel_aot.SUB_GROUPS)
    args = ap.parse_args(argv)
    launches = {la.name: la for la in intel_aot.LAUNCHES}
    for name in KERNELS:
        spv = intel_aot.compile_launch(launches[name], args.target, args.sub_group).asm["spv"]
        caps = ", ".join(map(str, intel_aot.spirv_capabilities(spv)))
        for what, module in (("as compiled", spv), ("without kernel attributes", intel_aot.without_kernel_attributes(spv))):
            status, log = build_log(module)
            verdict = "built" if status == 0 else "refused: " + " | ".join(ln for ln in log.splitlines()
                                                                            if "Compilation" not in ln)
            print(f"{name} ({args.target}, sub-group {args.sub_group}, {what}): {verdict}")
        print(f"  capabilities declared: {caps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Every portable Triton kernel compiles for Intel Xe2 and Intel Max (Intel's Triton, triton-xpu 3.3).

Runs wherever Intel's Triton is the installed ``triton`` (the CPU test environment: the test extra
installs it); skips under NVIDIA's Triton (GPU machines). CI refuses a run where these skipped.
"""
import dataclasses
import importlib
import os

import pytest


def _intel_triton():
    try:
        import triton.backends
    except ImportError:
        return False
    return "intel" in triton.backends.backends


pytestmark = [pytest.mark.skipif(not _intel_triton(), reason="needs Intel's Triton (pip install triton-xpu)"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                 reason="TRITON_INTERPRET=1 replaces compiling with the interpreter")]


@pytest.fixture(scope="module")
def aot():
    return importlib.import_module("xelink.kernels.intel_aot")


def test_every_kernel_module_imports_under_intel_triton():
    for name in ("xelink.kernels.attention", "xelink.kernels.attention_bwd", "xelink.kernels.gemm",
                 "xelink.kernels.gated_gemm", "xelink.kernels.gemv", "xelink.kernels.scatter_gemm",
                 "xelink.kernels.qgemm", "xelink.kernels.norm",
                 "xelink.collectives.gpu.kernels", "xelink.symm.kernels"):
        importlib.import_module(name)


def test_every_kernel_compiles_for_xe2_and_max(aot):
    lines = []
    # one compiler process a core (the compiles are independent; 80 s in one process on a 2-core CI machine)
    failures = aot.check(log=lines.append, workers=min(4, len(os.sched_getaffinity(0))))
    assert failures == [], "\n".join(failures)
    expected = sum(len(aot.TARGETS) * len(launch.sub_groups) for launch in aot.LAUNCHES)
    assert len(lines) == expected
    modules = {launch.module for launch in aot.LAUNCHES}
    assert {"attention", "gemm", "gated_gemm", "scatter_gemm", "gemv", "norm", "qgemm"} <= modules


def test_check_of_given_launches_in_this_process(aot):
    # the list a caller passes compiles here, one line a compile (the full list above goes to worker processes)
    norm = [x for x in aot.LAUNCHES if x.module == "norm"][:1]
    lines = []
    assert aot.check(norm, ["xe2"], [16], log=lines.append, workers=4) == []
    assert len(lines) == 1 and lines[0].startswith(f"{norm[0].name} [xe2, sub-group 16]: ok")


def test_a_gemm_without_dpas_is_caught(aot):
    launch = next(x for x in aot.LAUNCHES if x.module == "gemm" and x.matrix)
    no_dpas = dict(aot.TARGETS["xe2"], has_subgroup_matrix_multiply_accumulate=False, has_subgroup_2d_block_io=False)
    compiled = aot.compile_launch(launch, "xe2", 16, target_props=no_dpas)
    found = aot.problems(launch, compiled, 16)
    assert any("no DPAS" in p for p in found), found
    assert any("2D block IO" in p for p in found), found


def test_a_kernel_needing_more_shared_memory_is_caught(aot):
    launch = next(x for x in aot.LAUNCHES if x.module == "gemm" and x.shared == 0)
    compiled = aot.compile_launch(launch, "max", 16)
    assert aot.problems(launch, compiled, 16) == []
    stricter = dataclasses.replace(launch, shared=compiled.metadata.shared - 1)
    assert any("metadata.shared" in p for p in aot.problems(stricter, compiled, 16))


def test_dump_writes_ttgir_llvm_ir_and_spirv(aot, tmp_path):
    name = next(x.name for x in aot.LAUNCHES if x.module == "norm")
    assert aot.main(["dump", name, "--target", "max", "--sub-group", "32", "--out", str(tmp_path)]) == 0
    files = {p.suffix: p for p in tmp_path.iterdir()}
    assert set(files) == {".ttgir", ".llir", ".spv"}
    assert files[".spv"].read_bytes()[:4] == (0x07230203).to_bytes(4, "little")  # SPIR-V magic
    assert "tt.func" in files[".ttgir"].read_text()


def test_list_names_the_exceptions(aot, capsys):
    assert aot.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "collectives.*" in out and "not compiled" in out

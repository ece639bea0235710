"""The helpers the kernel modules share (xelink.kernels.common): one impl vocabulary with its aliases, the
out= checks, and that every public kernel speaks that vocabulary."""
import pytest
import torch

from xelink.kernels import attention, norm
from xelink.kernels.common import IMPL_ALIASES, IMPLS, check_impl, check_no_overlap, check_out, gc_paused
from xelink.kernels.gemm import GEMM_IMPLS
from xelink.kernels.gemv import GEMV_IMPLS

KERNEL_IMPLS = {"gemm": GEMM_IMPLS, "gemv": GEMV_IMPLS, "rmsnorm": norm.NORM_IMPLS, "rope": norm.NORM_IMPLS,
                "flash_attention": attention.FLASH_IMPLS, "decode_attention": attention.DECODE_IMPLS,
                "merge_attention": attention.MERGE_IMPLS}


def test_every_kernel_takes_a_subset_of_the_one_vocabulary():
    assert IMPLS == ("auto", "triton", "cuda", "reference")
    assert IMPL_ALIASES == {"hopper": "cuda"}
    for name, impls in KERNEL_IMPLS.items():
        assert set(impls) <= set(IMPLS) and {"auto", "triton", "reference"} <= set(impls), name
    assert {n for n, impls in KERNEL_IMPLS.items() if "cuda" in impls} == {"gemm", "gemv", "flash_attention"}


def test_check_impl_maps_aliases_and_names_what_is_missing():
    assert check_impl("gemm", "hopper", GEMM_IMPLS) == "cuda"
    assert check_impl("gemm", "cuda", GEMM_IMPLS) == "cuda"
    with pytest.raises(ValueError, match=r"^rmsnorm: impl='cuda' is not one of auto, triton, reference "
                                         r"\(rmsnorm has no cuda kernel\)$"):
        check_impl("rmsnorm", "cuda", norm.NORM_IMPLS)
    with pytest.raises(ValueError, match=r"^rmsnorm: impl='hopper' is not one of .*'hopper' is an old name of 'cuda'"):
        check_impl("rmsnorm", "hopper", norm.NORM_IMPLS)
    with pytest.raises(ValueError, match=r"^gemm: impl='fast' is not one of auto, triton, cuda, reference$"):
        check_impl("gemm", "fast", GEMM_IMPLS)
    with pytest.raises(TypeError, match="^gemm: impl=None must be a str"):
        check_impl("gemm", None, GEMM_IMPLS)


_X = torch.ones(2, 8, dtype=torch.bfloat16)
_Q = torch.ones(1, 2, 3, 64, dtype=torch.bfloat16)
_LENS = torch.tensor([3])


@pytest.mark.parametrize("name, call", [
    ("rmsnorm", lambda impl: norm.rmsnorm(_X, torch.ones(8), impl=impl)),
    ("rope", lambda impl: norm.rope(_Q, _Q, torch.ones(3, 64), torch.ones(3, 64), impl=impl)),
    ("decode_attention", lambda impl: attention.decode_attention(_Q, _Q, _Q, _LENS, impl=impl)),
    ("merge_attention", lambda impl: attention.merge_attention([_Q], [torch.zeros(1, 2, 3)], impl=impl)),
])
@pytest.mark.parametrize("impl", ["cuda", "hopper"])
def test_kernels_without_a_cuda_path_refuse_it(name, call, impl):
    with pytest.raises(ValueError, match=rf"^{name}: impl='{impl}' is not one of auto, triton, reference \({name} "
                                         r"has no cuda kernel"):
        call(impl)


def test_check_out():
    check_out("f", torch.empty(10, 8)[2:6, 1:5], (4, 4), torch.float32, torch.device("cpu"))  # a block: fine
    check_out("f", torch.empty(4, 1), (4, 1), torch.float32, torch.device("cpu"))  # one column: any stride
    with pytest.raises(ValueError, match="puts several elements at one address"):
        check_out("f", torch.empty(8).as_strided((3, 4), (2, 1)), (3, 4), torch.float32, torch.device("cpu"))


def test_check_no_overlap():
    big = torch.empty(8, 8)
    check_no_overlap("f", big[:4], a=big[4:], b=None, c=torch.empty(3))  # disjoint rows: fine
    with pytest.raises(ValueError, match="^f: out overlaps a in memory"):
        check_no_overlap("f", big[:5], a=big[4:])
    with pytest.raises(ValueError, match="^f: out overlaps a"):  # interleaved columns: conservative
        check_no_overlap("f", big[:, :4], a=big[:, 4:])
    check_no_overlap("f", big[:0], a=big)  # an empty out touches nothing


def test_path_key_remembers_only_plain_cuda_calls():
    from xelink.kernels.common import Paths, path_key

    x = torch.ones(2, 3)
    assert path_key(("auto", None), (x, x)) is None  # CPU tensors: the checks run every call
    assert path_key(("auto", [1]), (x,)) is None  # an option of another class
    assert path_key(("auto",), (x.numpy(),)) is None  # not a torch.Tensor
    assert path_key(("auto",), (x,), (object(),)) is None
    paths = Paths()
    paths.LIMIT = 2
    for i in range(3):
        paths.remember(i, i)
    assert paths == {2: 2}  # past the limit everything is forgotten, then the new entry kept


def test_gc_paused_collects_first_then_holds_the_collector_off():
    """What a graph capture is wrapped in: dead cycles collected before it, no collection inside it (a dead
    CUDA graph's destructor there invalidates the capture), the collector's state restored after (an error
    too)."""
    import gc
    import weakref

    class Cycle:
        pass

    def dead_cycle():
        a = Cycle()
        a.me = a
        return weakref.ref(a)

    assert gc.isenabled()
    ref = dead_cycle()
    with gc_paused():
        assert ref() is None and not gc.isenabled()
        inside = dead_cycle()
    assert gc.isenabled() and inside() is not None  # made inside: left for the next collection
    gc.collect()
    assert inside() is None
    ref = dead_cycle()
    with pytest.raises(RuntimeError, match="boom"), gc_paused(collect=False):
        assert ref() is not None
        raise RuntimeError("boom")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused(collect=False):
            pass
        assert not gc.isenabled()  # off before: off after
    finally:
        gc.enable()


def test_every_graph_capture_in_xelink_pauses_the_collector():
    """Each ``torch.cuda.graph(...)`` and ``capture_begin(...)`` in the package sits inside a ``with`` that enters
    ``gc_paused`` (a capture the collector can run in fails at random: see gc_paused)."""
    import ast
    from pathlib import Path

    import xelink

    def name(func):
        return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")

    def is_capture(call):
        f = call.func
        return isinstance(f, ast.Attribute) and (
            f.attr == "capture_begin" or (f.attr == "graph" and isinstance(f.value, ast.Attribute)
                                          and f.value.attr == "cuda"))

    root = Path(xelink.__file__).resolve().parent
    seen, bad = [], []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        parent = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and is_capture(node)):
                continue
            where = f"{path.relative_to(root)}:{node.lineno}"
            seen.append(where)
            def pauses(w):
                return isinstance(w, ast.With) and any(
                    isinstance(i.context_expr, ast.Call) and name(i.context_expr.func) == "gc_paused" for i in w.items)

            up = parent.get(node)
            while up is not None and not pauses(up):
                up = parent.get(up)
            if up is None:
                bad.append(where)
    assert len(seen) >= 5, seen  # the model's decode graph, dist's schedules, three benchmark captures
    assert not bad, f"graph captures outside gc_paused: {bad}"


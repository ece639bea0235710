"""The peer-memory layer's checks that run without a GPU: bad arguments are refused with the function and
the value named, before anything is set up or enqueued."""
import pytest
import torch

import xelink
from xelink import symm


@pytest.fixture()
def world():
    w = xelink.init()
    yield w
    xelink.finalize()


def test_views_and_transfers_need_a_symmetric_tensor(world):
    plain = torch.zeros(4)
    for call in (lambda: symm.peer_tensor(plain, 0), lambda: symm.put(plain, plain, 0),
                 lambda: symm.get(plain, plain, 0)):
        with pytest.raises(ValueError, match=r"(peer_tensor|put|get): the tensor is not in symmetric memory of w"):
            call()
    assert symm.peer_addresses(plain) is None


def test_signals_name_a_bad_rank_or_slot(world):
    with pytest.raises(ValueError, match=r"signal: rank=1 is not a rank of w\S* \(size 1\)"):
        symm.signal(1)
    with pytest.raises(ValueError, match=r"wait: rank=True is not a rank"):
        symm.wait(True)
    with pytest.raises(ValueError, match=rf"signal: slot=64 must be an int in \[0, {symm.SIGNAL_SLOTS}\)"):
        symm.signal(0, slot=64)
    with pytest.raises(ValueError, match=r"wait: slot=-1 must be an int"):
        symm.wait(0, slot=-1)


def test_symmetric_memory_needs_a_cuda_device(world):
    if torch.device(world.device).type == "cuda":
        pytest.skip("xelink.init bound a GPU here")
    with pytest.raises(xelink.XelinkError, match="empty: symmetric memory needs a CUDA device"):
        symm.empty(4)
    with pytest.raises(ValueError, match=r"empty: size=\(-1,\) must be non-negative ints"):
        symm.empty(-1)


def test_point_to_point_refuses_itself_on_every_device(world):
    with pytest.raises(ValueError, match=r"isend: dst=0 is this rank itself"):
        xelink.isend(torch.zeros(2), 0)


def test_a_first_launch_goes_to_the_stream_it_names(monkeypatch):
    # Triton's JIT launches on the current stream. The launch on the current stream makes nothing
    # current; the default stream (raw 0) is the default stream itself, never ExternalStream(0), which
    # torch turns into a fresh pool stream (the bug that made first GPU collective launches race).
    from xelink.symm import cuda as sc

    made = []
    monkeypatch.setattr(sc, "_raw_stream", lambda device: 1234)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda: "default")
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda raw: made.append(raw) or f"external {raw}")
    assert sc._other_stream(1234) is None
    assert sc._other_stream(0) == "default" and made == []
    assert sc._other_stream(777) == "external 777" and made == [777]


def test_kernel_keys_ignore_the_values_of_typed_unspecialized_arguments():
    # p2p's kernels take n, nbytes and timeout_ns as do_not_specialize int64 arguments: Triton compiles one kernel
    # for any value, so the preload's stand-ins (1 << 40) must key the launches of real sizes, or each new key's
    # first launch went through Triton's JIT path. An unannotated one still keys on its value's class (i32 / i64).
    from types import SimpleNamespace

    from xelink.symm import cuda as sc

    def param(name, dns=False, ty=""):
        return SimpleNamespace(name=name, do_not_specialize=dns, annotation_type=ty)

    fn = SimpleNamespace(arg_names=["X", "ERR", "n", "nbytes", "count"],
                         params=[param("X"), param("ERR"), param("n", True, "i64"), param("nbytes", True, "i64"),
                                 param("count", True)])
    k = sc.Kernel(fn, 4, {"ERR": 64}, {"X": torch.float32})
    preload = k._fill(dict(X=1 << 20, n=1 << 40, nbytes=1 << 40, count=5))[1]
    real = k._fill(dict(X=1 << 20, n=1000, nbytes=4000, count=7))[1]
    assert preload == real
    assert k._fill(dict(X=(1 << 20) + 4, n=1, nbytes=1, count=5))[1] != preload  # X's alignment still counts
    assert k._fill(dict(X=1 << 20, n=1, nbytes=1, count=1 << 40))[1] != preload  # an i64 count is another kernel


@pytest.mark.parametrize("args, text", [
    ((0, 64, 0, 64, -1, 4), "width=-1 must be a non-negative int"),
    ((0, 64, 0, 64, 32, 2.0), "height=2.0 must be a non-negative int"),
    ((0, 16, 0, 64, 32, 4), "pitches (16, 64) must be >= width=32"),
])
def test_copy_engine_2d_names_a_bad_shape(args, text):
    with pytest.raises(ValueError) as info:
        symm.copy_engine_2d(*args, stream=0)
    assert "copy_engine_2d" in str(info.value) and text in str(info.value)


def test_copy_engine_2d_fills_the_drivers_struct(monkeypatch):
    # The strided copy is one cuMemcpy2DAsync with device memory on both sides; nothing is enqueued for an
    # empty copy. (The copies themselves: tests/kernels/test_gated_gemm.py on a GPU.)
    from xelink.symm import cuda as sc

    calls = []

    class Driver:
        def copy2d(self, p, stream):
            s = p._obj
            calls.append((s.srcMemoryType, s.srcDevice, s.srcPitch, s.dstMemoryType, s.dstDevice, s.dstPitch,
                          s.WidthInBytes, s.Height, s.srcXInBytes, s.dstY, stream))
            return 0

        def check(self, status, what):
            assert status == 0 and what == "cuMemcpy2DAsync"

    monkeypatch.setattr(sc, "_driver", Driver())
    symm.copy_engine_2d(4096, 8192, 1024, 2048, 512, 300, stream=77)
    symm.copy_engine_2d(4096, 8192, 1024, 2048, 0, 300, stream=77)
    symm.copy_engine_2d(4096, 8192, 1024, 2048, 512, 0, stream=77)
    symm.copy_engine_2d(4096, 0, 1024, 0, 512, 1, stream=78)  # one row: the pitches raised to the width
    assert calls == [(2, 1024, 2048, 2, 4096, 8192, 512, 300, 0, 0, 77), (2, 1024, 512, 2, 4096, 512, 512, 1, 0, 0, 78)]

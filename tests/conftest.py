"""Collects ``ranks_*.py`` modules as multi-rank tests (see ``tests/ranks.py``) and adds the GPU marks."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import ranks  # noqa: E402

_launches: dict = {}
_collected: dict = {}  # (launcher, size, env, gpus) -> how many items its modules' checks made
# (launcher, size, env, gpus) -> {module path: its LAUNCH_TIMEOUT}: the modules one launch runs, in
# collection order (a session launches only the modules it collected).
_plan: dict = {}


def pytest_collect_file(file_path: Path, parent):
    if file_path.suffix == ".py" and file_path.name.startswith("ranks_"):
        return RanksModule.from_parent(parent, path=file_path)
    return None


class RanksModule(pytest.File):
    def collect(self):
        module = ranks.load_module(self.path)
        sizes = getattr(module, "WORLD_SIZES", ranks.DEFAULT_WORLD_SIZES)
        launchers = getattr(module, "LAUNCHERS", ranks.DEFAULT_LAUNCHERS)
        timeout = getattr(module, "LAUNCH_TIMEOUT", ranks.DEFAULT_LAUNCH_TIMEOUT)
        gpus = getattr(module, "GPUS", 0)
        env = tuple(sorted((getattr(module, "ENV", None) or {}).items()))
        for launcher in launchers:
            for n in sizes:
                key = (launcher, n, env, gpus)
                _plan.setdefault(key, {})[self.path] = timeout
                for name in ranks.check_names(module, launcher, n):
                    _collected[key] = _collected.get(key, 0) + 1
                    item = RanksItem.from_parent(self, name=f"{name}[{launcher}-{n}]", check=name, key=key)
                    if gpus:
                        item.add_marker(pytest.mark.gpu)
                    yield item


class RanksItem(pytest.Item):
    def __init__(self, *, check, key, **kwargs):
        super().__init__(**kwargs)
        self.check, self.key = check, key

    def runtest(self):
        launcher, n, env, gpus = self.key
        if gpus:
            _need_gpus(gpus)
        if self.key not in _launches:
            # CPU-rank modules run CPU ranks on a GPU host too: without this, init would bind every rank to
            # the host's GPU (and refuse ranks sharing one).
            launch_env = dict(env) if gpus else {"CUDA_VISIBLE_DEVICES": "", **dict(env)}
            modules = _plan[self.key]
            kept = [i for i in self.session.items if isinstance(i, RanksItem) and i.key == self.key]
            if len(kept) < _collected[self.key]:  # some deselected: the ranks run only the kept checks
                modules = {m: t for m, t in modules.items() if any(i.path == m for i in kept)}
                launch_env[ranks.SELECTED] = ",".join(ranks.key(i.path, i.check) for i in kept)
            _launches[self.key] = ranks.launch(list(modules), n, launcher, sum(modules.values()), env=launch_env)
        result = _launches[self.key]
        why = ranks.explain(result, ranks.key(self.path, self.check))
        if why is not None:
            raise RanksFailure(why)
        why = ranks.skipped(result, ranks.key(self.path, self.check))
        if why is not None:
            pytest.skip(why)

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, RanksFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        launcher, n, _, _ = self.key
        return self.path, None, f"{self.name} ({launcher}, {n} ranks)"


class RanksFailure(Exception):
    pass


def _need_gpus(n: int) -> None:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < n:
        pytest.skip(f"needs {n} GPU(s), {count} visible")


@pytest.fixture(autouse=True)
def _seeded(request):
    """Every test draws the same random data in every run (``ranks.seed``; rank checks seed per check and rank)."""
    ranks.seed(request.node.nodeid)


@pytest.fixture
def requires_gpus():
    """``requires_gpus(n)`` skips the test unless n CUDA devices are visible (no query at import)."""
    return _need_gpus


@pytest.fixture
def cu_gemv(monkeypatch, request):
    """The CUDA C++ W4A16 GEMV's switches for a GPU test (skipped without a GPU or NVRTC): ``gemv.CU_W4`` on, and the
    plans of gemv and gemv_norm dropped before and after (they hold the switches as they were); returns the two
    modules, whose switches (``gemv_norm.CU_FOLD``) the test sets with ``monkeypatch``."""
    import importlib

    import torch

    _need_gpus(1)
    gemv_module = importlib.import_module("xelink.kernels.gemv")
    norm_module = importlib.import_module("xelink.kernels.gemv_norm")
    if not gemv_module.cu_available(torch.device("cuda")):
        pytest.skip("needs torch.cuda._compile_kernel")
    for m in (gemv_module, norm_module):
        m._PATHS.clear()
        request.addfinalizer(m._PATHS.clear)
    monkeypatch.setattr(gemv_module, "CU_W4", True)
    return gemv_module, norm_module

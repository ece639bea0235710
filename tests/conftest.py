"""Collects ``ranks_*.py`` modules as multi-rank tests (see ``tests/ranks.py``) and adds the GPU marks."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import ranks  # noqa: E402

_launches: dict = {}


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
        env = getattr(module, "ENV", None)
        for launcher in launchers:
            for n in sizes:
                for name in ranks.check_names(module, launcher, n):
                    item = RanksItem.from_parent(self, name=f"{name}[{launcher}-{n}]", check=name,
                                                 launcher=launcher, n=n, timeout=timeout, gpus=gpus, env=env)
                    if gpus:
                        item.add_marker(pytest.mark.gpu)
                    yield item


class RanksItem(pytest.Item):
    def __init__(self, *, check, launcher, n, timeout, gpus=0, env=None, **kwargs):
        super().__init__(**kwargs)
        self.check, self.launcher, self.n, self.timeout = check, launcher, n, timeout
        self.gpus, self.env = gpus, env

    def runtest(self):
        if self.gpus:
            _need_gpus(self.gpus)
        key = (self.path, self.launcher, self.n)
        if key not in _launches:
            _launches[key] = ranks.launch(self.path, self.n, self.launcher, self.timeout, env=self.env)
        why = ranks.explain(_launches[key], self.check)
        if why is not None:
            raise RanksFailure(why)
        why = ranks.skipped(_launches[key], self.check)
        if why is not None:
            pytest.skip(why)

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, RanksFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"{self.name} ({self.launcher}, {self.n} ranks)"


class RanksFailure(Exception):
    pass


def _need_gpus(n: int) -> None:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < n:
        pytest.skip(f"needs {n} GPU(s), {count} visible")


@pytest.fixture
def requires_gpus():
    """``requires_gpus(n)`` skips the test unless n CUDA devices are visible (no query at import)."""
    return _need_gpus

"""The multi-rank harness itself: a failing rank fails its check, a hung rank is killed and named."""
import os
import sys
import zlib
from pathlib import Path

import numpy as np
import torch

import ranks

DATA = Path(__file__).parent / "data"


def test_failing_rank_and_hung_rank_are_reported():
    result = ranks.launch(DATA / "bad_checks.py", 2, "mpi", timeout=15)
    assert result.timed_out and 15 <= result.seconds < 30
    assert ranks.explain(result, "check_passes") is None and ranks.skipped(result, "check_passes") is None
    assert ranks.explain(result, "check_skips_on_rank_0") is None
    assert ranks.skipped(result, "check_skips_on_rank_0") == "rank 0: nothing to compare against here"
    assert not any("check_only_at_three_ranks" in r for r in result.results.values())  # not run at 2 ranks
    why = ranks.explain(result, "check_fails_on_rank_1")
    assert "rank 1:" in why and "AssertionError: rank 1 disagrees" in why and "rank 0:" not in why
    why = ranks.explain(result, "check_hangs_on_rank_1")
    assert "rank 1: no result (the launch was killed after" in why
    assert "rank 1 was last in bad_checks.py::check_hangs_on_rank_1" in why
    # Rank 0 went on to the next check, where it could not get past the hung rank either.
    assert "rank 1 was last in bad_checks.py::check_hangs_on_rank_1" in ranks.explain(result, "check_never_reached")


def test_crashed_rank_fails_the_launch_and_the_modules_before_it_keep_their_results():
    first, crash = DATA / "first_checks.py", DATA / "crash_checks.py"
    result = ranks.launch([first, crash], 2, "mpi", timeout=60)  # two modules, one launch
    assert not result.timed_out and result.returncode != 0
    assert ranks.explain(result, ranks.key(first, "check_passes_first")) is None
    assert all(0 <= r[ranks.key(first, "check_passes_first")]["seconds"] < 60 for r in result.results.values())
    why = ranks.explain(result, ranks.key(crash, "check_rank_1_exits"))
    assert "rank 1: no result (the launch exited with code" in why and "check_rank_1_exits" in why


def test_check_names_in_definition_order():
    module = ranks.load_module(DATA / "bad_checks.py")
    assert ranks.check_names(module) == ["check_passes", "check_skips_on_rank_0", "check_only_at_three_ranks",
                                         "check_fails_on_rank_1", "check_hangs_on_rank_1", "check_never_reached"]
    assert ranks.check_names(module, "mpi", 2) == ["check_passes", "check_skips_on_rank_0", "check_fails_on_rank_1",
                                                   "check_hangs_on_rank_1", "check_never_reached"]


def test_check_names_narrowed_by_the_environment(monkeypatch):
    module = ranks.load_module(DATA / "bad_checks.py")
    monkeypatch.setenv("XELINK_TEST_CHECKS", "passes,never")
    assert ranks.check_names(module, "mpi", 2) == ["check_passes", "check_never_reached"]
    monkeypatch.setenv("XELINK_TEST_CHECKS", "")
    assert len(ranks.check_names(module, "mpi", 2)) == 5


def test_check_names_narrowed_to_the_items_pytest_kept(monkeypatch):
    """The conftest names a launch's kept checks (others deselected by -k) in ranks.SELECTED, exactly."""
    path = DATA / "bad_checks.py"
    module = ranks.load_module(path)
    monkeypatch.setenv(ranks.SELECTED, ",".join(ranks.key(path, c) for c in ("check_passes", "check_never_reached")))
    assert ranks.check_names(module, "mpi", 2) == ["check_passes", "check_never_reached"]
    monkeypatch.setenv(ranks.SELECTED, ranks.key(DATA / "first_checks.py", "check_passes"))  # another module's
    assert ranks.check_names(module, "mpi", 2) == []


def test_launch_commands():
    mpi = ranks.launch_command("mpi", 4, Path("m.py"), Path("/o"))
    assert mpi[1:3] == ["-n", "4"] and mpi[3] == sys.executable and mpi[-3:] == ["/o", "mpi", "m.py"]
    both = ranks.launch_command("mpi", 2, [Path("a.py"), Path("b.py")], Path("/o"))
    assert both[-4:] == ["/o", "mpi", "a.py", "b.py"]
    tr = ranks.launch_command("torchrun", 2, Path("m.py"), Path("/o"))
    assert tr[:3] == [sys.executable, "-m", "torch.distributed.run"] and "--nproc-per-node=2" in tr


def test_every_test_starts_seeded_from_its_id(request):
    salt = os.environ.get("XELINK_TEST_SEED", "")
    assert torch.initial_seed() == zlib.crc32(f"{salt}{request.node.nodeid}".encode())  # the conftest's seed
    first = torch.rand(4), np.random.rand(4)
    ranks.seed("check_x", 3)
    again = torch.rand(4), np.random.rand(4)
    ranks.seed("check_x", 3)
    assert torch.equal(torch.rand(4), again[0]) and np.array_equal(np.random.rand(4), again[1])
    ranks.seed("check_x", 4)  # another rank draws other data
    assert not torch.equal(torch.rand(4), again[0]) and not torch.equal(first[0], again[0])

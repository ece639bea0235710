"""Checks that misbehave on purpose, for tests/test_harness.py (not collected as tests themselves)."""
import time

import pytest

from ranks import only

WORLD_SIZES = (2,)


def check_passes(world):
    assert world.size == 2


def check_skips_on_rank_0(world):
    if world.rank == 0:
        pytest.skip("nothing to compare against here")


@only(sizes=(3,))
def check_only_at_three_ranks(world):
    raise AssertionError("run at a size it was not meant for")


def check_fails_on_rank_1(world):
    if world.rank == 1:
        raise AssertionError("rank 1 disagrees")


def check_hangs_on_rank_1(world):
    if world.rank == 1:
        time.sleep(3600)


def check_never_reached(world):
    pass

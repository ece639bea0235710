"""Checks that misbehave on purpose, for tests/test_harness.py (not collected as tests themselves)."""
import time

WORLD_SIZES = (2,)


def check_passes(world):
    assert world.size == 2


def check_fails_on_rank_1(world):
    if world.rank == 1:
        raise AssertionError("rank 1 disagrees")


def check_hangs_on_rank_1(world):
    if world.rank == 1:
        time.sleep(3600)


def check_never_reached(world):
    pass

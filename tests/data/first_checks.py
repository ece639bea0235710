"""Checks that pass, launched before crash_checks.py in one launch by tests/test_harness.py."""
WORLD_SIZES = (2,)


def check_passes_first(world):
    world.barrier(timeout=5)

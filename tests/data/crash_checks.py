"""A rank that dies outright, for tests/test_harness.py."""
import os


def check_rank_1_exits(world):
    if world.rank == 1:
        os._exit(3)
    world.barrier(timeout=5)

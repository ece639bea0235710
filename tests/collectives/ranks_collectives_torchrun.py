"""The collective checks again under torchrun (torch.distributed gloo host transport)."""
from ranks_collectives import *  # noqa: F401,F403

LAUNCHERS = ("torchrun",)
WORLD_SIZES = (4,)

"""The communicator checks again under torchrun (torch.distributed host transport)."""
from ranks_comm import *  # noqa: F401,F403

LAUNCHERS = ("torchrun",)
WORLD_SIZES = (4,)

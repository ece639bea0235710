"""xelink: topology-aware collectives and fast local kernels for multi-GPU jobs."""
from .comm import Communicator, new_group
from .errors import LaunchError, NotInitializedError, TimeoutError, XelinkError
from .runtime import finalize, get_world, init, is_initialized

__version__ = "0.1.0"

__all__ = [
    "Communicator",
    "LaunchError",
    "NotInitializedError",
    "TimeoutError",
    "XelinkError",
    "finalize",
    "get_world",
    "init",
    "is_initialized",
    "new_group",
    "__version__",
]

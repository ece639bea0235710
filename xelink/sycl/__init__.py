"""xelink's collectives on SYCL devices through dpctl, one process driving several devices (``api``)."""
from .api import (ALGOS, SyclArray, SyclCommunicator, all_gather_into_tensor, all_reduce, all_to_all_single, barrier,
                  broadcast, communicators, empty, reduce_scatter_tensor, topology)

__all__ = ["ALGOS", "SyclArray", "SyclCommunicator", "all_gather_into_tensor", "all_reduce", "all_to_all_single",
           "barrier", "broadcast", "communicators", "empty", "reduce_scatter_tensor", "topology"]

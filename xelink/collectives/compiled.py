"""The collectives as torch custom ops (``torch.ops.xelink.*``), so that ``torch.compile`` can trace them.

Under ``torch.compile`` the public functions (``xelink.all_reduce`` ...) call these ops instead of
running Python that Dynamo cannot follow; the ops' fake implementations tell the compiler they only
mutate their output. Eagerly, an op runs the public function on the communicator named by ``group``
("" for the world). ``async_op=True`` is not traceable and raises.
"""
from __future__ import annotations

import torch

from ..comm import named, resolve_group
from ..errors import XelinkError

__all__ = ["comm_named", "group_name", "traced", "bind"]


def comm_named(name: str):
    """The live communicator called ``name`` ("" is the world)."""
    try:
        return named(name)
    except XelinkError as exc:
        raise XelinkError(f"xelink custom op: {exc}") from None


def group_name(group, fn: str = "torch.compile") -> str:
    """The name the traced ops carry for ``group`` (a communicator or its torch.distributed group; None: the world)."""
    return "" if group is None else resolve_group(group, fn).name


def traced(fn: str, async_op: bool) -> None:
    if async_op:
        raise ValueError(f"{fn}: async_op=True cannot be traced by torch.compile; use async_op=False")


# The front doors the ops run eagerly (``api`` binds them when it is imported; this module cannot import it:
# ``api`` calls the ops).
_front: dict = {}


def bind(**functions) -> None:
    _front.update(functions)


@torch.library.custom_op("xelink::all_reduce_", mutates_args=("tensor",))
def all_reduce_(tensor: torch.Tensor, op: str, algo: str, group: str) -> None:
    _front["all_reduce"](tensor, op, comm_named(group), algo=algo)


@torch.library.custom_op("xelink::all_gather_into_tensor_", mutates_args=("output",))
def all_gather_into_tensor_(output: torch.Tensor, input: torch.Tensor, algo: str, group: str) -> None:
    _front["all_gather_into_tensor"](output, input, comm_named(group), algo=algo)


@torch.library.custom_op("xelink::reduce_scatter_tensor_", mutates_args=("output",))
def reduce_scatter_tensor_(output: torch.Tensor, input: torch.Tensor, op: str, algo: str, group: str) -> None:
    _front["reduce_scatter_tensor"](output, input, op, comm_named(group), algo=algo)


for _op in (all_reduce_, all_gather_into_tensor_, reduce_scatter_tensor_):
    _op.register_fake(lambda *args: None)

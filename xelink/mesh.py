"""A grid of the world's ranks with one communicator a dimension, as torch.distributed's ``DeviceMesh``.

``init_device_mesh("cuda", (2, 4), mesh_dim_names=("dp", "tp"))`` lays the world's ranks out row-major (rank
``r`` at ``numpy.unravel_index(r, shape)``: the last dimension's ranks consecutive) and splits the world once a
dimension: ``mesh.get_group("tp")`` is this rank's communicator along "tp" (the ranks that share its other
coordinates, in coordinate order). Any xelink call takes those groups; so do the composed ops and the Llama model
(TP groups of consecutive ranks: the last dimension, as ``xelink generate`` lays out replicas x CP x TP).
"""
from __future__ import annotations

import math

from .comm import Communicator, get_world
from .config import is_int
from .runtime import init, is_initialized

__all__ = ["DeviceMesh", "init_device_mesh"]


class DeviceMesh:
    """This rank's view of a grid of world ranks: the grid (``mesh``, a tensor of world ranks), its
    dimensions' names, and a communicator along each dimension. Made by :func:`init_device_mesh`; indexing by
    names (``mesh["tp"]``, ``mesh["dp", "tp"]``) gives the sub-grid through this rank along those dimensions."""

    def __init__(self, device_type: str, mesh, dim_names, groups, rank: int):
        self.device_type, self.mesh, self.mesh_dim_names = device_type, mesh, dim_names
        self._groups, self._rank = list(groups), rank

    @property
    def ndim(self) -> int:
        return self.mesh.dim()

    @property
    def shape(self) -> tuple:
        return tuple(self.mesh.shape)

    def _dim(self, mesh_dim, fn: str) -> int:
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"DeviceMesh.{fn}: this mesh has {self.ndim} dimensions {self.mesh_dim_names}; "
                                 f"name one (mesh_dim=)")
            return 0
        if isinstance(mesh_dim, str):
            if self.mesh_dim_names is None or mesh_dim not in self.mesh_dim_names:
                raise KeyError(f"DeviceMesh.{fn}: mesh_dim={mesh_dim!r} is not one of {self.mesh_dim_names}")
            return self.mesh_dim_names.index(mesh_dim)
        if not is_int(mesh_dim) or not -self.ndim <= mesh_dim < self.ndim:
            raise ValueError(f"DeviceMesh.{fn}: mesh_dim={mesh_dim!r} must be a name or an index below {self.ndim}")
        return int(mesh_dim) % self.ndim

    def get_group(self, mesh_dim=None) -> Communicator:
        """This rank's communicator along ``mesh_dim`` (a name or an index; None on a one-dimensional mesh)."""
        return self._groups[self._dim(mesh_dim, "get_group")]

    def get_all_groups(self) -> list:
        return list(self._groups)

    def size(self, mesh_dim=None) -> int:
        """The ranks along ``mesh_dim``; None: every rank of the mesh."""
        return self.mesh.numel() if mesh_dim is None else self.shape[self._dim(mesh_dim, "size")]

    def get_rank(self) -> int:
        """This process's world rank."""
        return self._rank

    def get_coordinate(self) -> list:
        """This rank's index along each dimension."""
        return [int(i) for i in (self.mesh == self._rank).nonzero()[0]]

    def get_local_rank(self, mesh_dim=None) -> int:
        """This rank's index along ``mesh_dim`` (its rank in ``get_group(mesh_dim)``)."""
        return self.get_coordinate()[self._dim(mesh_dim, "get_local_rank")]

    def __getitem__(self, names) -> "DeviceMesh":
        names = (names,) if isinstance(names, str) else tuple(names)
        dims = [self._dim(n, "__getitem__") if isinstance(n, str) else None for n in names]
        if None in dims or dims != sorted(set(dims)):
            raise KeyError(f"DeviceMesh: {names!r} must name distinct dimensions of {self.mesh_dim_names}, in "
                           f"the mesh's order")
        at = self.get_coordinate()
        sub = self.mesh[tuple(slice(None) if d in dims else at[d] for d in range(self.ndim))]
        return DeviceMesh(self.device_type, sub, names, [self._groups[d] for d in dims], self._rank)

    def __repr__(self) -> str:
        named = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.device_type!r}, {self.mesh.tolist()}{named})"


def init_device_mesh(device_type: str, mesh_shape, *, mesh_dim_names=None, backend_override=None) -> DeviceMesh:
    """A ``DeviceMesh`` over the world's ranks, as torch.distributed.device_mesh.init_device_mesh (``init`` first
    where xelink is not initialized). ``device_type`` must be the kind of device the ranks drive ("cuda", "xpu",
    "cpu"); the product of ``mesh_shape`` must be the world size; ``mesh_dim_names``, where given, one distinct
    name a dimension; ``backend_override`` is taken and unused (one communicator serves every device). Every
    argument is checked before the world is split.

    Collective: every rank of the world must call this with the same arguments.
    """
    import torch

    fn = "init_device_mesh"
    world = get_world() if is_initialized() else init()
    if not isinstance(device_type, str) or torch.device(world.device).type != device_type:
        raise ValueError(f"{fn}: device_type={device_type!r}, but the ranks drive {torch.device(world.device).type} "
                         f"devices")
    shape = (mesh_shape,) if isinstance(mesh_shape, int) and not isinstance(mesh_shape, bool) else mesh_shape
    if not isinstance(shape, (tuple, list)) or not shape or \
            not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape):
        raise ValueError(f"{fn}: mesh_shape={mesh_shape!r} must be a tuple of ints >= 1")
    if math.prod(shape) != world.size:
        raise ValueError(f"{fn}: mesh_shape={tuple(shape)} holds {math.prod(shape)} ranks, the world has {world.size}")
    if mesh_dim_names is not None:
        names = tuple(mesh_dim_names) if isinstance(mesh_dim_names, (tuple, list)) else None
        if names is None or len(names) != len(shape) or len(set(names)) != len(names) or \
                not all(isinstance(n, str) for n in names):
            raise ValueError(f"{fn}: mesh_dim_names={mesh_dim_names!r} must be {len(shape)} distinct names, one a "
                             f"dimension of mesh_shape={tuple(shape)}")
        mesh_dim_names = names
    mesh = torch.arange(world.size).view(*shape)
    at = [int(i) for i in (mesh == world.rank).nonzero()[0]]
    groups = []
    for d in range(len(shape)):  # the ranks that share every other coordinate, ordered along d
        others = [at[e] if e != d else 0 for e in range(len(shape))]
        groups.append(world.split(int(mesh[tuple(others)]), key=at[d]))
    return DeviceMesh(device_type, mesh, mesh_dim_names, groups, world.rank)

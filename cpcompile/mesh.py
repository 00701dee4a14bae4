"""The one mesh rule: which process group is the CP group, from a DeviceMesh, a ProcessGroup or the default.

A 1-D mesh is all CP; a multi-dim mesh must name its CP dim "cp", or hold a 2-D CP mesh as two dims named
"cp_inter" (across nodes) and "cp_intra" (inside a node). The CP group of a 2-D CP mesh is the two dims flattened:
CP rank = inter rank * intra size + intra rank, the order every layout shards by (shard_batch, the regions), and
`CPGroup.levels` keeps the two dims' groups for comm="hierarchical". The backend, the sharding helpers and the
DTensor paths all ask here, so the rule and its messages exist once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

from .compat.mesh_flatten import flatten_dims
from .errors import CPCompileError

CP_DIM_NAME = "cp"
CP_LEVEL_NAMES = ("cp_inter", "cp_intra")
"""The dims of a 2-D CP mesh: across nodes (outer), inside a node (inner)."""


@dataclass(frozen=True)
class CPLevel:
    """One dim of a 2-D CP mesh as a region needs it: its group's name, this rank in it and its size."""

    name: str
    rank: int
    size: int


@dataclass(frozen=True, init=False)
class CPGroup:
    """The CP process group as the pass needs it: a name funcol understands, this rank and the size.

    It holds the ProcessGroup weakly. Plans keep their CPGroup, and plans live on in compiled graphs' metadata and
    in the backend (Dynamo keeps both after the training loop); a strong reference kept the process group alive
    past destroy_process_group, so gloo's worker threads outlived it and could free a collective's tensor while
    the interpreter shut down: a C++ terminate after the run was done (examples/torchrun, issue 43;
    tests/unit/test_shutdown.py)."""

    name: str
    rank: int
    size: int
    levels: tuple[CPLevel, CPLevel] | None = None
    """(inter, intra) when the CP group is a 2-D CP mesh flattened (rank = inter.rank * intra.size + intra.rank);
    None for a 1-D CP group."""
    _group: Callable[[], dist.ProcessGroup | None] = field(default=lambda: None, compare=False, repr=False)

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        name: str,
        rank: int,
        size: int,
        levels: tuple[CPLevel, CPLevel] | None = None,
    ) -> None:
        for key, value in (("name", name), ("rank", rank), ("size", size), ("levels", levels)):
            object.__setattr__(self, key, value)
        object.__setattr__(self, "_group", (lambda: None) if group is None else weakref.ref(group))

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group (None for explain's stand-in, and once the group is destroyed)."""
        return self._group()

    @property
    def level_sizes(self) -> tuple[int, int] | None:
        """(inter size, intra size) of a 2-D CP mesh, else None."""
        return None if self.levels is None else (self.levels[0].size, self.levels[1].size)


def check_mesh_or_group(mesh, group) -> None:
    """At most one of mesh= and group= (each names a CP group; two could disagree)."""
    if mesh is not None and group is not None:
        raise CPCompileError(
            "both mesh= and group= were given; they would name two CP groups. Fix: pass only one of them."
        )


def cp_mesh_dim(mesh) -> int | None:
    """Index of the CP dim of a DeviceMesh: the only dim of a 1-D mesh, else the dim named "cp" (None if none)."""
    if mesh.ndim == 1:
        return 0
    names = mesh.mesh_dim_names or ()
    return names.index(CP_DIM_NAME) if CP_DIM_NAME in names else None


def cp_level_dims(mesh) -> tuple[int, int] | None:
    """Indices of the (inter, intra) dims of a 2-D CP mesh: a mesh with no dim named "cp" and both dims named
    "cp_inter" and "cp_intra" (None otherwise)."""
    names = mesh.mesh_dim_names or ()
    if mesh.ndim == 1 or CP_DIM_NAME in names or not set(CP_LEVEL_NAMES) <= set(names):
        return None
    return names.index(CP_LEVEL_NAMES[0]), names.index(CP_LEVEL_NAMES[1])


def no_cp_dim_problem(mesh) -> tuple[str, str]:
    """(rule broken, fix) for a mesh without a CP dim, worded once for every caller."""
    return (
        f"the DeviceMesh has {mesh.ndim} dims named {mesh.mesh_dim_names}, none named '{CP_DIM_NAME}'",
        f"pass a 1-D mesh or name the context-parallel dim '{CP_DIM_NAME}' (mesh_dim_names=(..., '{CP_DIM_NAME}'))",
    )


def require_cp_mesh_dim(mesh) -> int:
    """cp_mesh_dim, or a CPCompileError when the mesh has no CP dim."""
    dim = cp_mesh_dim(mesh)
    if dim is None:
        rule, fix = no_cp_dim_problem(mesh)
        raise CPCompileError(f"{rule}. Fix: {fix}.")
    return dim


def group_of(pg: dist.ProcessGroup) -> CPGroup:
    """CPGroup of a process group this rank belongs to (a CPCompileError when it is not a member)."""
    if pg is None or pg is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(pg) < 0:
        raise CPCompileError(
            f"this process (global rank {dist.get_rank()}) is not a member of the CP group it was given, so it has "
            "no tokens of that group's sequences. Fix: compile the CP model only on the group's ranks, or pass "
            "the group (or mesh) this rank belongs to."
        )
    return CPGroup(group=pg, name=pg.group_name, rank=dist.get_rank(pg), size=dist.get_world_size(pg))


def resolve_group(mesh=None, group: dist.ProcessGroup | None = None) -> CPGroup:
    """Return the CP group from a 1-D DeviceMesh, a mesh with a dim named "cp", a 2-D CP mesh (dims "cp_inter"
    and "cp_intra", flattened), a ProcessGroup or the default.

    Exactly one of `mesh` and `group` may be given; neither means the default (world) group.
    """
    check_mesh_or_group(mesh, group)
    if not dist.is_available() or not dist.is_initialized():
        raise CPCompileError(
            "torch.distributed is not initialized, so there is no CP group. "
            "Fix: call torch.distributed.init_process_group() first (torchrun does the rendezvous)."
        )
    if mesh is not None and cp_level_dims(mesh) is not None:
        return _levels_group(mesh)
    if mesh is not None and cp_mesh_dim(mesh) is None:
        rule, fix = no_cp_dim_problem(mesh)
        raise CPCompileError(f"{rule}. Fix: {fix}, or name two dims {CP_LEVEL_NAMES} for a 2-D CP mesh.")
    if mesh is not None:
        pg = mesh.get_group(cp_mesh_dim(mesh))
    else:
        pg = group if group is not None else dist.group.WORLD
    return group_of(pg)


def _level(mesh, name: str) -> CPLevel:
    pg = mesh.get_group(name)
    return CPLevel(name=pg.group_name, rank=dist.get_rank(pg), size=dist.get_world_size(pg))


def _levels_group(mesh) -> CPGroup:
    """The CP group of a 2-D CP mesh: its two dims flattened (DeviceMesh caches the flattened group, so every
    call on every rank returns the same one), with the two dims' groups as `levels`."""
    flat = group_of(flatten_dims(mesh, CP_LEVEL_NAMES))
    inter, intra = _level(mesh, CP_LEVEL_NAMES[0]), _level(mesh, CP_LEVEL_NAMES[1])
    if flat.rank != inter.rank * intra.size + intra.rank:  # the order the layouts and regions assume
        raise CPCompileError(
            f"the flattened CP group of the mesh {mesh.mesh_dim_names} puts this process at CP rank {flat.rank}, "
            f"not {inter.rank} * {intra.size} + {intra.rank} (inter rank * intra size + intra rank). Fix: build the "
            f"mesh with init_device_mesh, its dims in the order {CP_LEVEL_NAMES}."
        )
    return CPGroup(group=flat.group, name=flat.name, rank=flat.rank, size=flat.size, levels=(inter, intra))

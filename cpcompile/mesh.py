"""The one mesh rule: which process group is the CP group, from a DeviceMesh, a ProcessGroup or the default.

A 1-D mesh is all CP; a multi-dim mesh must name its CP dim "cp". The backend, the sharding helpers and the
DTensor paths all ask here, so the rule and its messages exist once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from .errors import CPCompileError

CP_DIM_NAME = "cp"


@dataclass(frozen=True)
class CPGroup:
    """The CP process group as the pass needs it: a name funcol understands, this rank and the size."""

    group: dist.ProcessGroup
    name: str
    rank: int
    size: int


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
    """Return the CP group from a 1-D DeviceMesh, a mesh with a dim named "cp", a ProcessGroup or the default.

    Exactly one of `mesh` and `group` may be given; neither means the default (world) group.
    """
    check_mesh_or_group(mesh, group)
    if not dist.is_available() or not dist.is_initialized():
        raise CPCompileError(
            "torch.distributed is not initialized, so there is no CP group. "
            "Fix: call torch.distributed.init_process_group() first (torchrun does the rendezvous)."
        )
    if mesh is not None:
        pg = mesh.get_group(require_cp_mesh_dim(mesh))
    else:
        pg = group if group is not None else dist.group.WORLD
    return group_of(pg)

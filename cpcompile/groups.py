"""Resolve the user's mesh / group arguments into the one CP process group the pass and helpers use."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from .errors import CPCompileError


@dataclass(frozen=True)
class CPGroup:
    """The CP process group as the pass needs it: a name funcol understands, this rank and the size."""

    group: dist.ProcessGroup
    name: str
    rank: int
    size: int


def resolve_group(mesh=None, group: dist.ProcessGroup | None = None) -> CPGroup:
    """Return the CP group from a 1-D DeviceMesh, a mesh with a dim named "cp", a ProcessGroup or the default.

    Exactly one of `mesh` and `group` may be given; neither means the default (world) group.
    """
    if mesh is not None and group is not None:
        raise CPCompileError(
            "both mesh= and group= were given; they would name two CP groups. Fix: pass only one of them."
        )
    if not dist.is_available() or not dist.is_initialized():
        raise CPCompileError(
            "torch.distributed is not initialized, so there is no CP group. "
            "Fix: call torch.distributed.init_process_group() first (torchrun does the rendezvous)."
        )
    if mesh is not None:
        names = mesh.mesh_dim_names or ()
        if mesh.ndim == 1:
            pg = mesh.get_group()
        elif "cp" in names:
            pg = mesh.get_group("cp")
        else:
            raise CPCompileError(
                f"the DeviceMesh has {mesh.ndim} dims named {names}, none named 'cp'. "
                "Fix: pass a 1-D mesh or name the context-parallel dim 'cp' (mesh_dim_names=(..., 'cp'))."
            )
    else:
        pg = group if group is not None else dist.group.WORLD
    return CPGroup(group=pg, name=pg.group_name, rank=dist.get_rank(pg), size=dist.get_world_size(pg))

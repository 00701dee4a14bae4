"""DTensor forms of the sharding helpers: wrap a rank's tokens as a DTensor, read mesh and seq dim back from one.

A DTensor placed `Shard(seq_dim)` on the CP mesh dim is the flat layout exactly (what `distribute_tensor` makes).
For zigzag the placement is the same `Shard(seq_dim)` but the local tokens are the layout's chunks (as
`cpcompile.shard` cuts them): a placement cannot express the permutation, so `strategy=` says it, and
`full_tensor()` of such a DTensor returns the permuted sequence; use `cpcompile.unshard` to undo it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..errors import CPCompileError
from ..mesh import require_cp_mesh_dim, resolve_group


def local_to_dtensor(local: torch.Tensor, seq_dim: int, mesh) -> DTensor:
    """Wrap this rank's tokens as a DTensor: Shard(seq_dim) on the CP mesh dim, Shard(0) (batch) on the others.

    On a 2-D (dp, cp) mesh `local` is this data-parallel rank's batch, so the other mesh dims shard dim 0.
    """
    if mesh is None:
        raise CPCompileError("as_dtensor=True needs the DeviceMesh to place the tokens on. Fix: pass mesh=.")
    cp_dim = require_cp_mesh_dim(mesh)
    if mesh.ndim > 1 and seq_dim == 0:
        raise CPCompileError(
            "as_dtensor=True on a multi-dim mesh shards dim 0 (batch) over the non-CP dims, but seq_dim is 0. "
            "Fix: put the batch on dim 0 and the sequence on another dim."
        )
    placements = [Shard(seq_dim) if i == cp_dim else Shard(0) for i in range(mesh.ndim)]
    return DTensor.from_local(local, mesh, placements, run_check=False)


def dtensor_local(x: DTensor, seq_dim: int | None, mesh=None, group=None) -> tuple[torch.Tensor, int, object]:
    """(local tokens, seq dim, mesh) of a DTensor sharded over a CP mesh dim; checks seq_dim/mesh/group agree."""
    cp_dim = require_cp_mesh_dim(x.device_mesh)
    place = x.placements[cp_dim]
    if type(place) is not Shard:
        raise CPCompileError(
            f"the DTensor is placed {place} on the CP mesh dim; unshard needs Shard(seq_dim) there. "
            "Fix: pass a sequence-sharded DTensor (full_tensor() already gives a replicated one in full)."
        )
    found = place.dim % x.dim()
    if seq_dim is not None and seq_dim % x.dim() != found:
        raise CPCompileError(
            f"seq_dim={seq_dim} but the DTensor is sharded over the CP mesh dim on dim {found}. "
            "Fix: drop seq_dim= (it is read from the placement) or pass the sharded dim."
        )
    for i, p in enumerate(x.placements):
        if i != cp_dim and not isinstance(p, (Replicate, Shard)):
            raise CPCompileError(f"the DTensor is placed {p} on mesh dim {i}. Fix: reduce it (redistribute) first.")
    if mesh is not None or group is not None:
        asked = dist.get_process_group_ranks(resolve_group(mesh, group).group)
        have = dist.get_process_group_ranks(x.device_mesh.get_group(cp_dim))
        if asked != have:
            raise CPCompileError(
                f"mesh=/group= names CP ranks {asked} but the DTensor is sharded over ranks {have}. "
                "Fix: drop mesh=/group= (it is read from the DTensor)."
            )
    return x.to_local(), found, x.device_mesh

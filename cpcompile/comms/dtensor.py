"""Run a CP region on DTensor q/k/v: unwrap to local shards, attend, rewrap with the query's placement.

DTensor never propagates sharding through attention: the region sees local tokens (as with plain tensors) and
its output is placed exactly like q (Shard(2) on the CP mesh dim), so the token-wise ops after it stay local.
The planner has checked that every rank holds an equal shard, so from_local needs no run_check.
"""

from __future__ import annotations

from torch.distributed.tensor import DTensor

from .registry import get_comm


def dtensor_region(q: DTensor, k: DTensor, v: DTensor, *, comm: str, **region_kwargs) -> DTensor:
    """The comm's dense region on the local shards of q/k/v; the output is a DTensor on q's mesh, placed like q."""
    out = get_comm(comm).regions["sdpa"].attention(q.to_local(), k.to_local(), v.to_local(), **region_kwargs)
    return DTensor.from_local(out, q.device_mesh, q.placements, run_check=False)

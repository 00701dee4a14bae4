"""DTensor attention sites: read the CP mesh and sequence dim from the placements, check them, localise shapes.

Dynamo traces a model that takes DTensors with global shapes. For an SDPA site whose q/k/v are DTensors, the
sequence must be sharded over the CP mesh dim (`Shard(2)` of (batch, heads, seq, head_dim)); the CP group is that
mesh dim's group, so the user need not pass mesh= (if they do, it must name the same ranks). The returned site
carries the LOCAL shapes, so the ordinary planner validates it like a plain-tensor site.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..errors import site_error
from ..families.site import AttentionSite, traced_tensor
from ..layouts import get_layout
from ..mesh import CPGroup, cp_mesh_dim, group_of, no_cp_dim_problem, resolve_group

SEQ_DIM = 2
"""SDPA inputs are (batch, heads, seq, head_dim): CP shards dim 2."""


def is_dtensor_site(site: AttentionSite) -> bool:
    """True when the site's query was traced as a DTensor."""
    return isinstance(traced_tensor(site.query), DTensor)


def _describe(p) -> str:
    return f"{type(p).__name__}({p.dim})" if isinstance(p, Shard) else repr(p)


def localize_dtensor_site(site: AttentionSite, strategy: str, mesh=None, group=None) -> tuple[AttentionSite, CPGroup]:
    """Check a DTensor site's placements and return (site with local shapes, CP group of its mesh)."""
    node = site.node
    vals = {name: traced_tensor(n) for name, n in (("query", site.query), ("key", site.key), ("value", site.value))}
    if not all(isinstance(v, DTensor) for v in vals.values()):
        kinds = {name: type(v).__name__ for name, v in vals.items()}
        raise site_error(
            node,
            f"q/k/v mix DTensor and plain tensors ({kinds})",
            "pass all three as DTensors on the same mesh, or all three as local tensors",
        )
    q = vals["query"]
    dmesh, placements = q.device_mesh, tuple(q.placements)
    for name, v in vals.items():
        if v.device_mesh != dmesh or tuple(v.placements) != placements:
            raise site_error(
                node,
                f"{name} is placed {tuple(v.placements)} on {v.device_mesh} but query {placements} on {dmesh}",
                "place q, k and v identically (Shard(2) of (batch, heads, seq, head_dim) on the CP mesh dim)",
            )
    cp_dim = cp_mesh_dim(dmesh)
    if cp_dim is None:
        raise site_error(node, *no_cp_dim_problem(dmesh))
    cp_place = placements[cp_dim]
    if type(cp_place) is not Shard or cp_place.dim % len(q.shape) != SEQ_DIM:
        what = "replicated" if isinstance(cp_place, Replicate) else f"placed {_describe(cp_place)}"
        raise site_error(
            node,
            f"q/k/v are {what} over the CP mesh dim; CP needs the sequence dim sharded: Shard({SEQ_DIM}) of "
            "(batch, heads, seq, head_dim)",
            "shard the tokens over the CP mesh dim (Shard(seq_dim) of the model input, e.g. "
            "cpcompile.shard(x, ..., as_dtensor=True)) so attention inputs arrive as Shard(2)",
        )
    for i, p in enumerate(placements):
        if i != cp_dim and not (isinstance(p, Replicate) or (type(p) is Shard and p.dim == 0)):
            raise site_error(
                node,
                f"q/k/v are placed {_describe(p)} on mesh dim {i} ({(dmesh.mesh_dim_names or ())[i : i + 1]}); "
                "besides the CP dim cpcompile supports only Replicate or Shard(0) (data parallel over batch)",
                "replicate or batch-shard the other mesh dims",
            )
    cp_pg = dmesh.get_group(cp_dim)
    if mesh is not None or group is not None:
        asked = resolve_group(mesh, group)
        if dist.get_process_group_ranks(asked.group) != dist.get_process_group_ranks(cp_pg):
            raise site_error(
                node,
                f"backend(mesh=/group=) names CP ranks {dist.get_process_group_ranks(asked.group)} but q/k/v are "
                f"sharded over ranks {dist.get_process_group_ranks(cp_pg)} (their mesh {dmesh})",
                "drop mesh=/group= (cpcompile reads the mesh from the DTensors) or pass the mesh the inputs use",
            )
    cp = group_of(cp_pg)
    layout = get_layout(strategy)
    seq = q.shape[SEQ_DIM]
    if seq % layout.required_multiple(cp.size):
        raise site_error(
            node,
            f"the global sequence has {seq} tokens; layout {layout.name!r} with cp={cp.size} needs a multiple of "
            f"{layout.required_multiple(cp.size)} (equal chunks on every rank)",
            f"pad the sequence (cpcompile.pad_to_multiple) to a multiple of {layout.required_multiple(cp.size)}",
        )
    local = {name: tuple(v._local_tensor.shape) for name, v in vals.items()}
    return dataclasses.replace(site, q_shape=local["query"], k_shape=local["key"], v_shape=local["value"]), cp


def region_example_value(site: AttentionSite):
    """The region's output as Dynamo would have traced it: the SDPA output's shape and dtype, placed like q.

    (Dynamo traced SDPA with DTensor's own rule, which redistributes to Replicate; the region keeps Shard(2).)
    """
    q, out = traced_tensor(site.query), traced_tensor(site.node)
    local = out._local_tensor.new_empty(q._local_tensor.shape[:-1] + out.shape[-1:])
    return DTensor.from_local(local, q.device_mesh, q.placements, run_check=False)

"""Plan each attention site: resolve its CP group, pick layout x comm x kernel, check every rule.

SDPA sites go to plan_dense, varlen_attn sites to plan_varlen, flex_attention sites to plan_flex; DTensor sites
first get their CP group and local shapes from their placements (passes/dtensor.py). Every violation is one
CPCompileError naming the node.
"""

from __future__ import annotations

import dataclasses

from ..errors import site_error
from ..families.flex.plan import plan_flex_site
from ..families.plans import CPConfig, CPPlan
from ..families.sdpa.plan import plan_dense_site
from ..families.site import AttentionSite
from ..families.varlen.plan import plan_varlen_site
from ..mesh import resolve_group
from .dtensor import is_dtensor_site, localize_dtensor_site


def plan_site(site: AttentionSite, config: CPConfig) -> CPPlan:
    """Validate `site` against the rules of CP with this config and return its plan (or raise CPCompileError)."""
    refused = site.body.refused_hop if site.body is not None else None
    if refused is not None:
        raise site_error(
            site.node,
            f"it runs inside the body of a torch.ops.higher_order.{refused} call, which may run it a data-dependent "
            "number of times or differentiate it with its own backward; cpcompile rewrites attention in the graph, "
            "in activation-checkpoint and other run-once bodies, and in torch.cond branches only",
            f"move the attention call out of the {refused} body",
        )
    dtensor = is_dtensor_site(site)
    if dtensor and site.kind == "flex":
        raise site_error(
            site.node,
            "its q/k/v are DTensors; cpcompile rewrites flex_attention on plain local tensors only",
            "feed the model plain tensors from cpcompile.shard_batch and the mask from cpcompile.shard_block_mask",
        )
    if dtensor and site.sinks is not None:
        raise site_error(
            site.node,
            "its q/k/v are DTensors and it has attention sinks; cpcompile takes sinks with plain local tensors only",
            "feed the model plain tensors from cpcompile.shard_batch",
        )
    if dtensor:  # mesh and seq dim come from the placements
        site, group = localize_dtensor_site(site, config.strategy, config.mesh, config.group)
    else:
        group = config.cp_group or resolve_group(config.mesh, config.group)
    if site.kind == "flex" and config.regather:
        raise site_error(
            site.node,
            "regather=True: the flex_attention region keeps its gathered K/V for backward and cannot gather again",
            "drop regather for models with flex_attention (or use per-block activation checkpointing)",
        )
    planner = {"varlen": plan_varlen_site, "flex": plan_flex_site}.get(site.kind, plan_dense_site)
    plan = planner(site, config, group)
    changes = {"dtensor": True} if dtensor else {}
    if config.regather:
        changes["regather"] = True
    return dataclasses.replace(plan, **changes) if changes else plan

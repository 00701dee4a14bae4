"""Plan each attention site: resolve its CP group, hand the site to its family's planner (families/registry.py),
which picks layout x comm x kernel and checks every rule.

DTensor sites first get their CP group and local shapes from their placements (passes/dtensor.py). Every
violation is one CPCompileError naming the node.
"""

from __future__ import annotations

import dataclasses

from ..errors import site_error
from ..families.plans import CPConfig, CPPlan
from ..families.registry import get_family
from ..families.site import AttentionSite
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
    family = get_family(site.kind)
    dtensor = is_dtensor_site(site)
    if dtensor and family.dtensor_refusal is not None:
        raise site_error(site.node, *family.dtensor_refusal)
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
    if config.regather and family.regather_refusal is not None:
        raise site_error(site.node, *family.regather_refusal)
    plan = family.plan(site, config, group)
    changes = {"dtensor": True} if dtensor else {}
    if config.regather:
        changes["regather"] = True
    if config.deferred_merge:
        changes["deferred_merge"] = True
    return dataclasses.replace(plan, **changes) if changes else plan

"""Replace each planned attention node by a call of its CP region (one call_function node per site), in
whichever graph it lives (the top-level graph or a higher-order-op body); then insert the run-time guards
(regions/guards.py): torch.cond conditions around rewritten sites agreed across ranks, each family's checks once
per graph (Family.insert_checks: varlen's packed metadata), and the batch check once per graph (positions, padding,
an unsharded batch: passes/batch_check.py)."""

from __future__ import annotations

import torch.fx

from ..comms.dtensor import dtensor_region
from ..families.plans import CPPlan
from ..families.registry import get_family
from ..regions.guards import agree_condition
from .batch_check import insert_batch_checks
from .dtensor import region_example_value


def _replace(plan: CPPlan) -> torch.fx.Node:
    """Swap the plan's node for its region call in place; the new node keeps the old node's metadata."""
    node = plan.site.node
    graph = node.graph
    target, kwargs = plan.region_target(), plan.region_kwargs()
    plan.prepare_rewrite()
    if plan.dtensor:  # DTensor q/k/v: the region runs on their local shards
        target, kwargs = dtensor_region, dict(comm=plan.comm, **kwargs)
    with graph.inserting_before(node):
        region = graph.call_function(target, args=plan.region_args(), kwargs=kwargs)
    region.meta = dict(node.meta)
    region.meta["cpcompile_plan"] = plan
    if plan.dtensor:
        region.meta["example_value"] = region_example_value(plan.site)
    node.replace_all_uses_with(region)
    graph.erase_node(node)
    return region


def _agree_branch(cond: torch.fx.Node, plan: CPPlan) -> None:
    """Make the torch.cond `cond` take its condition through agree_condition (tensor conditions only: a Python
    or shape condition is the same on every rank already)."""
    pred = cond.args[0]
    if not isinstance(pred, torch.fx.Node) or (pred.op == "call_function" and pred.target is agree_condition):
        return
    with cond.graph.inserting_before(cond):
        agreed = cond.graph.call_function(
            agree_condition, (pred,), dict(group_name=plan.group.name, world=plan.group.size)
        )
    agreed.meta = dict(pred.meta)
    cond.replace_input_with(pred, agreed)


def rewrite_graph(gm: torch.fx.GraphModule, plans: list[CPPlan], check_batch: bool = True) -> torch.fx.GraphModule:
    """Rewrite every planned site in place (in its own graph), insert the run-time checks (`check_batch`: the batch
    check too, passes/batch_check.py), then lint and recompile each changed module."""
    changed = {id(gm): gm}
    regions: dict[tuple[str, int], list[tuple[torch.fx.Node, CPPlan]]] = {}
    for plan in plans:
        body = plan.site.body
        region = _replace(plan)
        regions.setdefault((plan.site.kind, id(region.graph)), []).append((region, plan))
        if body is not None:
            for cond in body.branches:
                _agree_branch(cond, plan)
            changed.update((id(m), m) for m in (body.module, *(h.graph.owning_module for h in body.hops)))
    for (kind, _), found in regions.items():
        checks = get_family(kind).insert_checks
        if checks is not None:
            checks(found)
    if check_batch:
        insert_batch_checks([rp for found in regions.values() for rp in found])
    for module in changed.values():
        module.graph.lint()
        module.recompile()
    return gm

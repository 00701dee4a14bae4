"""Replace each planned attention node by a call of its CP region (one call_function node per site)."""

from __future__ import annotations

import torch.fx

from ..regions.dtensor import dtensor_region
from .dtensor import region_example_value
from .plans import CPPlan


def rewrite_graph(gm: torch.fx.GraphModule, plans: list[CPPlan]) -> torch.fx.GraphModule:
    """Swap every planned node for its region call in place; the new node keeps the old node's metadata."""
    graph = gm.graph
    for plan in plans:
        node = plan.site.node
        target, kwargs = plan.region_target(), plan.region_kwargs()
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
    graph.lint()
    gm.recompile()
    return gm

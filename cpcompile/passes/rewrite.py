"""Replace each planned attention node by a call of its CP region (one call_function node per site)."""

from __future__ import annotations

import torch.fx

from ..regions import REGIONS
from .plan import CPPlan


def rewrite_graph(gm: torch.fx.GraphModule, plans: list[CPPlan]) -> torch.fx.GraphModule:
    """Swap every planned node for its region call in place; the new node keeps the old node's metadata."""
    graph = gm.graph
    for plan in plans:
        node = plan.site.node
        with graph.inserting_before(node):
            region = graph.call_function(
                REGIONS[plan.comm],
                args=(plan.site.query, plan.site.key, plan.site.value),
                kwargs=plan.region_kwargs(),
            )
        region.meta = dict(node.meta)
        region.meta["cpcompile_plan"] = plan
        node.replace_all_uses_with(region)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm

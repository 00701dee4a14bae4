"""The sdpa family's run-time guard, inserted by the rewrite once per graph: cpcompile.attention's token metadata
(position ids, padding mask) checked on every rank (regions/guards.py)."""

from __future__ import annotations

import torch.fx

from ...regions.guards import check_dense_tokens
from ..plans import CPPlan


def check_tokens(regions: list[tuple[torch.fx.Node, CPPlan]]) -> None:
    """One check_dense_tokens call (regions/guards.py) per distinct (position ids, padding mask) pair of one
    graph's cpcompile.attention regions, inserted before the first of them. It has no users: its device asserts
    are the point, and aot_autograd keeps them (side effects); the token guard skips it (`cpcompile_check`)."""
    seen = set()
    for region, plan in regions:
        key = (plan.site.position_ids, plan.site.padding_mask)
        if key == (None, None) or key in seen:
            continue
        seen.add(key)
        kwargs = dict(layout=plan.layout, group_name=plan.group.name, rank=plan.group.rank, world=plan.group.size)
        with region.graph.inserting_before(region):
            check = region.graph.call_function(check_dense_tokens, key, kwargs)
        check.meta = {"stack_trace": region.meta.get("stack_trace"), "cpcompile_check": True}

"""The varlen family's run-time guard, inserted by the rewrite once per graph: the packed metadata (cu_seqlens)
checked on every rank before the regions read it (regions/guards.py); the positions, a thd_balanced plan's among
them, are the batch check's (passes/batch_check.py)."""

from __future__ import annotations

import torch
import torch.fx

from ...graph.region_call import read_call
from ...layouts import THD_LAYOUTS
from ...regions.guards import check_packed_metadata
from .call import VarlenCall
from .plan_type import VarlenPlan


def check_packed(regions: list[tuple[torch.fx.Node, VarlenPlan]]) -> None:
    """Route one graph's regions that read the same cu_seqlens through ONE check_packed_metadata call
    (regions/guards.py), inserted before the first of them: checked once per graph, not per layer."""
    by_cu: dict[torch.fx.Node, list[tuple[torch.fx.Node, VarlenPlan]]] = {}
    for region, plan in regions:
        cu = read_call(VarlenCall, region).cu_seqlens
        if isinstance(cu, torch.fx.Node):
            by_cu.setdefault(cu, []).append((region, plan))
    for cu, users in by_cu.items():
        first, plan = users[0]
        bounds = [p.max_doc for _, p in users]
        layout = THD_LAYOUTS[plan.layout]
        kwargs = dict(
            total=plan.site.q_shape[0] * plan.group.size,
            max_doc=None if None in bounds else min(bounds),
            doc_multiple_per_cp=layout.doc_multiple_per_cp,
            group_name=plan.group.name,
            world=plan.group.size,
        )
        if layout.carries_plan:  # cu_seqlens is a plan (thd_balanced): the layout checks all of it
            kwargs["layout"] = layout.name
        with first.graph.inserting_before(first):
            checked = first.graph.call_function(check_packed_metadata, (cu,), kwargs)
        checked.meta = dict(cu.meta)
        for region, _ in users:
            region.replace_input_with(cu, checked)

"""The varlen family's run-time guards, inserted by the rewrite once per graph: the packed metadata (cu_seqlens)
checked on every rank before the regions read it, and a thd_balanced plan's positions (regions/guards.py)."""

from __future__ import annotations

import re

import torch
import torch.fx

from ...graph.region_call import read_call
from ...layouts import THD_LAYOUTS
from ...regions.guards import check_packed_metadata, check_plan_positions
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
        if layout.carries_plan:
            bind_plan(first, checked, plan)


POSITION_NAME = re.compile(r"position", re.IGNORECASE)
"""Graph inputs that are the model's position ids: Dynamo names placeholders after the arguments (HF's
position_ids, torchtitan's positions)."""


def bind_plan(first: torch.fx.Node, cu: torch.fx.Node, plan: VarlenPlan) -> None:
    """One check_plan_positions call (regions/guards.py) per position-ids input of the graph: the tokens must be
    the ones the plan in cu_seqlens sharded. Like sdpa's check_tokens' checks it has no users."""
    local = plan.site.q_shape[0]
    for node in first.graph.find_nodes(op="placeholder"):
        val = node.meta.get("example_value")
        if not (POSITION_NAME.search(node.name) and isinstance(val, torch.Tensor)) or val.is_floating_point():
            continue
        if val.numel() != local or val.shape[-1] != local:
            continue
        kwargs = dict(layout=plan.layout, group_name=plan.group.name, rank=plan.group.rank, world=plan.group.size)
        with first.graph.inserting_before(first):
            check = first.graph.call_function(check_plan_positions, (node, cu), kwargs)
        check.meta = {"stack_trace": first.meta.get("stack_trace"), "cpcompile_check": True}

"""Replace each planned attention node by a call of its CP region (one call_function node per site), in
whichever graph it lives (the top-level graph or a higher-order-op body); then insert the run-time guards
(regions/guards.py): torch.cond conditions around rewritten sites agreed across ranks, packed-document
metadata (cu_seqlens) checked once per graph on every rank before the regions read it, and cpcompile.attention's
token metadata (position ids, padding mask) checked once per graph."""

from __future__ import annotations

import re

import torch.fx

from ..families.plans import CPPlan
from ..families.varlen.plan_type import VarlenPlan
from ..graph.region_call import VarlenCall, read_call
from ..layouts import THD_LAYOUTS
from ..regions.dtensor import dtensor_region
from ..regions.guards import agree_condition, check_dense_tokens, check_packed_metadata, check_plan_positions
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


def _check_packed(regions: list[tuple[torch.fx.Node, VarlenPlan]]) -> None:
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
            _bind_plan(first, checked, plan)


POSITION_NAME = re.compile(r"position", re.IGNORECASE)
"""Graph inputs that are the model's position ids: Dynamo names placeholders after the arguments (HF's
position_ids, torchtitan's positions)."""


def _bind_plan(first: torch.fx.Node, cu: torch.fx.Node, plan: VarlenPlan) -> None:
    """One check_plan_positions call (regions/guards.py) per position-ids input of the graph: the tokens must be
    the ones the plan in cu_seqlens sharded. Like _check_tokens' checks it has no users."""
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


def _check_tokens(regions: list[tuple[torch.fx.Node, CPPlan]]) -> None:
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


def rewrite_graph(gm: torch.fx.GraphModule, plans: list[CPPlan]) -> torch.fx.GraphModule:
    """Rewrite every planned site in place (in its own graph), then lint and recompile each changed module."""
    changed = {id(gm): gm}
    packed: dict[int, list[tuple[torch.fx.Node, VarlenPlan]]] = {}
    tokens: dict[int, list[tuple[torch.fx.Node, CPPlan]]] = {}
    for plan in plans:
        body = plan.site.body
        region = _replace(plan)
        if isinstance(plan, VarlenPlan):
            packed.setdefault(id(region.graph), []).append((region, plan))
        else:
            tokens.setdefault(id(region.graph), []).append((region, plan))
        if body is not None:
            for cond in body.branches:
                _agree_branch(cond, plan)
            changed.update((id(m), m) for m in (body.module, *(h.graph.owning_module for h in body.hops)))
    for regions in packed.values():
        _check_packed(regions)
    for regions in tokens.values():
        _check_tokens(regions)
    for module in changed.values():
        module.graph.lint()
        module.recompile()
    return gm

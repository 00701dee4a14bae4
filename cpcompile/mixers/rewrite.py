"""The pass step: every declared mixer's node (in the graph and in the bodies it calls) planned, then replaced by
its region call (packed documents' offsets first routed through their run-time check: checks.py). The new node
carries `cpcompile_token_region` (the seq dim) for the token guard, which does not run the region but checks that
its token inputs arrive sharded on that dim and hands the tokens on to its outputs.
"""

from __future__ import annotations

import dataclasses
import logging

import torch.fx

from ..errors import CPCompileError, node_origin
from ..layouts import LAYOUTS
from ..mesh import CPGroup
from .checks import check_documents
from .cost import a2a_bytes, describe, state_bytes
from .declare import is_mixer_call, read_mixer_call
from .plan import MixerPlan, plan_mixer
from .plan_state import StatePlan, plan_state
from .region import mixer_region
from .relayout_plan import plan_layouts

log = logging.getLogger("cpcompile")

TOKEN_REGION = "cpcompile_token_region"
"""Node meta key of a rewritten mixer: the dim its token inputs and outputs hold the sequence on."""


def _graphs(gm: torch.fx.GraphModule):
    """gm and every GraphModule (a higher-order op's body) it holds, depth first."""
    yield gm
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            sub = getattr(gm, str(node.target), None)
            if isinstance(sub, torch.fx.GraphModule):
                yield from _graphs(sub)


def find_mixers(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Every declared mixer's call node."""
    return [n for g in _graphs(gm) for n in g.graph.nodes if is_mixer_call(n)]


def _plan(node: torch.fx.Node, strategy: str, group: CPGroup, check: bool) -> MixerPlan | StatePlan:
    spec = read_mixer_call(node).spec
    if spec.comm != "auto":
        return plan_state(node, strategy, group) if spec.comm == "state" else plan_mixer(node, strategy, group, check)
    if spec.context is None and spec.state is None:
        return plan_mixer(node, strategy, group, check)
    if strategy not in LAYOUTS:  # packed documents: a2a refuses them, state passing's plan says what it needs
        return plan_state(node, strategy, group)
    try:
        state = plan_state(node, strategy, group)
    except CPCompileError:  # e.g. a halo longer than a rank's chunk, packed documents: a2a, or its refusal
        return plan_mixer(node, strategy, group, check)
    try:
        heads = plan_mixer(node, strategy, group, check)
    except CPCompileError:  # e.g. heads that do not split over cp: state passing needs no split
        return state
    return state if state_bytes(state) < a2a_bytes(heads) else heads


def _replace(plan: MixerPlan | StatePlan) -> None:
    node = plan.node
    graph = node.graph
    target = mixer_region if plan.comm == "a2a" else plan.region
    with graph.inserting_before(node):
        call = read_mixer_call(node)
        region = graph.call_function(target, args=(*call.weights, *call.args), kwargs=plan.region_kwargs())
    region.meta = dict(node.meta)
    region.meta[TOKEN_REGION] = plan.spec.seq_dim
    node.replace_all_uses_with(region)
    graph.erase_node(node)
    if plan.comm == "state":
        log.info(
            "cpcompile: %s -> state-passing region (%s, %s, cp=%d, rank %d)",
            node_origin(region, "token mixer"),
            plan.layout if plan.documents is None else f"{plan.layout} chunks, documents from {plan.documents}=",
            f"a halo of {plan.context} tokens" if plan.context is not None else f"state {plan.state_shape}",
            plan.group.size,
            plan.group.rank,
        )
        return
    log.info(
        "cpcompile: %s -> head-parallel a2a region (%s, %d heads/channels over cp=%d, rank %d)",
        node_origin(region, "token mixer"),
        plan.layout,
        plan.heads,
        plan.group.size,
        plan.group.rank,
    )


def rewrite_mixers(
    gm: torch.fx.GraphModule, strategy: str, group: CPGroup | None, mixer_layout: str = "same", check: bool = True
) -> list[MixerPlan | StatePlan]:
    """Plan every mixer node (all of them first: a refusal comes before any rewrite), then rewrite them. Without
    a CP group of two or more ranks the nodes stay: they run the mixer as it is. `mixer_layout`: where runs of
    mixers run flat between relayouts (relayout_plan.py); `check`: check head-parallel declarations against the
    mixers' code on real tensors (head_check.py; explain() computes nothing)."""
    nodes = find_mixers(gm)
    if not nodes or group is None or group.size < 2:
        return []
    plans = [_plan(node, strategy, group, check) for node in nodes]
    plans = [dataclasses.replace(p, note=describe(p)) for p in plans]
    plans = plan_layouts(gm, plans, strategy, group, mixer_layout)  # relayouts inserted where chosen
    check_documents(plans)  # packed documents' offsets checked on every rank before the regions read them
    modules = {id(p.node.graph): p.node.graph.owning_module for p in plans}
    for plan in plans:
        _replace(plan)
    for module in modules.values():
        module.graph.lint()
        module.recompile()
    return plans

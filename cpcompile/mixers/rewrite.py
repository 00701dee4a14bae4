"""The pass step: every declared mixer's node (in the graph and in the bodies it calls) planned, then replaced by
its region call. The new node carries `cpcompile_token_region` (the seq dim) for the token guard, which does not
run the region but checks that its token inputs arrive sharded on that dim and hands the tokens on to its outputs.
"""

from __future__ import annotations

import logging

import torch.fx

from ..errors import node_origin
from ..mesh import CPGroup
from .declare import is_mixer_call
from .plan import MixerPlan, plan_mixer
from .region import mixer_region

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


def _replace(plan: MixerPlan) -> None:
    node = plan.node
    graph = node.graph
    with graph.inserting_before(node):
        region = graph.call_function(mixer_region, args=tuple(node.args[1:]), kwargs=plan.region_kwargs())
    region.meta = dict(node.meta)
    region.meta[TOKEN_REGION] = plan.spec.seq_dim
    node.replace_all_uses_with(region)
    graph.erase_node(node)
    log.info(
        "cpcompile: %s -> head-parallel a2a region (%s, %d heads/channels over cp=%d, rank %d)",
        node_origin(region, "token mixer"),
        plan.layout,
        plan.heads,
        plan.group.size,
        plan.group.rank,
    )


def rewrite_mixers(gm: torch.fx.GraphModule, strategy: str, group: CPGroup | None) -> list[MixerPlan]:
    """Plan every mixer node (all of them first: a refusal comes before any rewrite), then rewrite them. Without
    a CP group of two or more ranks the nodes stay: they run the mixer as it is."""
    nodes = find_mixers(gm)
    if not nodes or group is None or group.size < 2:
        return []
    plans = [plan_mixer(node, strategy, group) for node in nodes]
    modules = {id(p.node.graph): p.node.graph.owning_module for p in plans}
    for plan in plans:
        _replace(plan)
    for module in modules.values():
        module.graph.lint()
        module.recompile()
    return plans

"""The pass step `totals` (after the mixers): every `cpcompile::rank_total` call (rank_total.py: per-rank partial
sums a formula needs whole, e.g. a MoE aux loss's expert counts) replaced by `total_region` over the CP group, in
the graph and in the bodies it calls. Without a CP group of two or more ranks the calls stay: they are the values."""

from __future__ import annotations

import torch.fx

from ..mesh import CPGroup
from ..rank_total import RANK_TOTAL, total_region


def rewrite_totals(gm: torch.fx.GraphModule, group: CPGroup | None) -> int:
    """Rewrite the rank_total calls of gm and its submodules; returns how many."""
    if group is None or group.size < 2:
        return 0
    count = 0
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        nodes = list(module.graph.find_nodes(op="call_function", target=RANK_TOTAL))
        for node in nodes:
            with module.graph.inserting_before(node):
                region = module.graph.call_function(
                    total_region, node.args, dict(node.kwargs, group_name=group.name, world=group.size)
                )
            region.meta = dict(node.meta)
            node.replace_all_uses_with(region)
            module.graph.erase_node(node)
        if nodes:
            module.graph.lint()
            module.recompile()
            count += len(nodes)
    return count

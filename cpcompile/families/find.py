"""find: every attention site of a graph and of the higher-order-op bodies it reaches, by the registry's matchers."""

from __future__ import annotations

import torch.fx

from ..graph.bodies import bodies
from .registry import FAMILIES
from .site import AttentionSite


def find_attention_sites(gm: torch.fx.GraphModule) -> list[AttentionSite]:
    """Every call a registered family matches (families/registry.py: SDPA and cpcompile.attention, varlen_attn,
    flex_attention), in graph order, whichever form Dynamo recorded it in, in the graph and in every
    higher-order-op body reachable from it (activation checkpoint, cond, ...: graph/bodies.py)."""
    sites = []
    for body in bodies(gm):
        for node in body.module.graph.nodes:
            for family in FAMILIES.values():
                site = family.match(node, body)
                if site is not None:
                    sites.append(site)
                    break
    return sites

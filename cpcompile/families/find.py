"""find: every attention site of a graph and of the higher-order-op bodies it reaches."""

from __future__ import annotations

import torch.fx

from ..graph.bodies import bodies
from ..graph.targets import is_cp_attention, is_flex, is_sdpa, is_varlen
from .flex.match import flex_site
from .sdpa.match import cp_attention_site, sdpa_site
from .site import AttentionSite
from .varlen.match import varlen_site


def find_attention_sites(gm: torch.fx.GraphModule) -> list[AttentionSite]:
    """Every SDPA, varlen_attn, flex_attention and cpcompile.attention call in graph order, whichever form Dynamo
    recorded it in, in the graph and in every higher-order-op body reachable from it (activation checkpoint, cond,
    ...: graph/bodies.py)."""
    sites = []
    for body in bodies(gm):
        for node in body.module.graph.nodes:
            if is_varlen(node):
                sites.append(varlen_site(node, body))
            elif is_flex(node):
                sites.append(flex_site(node, body))
            elif is_sdpa(node):
                sites.append(sdpa_site(node, body))
            elif is_cp_attention(node):
                sites.append(cp_attention_site(node, body))
    return sites

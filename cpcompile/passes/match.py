"""Find attention nodes in a Dynamo FX graph and normalise their arguments (no rewriting here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

SDPA_TARGETS = frozenset(
    {
        torch._C._nn.scaled_dot_product_attention,
        F.scaled_dot_product_attention,
        torch.ops.aten.scaled_dot_product_attention,
        torch.ops.aten.scaled_dot_product_attention.default,
    }
)


def _sdpa_signature(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return dict(
        query=query,
        key=key,
        value=value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )


@dataclass(frozen=True)
class AttentionSite:
    """One attention call, normalised: its tensor inputs as FX nodes and every option as a constant."""

    node: torch.fx.Node
    kind: str
    query: torch.fx.Node
    key: torch.fx.Node
    value: torch.fx.Node
    attn_mask: Any
    dropout_p: Any
    is_causal: Any
    scale: Any
    enable_gqa: Any
    q_shape: tuple
    k_shape: tuple
    v_shape: tuple
    dtype: torch.dtype
    device: torch.device


def _example(node: Any) -> torch.Tensor | None:
    if isinstance(node, torch.fx.Node):
        val = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(val, torch.Tensor):
            return val
    return None


def is_sdpa(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in SDPA_TARGETS


def find_attention_sites(gm: torch.fx.GraphModule) -> list[AttentionSite]:
    """Every SDPA call in graph order, whichever form Dynamo recorded it in (positional or keyword args)."""
    sites = []
    for node in gm.graph.nodes:
        if not is_sdpa(node):
            continue
        a = _sdpa_signature(*node.args, **node.kwargs)
        q, k, v = (_example(a[n]) for n in ("query", "key", "value"))
        sites.append(
            AttentionSite(
                node=node,
                kind="sdpa",
                query=a["query"],
                key=a["key"],
                value=a["value"],
                attn_mask=a["attn_mask"],
                dropout_p=a["dropout_p"],
                is_causal=a["is_causal"],
                scale=a["scale"],
                enable_gqa=a["enable_gqa"],
                q_shape=tuple(q.shape) if q is not None else (),
                k_shape=tuple(k.shape) if k is not None else (),
                v_shape=tuple(v.shape) if v is not None else (),
                dtype=q.dtype if q is not None else torch.float32,
                device=q.device if q is not None else torch.device("cpu"),
            )
        )
    return sites

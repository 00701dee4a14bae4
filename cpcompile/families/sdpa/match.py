"""Find SDPA sites: scaled_dot_product_attention in every form Dynamo records, and cpcompile::attention
(attention_op.py: SDPA plus window, softcap, sinks and token metadata)."""

from __future__ import annotations

import torch
import torch.fx

from ...graph.bodies import Body
from ...graph.region_call import schema_bound
from ...graph.targets import is_cp_attention, is_sdpa
from ..site import AttentionSite, traced_tensor


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


def sdpa_site(node: torch.fx.Node, body: Body | None = None) -> AttentionSite:
    """Normalise a scaled_dot_product_attention node, whichever form Dynamo recorded it in."""
    a = _sdpa_signature(*node.args, **node.kwargs)
    q, k, v = (traced_tensor(a[n]) for n in ("query", "key", "value"))
    return AttentionSite(
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
        body=body,
    )


def cp_attention_site(node: torch.fx.Node, body: Body | None = None) -> AttentionSite:
    """Normalise a cpcompile::attention node (attention_op.py: SDPA plus window, softcap and token metadata)."""
    a = schema_bound(node, torch.ops.cpcompile.attention.default._schema)
    q, k, v = (traced_tensor(a[n]) for n in ("query", "key", "value"))
    return AttentionSite(
        node=node,
        kind="sdpa",
        query=a["query"],
        key=a["key"],
        value=a["value"],
        attn_mask=None,
        dropout_p=a["dropout_p"],
        is_causal=a["is_causal"],
        scale=a["scale"],
        enable_gqa=True,
        q_shape=tuple(q.shape) if q is not None else (),
        k_shape=tuple(k.shape) if k is not None else (),
        v_shape=tuple(v.shape) if v is not None else (),
        dtype=q.dtype if q is not None else torch.float32,
        device=q.device if q is not None else torch.device("cpu"),
        window=(a["window_left"], a["window_right"]),
        body=body,
        softcap=a["softcap"],
        padding_mask=a["padding_mask"],
        position_ids=a["position_ids"],
        sinks=a.get("sinks"),
    )


def match_sdpa(node: torch.fx.Node, body: Body | None = None) -> AttentionSite | None:
    """The sdpa family's site of `node` (SDPA in any recorded form, or cpcompile::attention), else None."""
    if is_sdpa(node):
        return sdpa_site(node, body)
    if is_cp_attention(node):
        return cp_attention_site(node, body)
    return None

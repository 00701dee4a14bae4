"""Find varlen_attn sites: torch_attn._varlen_attn, bound by its schema's names (they differ between torch
versions)."""

from __future__ import annotations

import torch
import torch.fx

from ...graph.bodies import Body
from ...graph.region_call import schema_bound
from ...graph.targets import is_varlen
from ..site import AttentionSite, traced_tensor

VARLEN_INFERENCE_ARGS = (
    "seqused_k",
    "block_table",
    "k_cache",
    "v_cache",
    "cache_seqlens",
    "cache_batch_idx",
    "page_table",
)
"""Optional _varlen_attn inputs (KV cache / paging, torch 2.11 or 2.13) that have no meaning in CP training."""


def _varlen_signature(node: torch.fx.Node) -> dict:
    """Bind a _varlen_attn call to its schema's argument names: the schema differs between torch versions
    (2.11: ..., window_size, k_cache, v_cache, ...; 2.13: ..., window_size, enable_gqa, seqused_k, ...)."""
    return schema_bound(node, torch.ops.torch_attn._varlen_attn.default._schema)


def varlen_site(node: torch.fx.Node, body: Body | None = None) -> AttentionSite:
    """Normalise a torch_attn._varlen_attn node (the op behind torch.nn.attention.varlen.varlen_attn)."""
    a = _varlen_signature(node)
    q, k, v = (traced_tensor(a[n]) for n in ("query", "key", "value"))
    return AttentionSite(
        node=node,
        kind="varlen",
        query=a["query"],
        key=a["key"],
        value=a["value"],
        attn_mask=None,
        dropout_p=0.0,
        is_causal=a["is_causal"],
        scale=a["scale"],
        enable_gqa=a.get("enable_gqa", True),  # torch 2.11 has no flag: GQA follows the head counts
        q_shape=tuple(q.shape) if q is not None else (),
        k_shape=tuple(k.shape) if k is not None else (),
        v_shape=tuple(v.shape) if v is not None else (),
        dtype=q.dtype if q is not None else torch.float32,
        device=q.device if q is not None else torch.device("cpu"),
        cu_seqlens_q=a["cu_seq_q"],
        cu_seqlens_k=a["cu_seq_k"],
        window=a["window_size"],
        inference_args=tuple(n for n in VARLEN_INFERENCE_ARGS if a.get(n) is not None),
        max_seqlen=(a.get("max_q"), a.get("max_k")),
        body=body,
    )


def match_varlen(node: torch.fx.Node, body: Body | None = None) -> AttentionSite | None:
    """The varlen family's site of `node` (torch_attn._varlen_attn), else None."""
    return varlen_site(node, body) if is_varlen(node) else None

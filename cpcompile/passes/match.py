"""Find attention nodes in a Dynamo FX graph and normalise their arguments (no rewriting here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from ..graph.bodies import Body, bodies
from ..graph.targets import is_cp_attention, is_flex, is_sdpa, is_varlen


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
    return _schema_bound(node, torch.ops.torch_attn._varlen_attn.default._schema)


@dataclass(frozen=True)
class AttentionSite:
    """One attention call, normalised: its tensor inputs as FX nodes and every option as a constant.

    kind "sdpa" or "varlen". Varlen sites (packed q/k/v of shape (T, H, D)) also carry their cu_seqlens nodes,
    window and any KV-cache inputs (`inference_args`, names of those that were given).
    """

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
    cu_seqlens_q: Any = None
    cu_seqlens_k: Any = None
    window: Any = None
    inference_args: tuple = ()
    max_seqlen: Any = None
    """varlen: the (max_q, max_k) the call passes (the longest document), as given."""
    softcap: Any = 0.0
    """cpcompile.attention: tanh softcapping of the scores (0: none)."""
    padding_mask: Any = None
    """cpcompile.attention: the 2-D padding mask node it was given (checked at run time: all ones)."""
    position_ids: Any = None
    """cpcompile.attention: the position ids node it was given (checked at run time: the global positions)."""
    sinks: Any = None
    """cpcompile.attention: the attention sinks node (one logit a q head in every row's denominator), or None."""
    body: Body | None = None
    """The graph the node lives in: the top-level graph, or a higher-order op's body (graph/bodies.py)."""
    flex: FlexArgs | None = None
    """kind "flex": the flex_attention call's mods, BlockMask and options."""


@dataclass(frozen=True)
class FlexArgs:
    """The non-q/k/v operands of a flex_attention call, as Dynamo records them (the BlockMask flattened:
    (q_len, kv_len, 8 block tensors, torch 2.13's optional dQ-order metadata, Q_BLOCK, KV_BLOCK, mask_mod))."""

    score_mod: torch.fx.Node
    mask_mod: torch.fx.Node
    seq_lengths: tuple
    tables: tuple
    """kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, q_num_blocks, q_indices, full_q_*."""
    extras: tuple
    """What torch adds between the tables and the block sizes (2.13: dq_write_order, ...; 2.11: nothing)."""
    block_size: tuple
    kernel_options: dict
    score_buffers: tuple
    mask_buffers: tuple
    outputs_read: frozenset
    """Which of the call's outputs (0 out, 1 lse, 2 max_scores) the graph reads."""


def traced_tensor(node: Any) -> torch.Tensor | None:
    if isinstance(node, torch.fx.Node):
        val = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(val, torch.Tensor):
            return val
    return None


def _schema_bound(node: torch.fx.Node, schema) -> dict:
    """A call's arguments by its schema's names, defaults filled in."""
    bound = {a.name: a.default_value if a.has_default_value() else None for a in schema.arguments}
    bound.update(zip((a.name for a in schema.arguments), node.args))
    bound.update(node.kwargs)
    return bound


def cp_attention_site(node: torch.fx.Node, body: Body | None = None) -> AttentionSite:
    """Normalise a cpcompile::attention node (attention_op.py: SDPA plus window, softcap and token metadata)."""
    a = _schema_bound(node, torch.ops.cpcompile.attention.default._schema)
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


def _outputs_read(node: torch.fx.Node) -> frozenset:
    import operator

    read = set()
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int):
            read.add(user.args[1])
        else:
            read.update((0, 1, 2))
    return frozenset(read)


def flex_site(node: torch.fx.Node, body: Body | None = None) -> AttentionSite:
    """Normalise a torch.ops.higher_order.flex_attention node (what Dynamo records for flex_attention)."""
    q, k, v, score_mod, mask, scale, kernel_options, *buffers = node.args
    score_buffers, mask_buffers = (tuple(b) for b in (*buffers, (), ())[:2])
    qv, kv, vv = (traced_tensor(t) for t in (q, k, v))
    flex = FlexArgs(
        score_mod=score_mod,
        mask_mod=mask[-1],
        seq_lengths=tuple(mask[:2]),
        tables=tuple(mask[2:10]),
        extras=tuple(mask[10:-3]),
        block_size=tuple(mask[-3:-1]),
        kernel_options=dict(kernel_options),
        score_buffers=score_buffers,
        mask_buffers=mask_buffers,
        outputs_read=_outputs_read(node),
    )
    return AttentionSite(
        node=node,
        kind="flex",
        query=q,
        key=k,
        value=v,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=scale,
        enable_gqa=True,
        q_shape=tuple(qv.shape) if qv is not None else (),
        k_shape=tuple(kv.shape) if kv is not None else (),
        v_shape=tuple(vv.shape) if vv is not None else (),
        dtype=qv.dtype if qv is not None else torch.float32,
        device=qv.device if qv is not None else torch.device("cpu"),
        body=body,
        flex=flex,
    )


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

"""An attention call found in a Dynamo graph, normalised: AttentionSite (every family's matcher builds one)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from ..graph.bodies import Body
from .flex.args import FlexArgs


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


def traced_tensor(node: Any) -> torch.Tensor | None:
    if isinstance(node, torch.fx.Node):
        val = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(val, torch.Tensor):
            return val
    return None

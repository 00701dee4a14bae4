"""Find flex_attention sites: torch.ops.higher_order.flex_attention with its mods, BlockMask and options."""

from __future__ import annotations

import operator

import torch.fx

from ...graph.bodies import Body
from ...graph.targets import is_flex
from ..site import AttentionSite, traced_tensor
from .args import FlexArgs


def _outputs_read(node: torch.fx.Node) -> frozenset:
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


def match_flex(node: torch.fx.Node, body: Body | None = None) -> AttentionSite | None:
    """The flex family's site of `node` (torch.ops.higher_order.flex_attention), else None."""
    return flex_site(node, body) if is_flex(node) else None

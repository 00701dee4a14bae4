"""Which FX call targets are attention: SDPA (every form Dynamo records), varlen_attn's op, flex_attention and
cpcompile.attention. Find turns these calls into sites; the token guard refuses one left after the rewrite."""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

from ..attention_op import TARGETS as CP_ATTENTION_TARGETS

SDPA_TARGETS = frozenset(
    {
        torch._C._nn.scaled_dot_product_attention,
        F.scaled_dot_product_attention,
        torch.ops.aten.scaled_dot_product_attention,
        torch.ops.aten.scaled_dot_product_attention.default,
    }
)


def varlen_targets() -> frozenset:
    """varlen_attn's op and its overload (empty on a torch without torch.nn.attention.varlen)."""
    try:
        import torch.nn.attention.varlen  # noqa: F401  (registers torch.ops.torch_attn._varlen_attn)

        op = torch.ops.torch_attn._varlen_attn
    except (ImportError, AttributeError):
        return frozenset()
    return frozenset({op, op.default})


VARLEN_TARGETS = varlen_targets()
FLEX_TARGETS = frozenset(t for t in (getattr(torch.ops.higher_order, "flex_attention", None),) if t is not None)


def is_sdpa(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in SDPA_TARGETS


def is_varlen(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in VARLEN_TARGETS


def is_cp_attention(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in CP_ATTENTION_TARGETS


def is_flex(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in FLEX_TARGETS

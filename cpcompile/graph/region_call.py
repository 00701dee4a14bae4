"""The region call's schema: the positional inputs of each attention family's region, declared once.

A plan builds its region call as one of these (plans.CPPlan.region_call); the rewrite passes it on as the call's
positional args, and whoever reads a rewritten region node takes them back by name (`read_call`), never by
position. Every comm's region of a family takes exactly these parameters, in this order
(tests/unit/test_region_call.py checks them against the registry).
"""

from __future__ import annotations

from typing import Any, NamedTuple, TypeVar

import torch.fx


class DenseCall(NamedTuple):
    """An SDPA site's region: (q, k, v) of this rank's tokens, (B, H, L, D)."""

    q: Any
    k: Any
    v: Any


class VarlenCall(NamedTuple):
    """A varlen_attn site's region: packed (T, H, D) q, k, v and the GLOBAL cu_seqlens (or a thd_balanced plan)."""

    q: Any
    k: Any
    v: Any
    cu_seqlens: Any


class FlexCall(NamedTuple):
    """A flex_attention site's region: q, k, v, the mods' graphs, the BlockMask's tables and extras, and the
    mods' captured buffers."""

    q: Any
    k: Any
    v: Any
    score_mod: Any
    mask_mod: Any
    tables: Any
    extras: Any
    score_buffers: Any
    mask_buffers: Any


Call = TypeVar("Call", DenseCall, VarlenCall, FlexCall)


def read_call(schema: type[Call], node: torch.fx.Node) -> Call:
    """The region call of a rewritten region node (a call_function of a `schema` region), by name."""
    return schema._make(node.args[: len(schema._fields)])

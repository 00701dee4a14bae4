"""The varlen family's region call: the positional inputs every comm's varlen region takes, in order."""

from __future__ import annotations

from typing import Any, NamedTuple


class VarlenCall(NamedTuple):
    """A varlen_attn site's region: packed (T, H, D) q, k, v and the GLOBAL cu_seqlens (or a thd_balanced plan)."""

    q: Any
    k: Any
    v: Any
    cu_seqlens: Any

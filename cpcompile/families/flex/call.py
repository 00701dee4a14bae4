"""The flex family's region call: the positional inputs every comm's flex region takes, in order."""

from __future__ import annotations

from typing import Any, NamedTuple


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

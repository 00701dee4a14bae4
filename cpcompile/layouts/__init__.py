"""Token layouts across CP ranks (pure index math, no torch.distributed).

Chunk layouts (flat, zigzag) cut one sequence into equal chunks; packed layouts (thd, thd_zigzag, thd_balanced)
cut a buffer of packed documents by its cu_seqlens. A new layout is one module plus one entry in LAYOUTS or THD_LAYOUTS.
"""

from __future__ import annotations

from ..errors import CPCompileError
from .base import LOCAL_SOURCE, Block, ChunkLayout
from .flat import FlatLayout
from .thd import THD_LAYOUTS, PackedLayout, VarlenBlock, get_packed_layout
from .thd_balanced import ThdBalancedLayout
from .zigzag import ZigzagLayout

LAYOUTS: dict[str, ChunkLayout] = {"flat": FlatLayout(), "zigzag": ZigzagLayout()}
THD_LAYOUTS["thd_balanced"] = ThdBalancedLayout()  # thd.py holds thd and thd_zigzag; thd_balanced builds on it
STRATEGIES = (*LAYOUTS, *THD_LAYOUTS)
"""Every strategy name backend(strategy=...) and the sharding helpers take."""


def get_layout(strategy: str) -> ChunkLayout:
    """The layout for a strategy name, or a CPCompileError listing the valid names."""
    try:
        return LAYOUTS[strategy]
    except KeyError:
        raise CPCompileError(f"unknown strategy {strategy!r}. Fix: use one of {sorted(LAYOUTS)}.") from None


__all__ = [
    "LAYOUTS",
    "LOCAL_SOURCE",
    "STRATEGIES",
    "THD_LAYOUTS",
    "Block",
    "ChunkLayout",
    "FlatLayout",
    "PackedLayout",
    "ThdBalancedLayout",
    "VarlenBlock",
    "ZigzagLayout",
    "get_layout",
    "get_packed_layout",
]

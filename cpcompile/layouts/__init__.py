"""Token layouts across CP ranks (pure index math, no torch.distributed)."""

from __future__ import annotations

from ..errors import CPCompileError
from .base import LOCAL_SOURCE, Block, ChunkLayout
from .flat import FlatLayout
from .zigzag import ZigzagLayout

LAYOUTS: dict[str, ChunkLayout] = {"flat": FlatLayout(), "zigzag": ZigzagLayout()}


def get_layout(strategy: str) -> ChunkLayout:
    """The layout for a strategy name, or a CPCompileError listing the valid names."""
    try:
        return LAYOUTS[strategy]
    except KeyError:
        raise CPCompileError(f"unknown strategy {strategy!r}. Fix: use one of {sorted(LAYOUTS)}.") from None


__all__ = ["LAYOUTS", "LOCAL_SOURCE", "Block", "ChunkLayout", "FlatLayout", "ZigzagLayout", "get_layout"]

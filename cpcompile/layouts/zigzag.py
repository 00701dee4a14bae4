"""Zigzag (dual-chunk swap, head-tail) layout: 2*cp chunks, rank r owns chunks r and 2*cp-1-r."""

from __future__ import annotations

from .base import ChunkLayout


class ZigzagLayout(ChunkLayout):
    """Balances causal work: every rank holds one early and one late chunk, so all do the same amount."""

    name = "zigzag"
    chunks_per_rank = 2

    def rank_chunks(self, rank: int, cp: int) -> tuple[int, ...]:
        return (rank, 2 * cp - 1 - rank)

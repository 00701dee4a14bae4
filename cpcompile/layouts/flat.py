"""Flat layout: rank r owns the r-th contiguous slice of the sequence."""

from __future__ import annotations

from .base import ChunkLayout


class FlatLayout(ChunkLayout):
    """Contiguous sharding; cheap to shard, but causal work grows with the rank (the last rank does most)."""

    name = "flat"
    chunks_per_rank = 1

    def rank_chunks(self, rank: int, cp: int) -> tuple[int, ...]:
        return (rank,)

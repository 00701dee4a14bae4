"""Chunk layouts: which global tokens each rank owns, and the attention blocks that follow (pure index math).

A chunk layout cuts a sequence of S tokens into `cp * chunks_per_rank` equal chunks and gives each rank a
fixed tuple of chunk ids, in local order. Everything else (shard/unshard permutations, the blocks of a rank's
causal attention) is derived here from that one tuple, so a new layout is a few lines.
"""

from __future__ import annotations

import torch

from .block import LOCAL_SOURCE, Block
from .window import all_gather_window_blocks


class ChunkLayout:
    """Base of the chunk layouts; subclasses set `name`, `chunks_per_rank` and `rank_chunks`."""

    name: str = ""
    chunks_per_rank: int = 1

    def rank_chunks(self, rank: int, cp: int) -> tuple[int, ...]:
        raise NotImplementedError

    def num_chunks(self, cp: int) -> int:
        return cp * self.chunks_per_rank

    def source_chunks(self, slot: int, cp: int) -> list[int]:
        """Global chunk ids, in buffer order, of the all-gather of local slot `slot` (rank-major)."""
        return [self.rank_chunks(p, cp)[slot] for p in range(cp)]

    def required_multiple(self, cp: int) -> int:
        """The global sequence length must be a multiple of this."""
        return self.num_chunks(cp)

    def shard_index(self, seq_len: int, cp: int, rank: int) -> torch.Tensor:
        """Global positions owned by `rank`, in local order (int64)."""
        chunk = seq_len // self.num_chunks(cp)
        starts = [c * chunk for c in self.rank_chunks(rank, cp)]
        return torch.cat([torch.arange(s, s + chunk) for s in starts])

    def unshard_chunk_order(self, cp: int) -> list[int]:
        """For a rank-major gather of every rank's local chunks, the gathered chunk index of each global chunk."""
        gathered = [c for p in range(cp) for c in self.rank_chunks(p, cp)]
        order = [0] * len(gathered)
        for idx, c in enumerate(gathered):
            order[c] = idx
        return order

    def blocks(
        self, cp: int, rank: int, chunk_len: int, causal: bool, window: tuple[int, int] | None = None
    ) -> list[Block]:
        """The blocks of rank `rank`'s attention over all-gathered K/V, each (q row, key) pair exactly once.

        Causal: per local chunk c, a causal square on the local K/V and unmasked blocks over every earlier
        chunk, one block per maximal run of earlier chunks that is contiguous in a gathered source.
        Non-causal: every local q row against each whole gathered source.
        A sliding `window` (left, right) over global positions: layouts/window.py (blocks outside it skipped).
        """
        if window is not None:
            return all_gather_window_blocks(self, cp, rank, chunk_len, causal, window)
        mine = self.rank_chunks(rank, cp)
        q_len = chunk_len * len(mine)
        if not causal:
            return [Block(0, q_len, 1 + slot, 0, cp * chunk_len, False) for slot in range(self.chunks_per_rank)]
        out: list[Block] = []
        for i, c in enumerate(mine):
            q0 = i * chunk_len
            out.append(Block(q0, chunk_len, LOCAL_SOURCE, q0, chunk_len, True))
            for slot in range(self.chunks_per_rank):
                for first, count in runs(pos for pos, g in enumerate(self.source_chunks(slot, cp)) if g < c):
                    out.append(Block(q0, chunk_len, 1 + slot, first * chunk_len, count * chunk_len, False))
        return out


def runs(positions) -> list[tuple[int, int]]:
    """Group increasing integers into maximal runs of consecutive values: [(first, count), ...]."""
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs

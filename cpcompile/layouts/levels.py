"""A 2-D CP mesh seen from across the nodes: the chunks an inter rank holds after the exchange inside its node.

The CP ranks of a 2-D mesh (inter x intra) are numbered g = inter_rank * intra + intra_rank (mesh.py), and the
sequence is laid out over all of them by the ordinary layout (flat, zigzag) as for a 1-D group of that size. The
heads<->tokens all-to-all inside a node (comm/heads.send_heads) leaves every rank of node p holding, for its share
of the heads, the tokens of global ranks p*intra .. p*intra + intra - 1, rank-major, each in its local order. To
the ring across nodes, node p is then one rank of a chunk layout whose `rank_chunks(p, inter)` are those chunks in
that buffer order: the ring's steps (layouts/ring.py) and windows (layouts/window.py) derive its blocks from that
tuple like any layout's.

Runs of consecutive chunks are joined (`coarsen`): flat's node holds one contiguous run (flat over the nodes, one
causal square at step 0); zigzag's node holds its ranks' chunks interleaved (front, back, front, back, ...), which
stay separate chunks, so step 0 runs a causal square per chunk plus rectangles over the node's earlier chunks.
"""

from __future__ import annotations

from .base import ChunkLayout


class LevelLayout(ChunkLayout):
    """The chunks node `p` holds after the intra-node exchange, in buffer order (see the module docstring)."""

    def __init__(self, base: ChunkLayout, intra: int, join: int = 1) -> None:
        self.base, self.intra, self.join = base, intra, join
        self.name = f"{base.name}/{intra}"
        self.chunks_per_rank = intra * base.chunks_per_rank // join

    def fine_chunks(self, rank: int, cp: int) -> list[int]:
        """Node `rank`'s chunks of the base layout over cp * intra ranks, in buffer order."""
        world = cp * self.intra
        return [c for r in range(rank * self.intra, (rank + 1) * self.intra) for c in self.base.rank_chunks(r, world)]

    def rank_chunks(self, rank: int, cp: int) -> tuple[int, ...]:
        fine = self.fine_chunks(rank, cp)
        return tuple(fine[i] // self.join for i in range(0, len(fine), self.join))


def _joins(fine: list[int], join: int) -> bool:
    """Whether every run of `join` chunks of `fine` is chunks join*k .. join*k + join - 1 in order."""
    starts = range(0, len(fine), join)
    return all(fine[i] % join == 0 and fine[i : i + join] == list(range(fine[i], fine[i] + join)) for i in starts)


def level_layout(base: ChunkLayout, inter: int, intra: int) -> LevelLayout:
    """The ring's layout over `inter` nodes of `intra` ranks each, with the longest runs joined that every node
    holds in order (chunk length: the base layout's chunk times `join`)."""
    fine = LevelLayout(base, intra)
    count = intra * base.chunks_per_rank
    for join in range(count, 1, -1):
        if count % join == 0 and all(_joins(fine.fine_chunks(p, inter), join) for p in range(inter)):
            return LevelLayout(base, intra, join)
    return fine

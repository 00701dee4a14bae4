"""A 2-D CP mesh seen from across the nodes: the chunks a node holds after the exchange inside it.

The CP ranks of a 2-D mesh (inter x intra) are numbered g = inter_rank * intra + intra_rank (mesh.py), and the
sequence is laid out over all of them by the ordinary layout (flat, zigzag) as for a 1-D group of that size. The
heads<->tokens all-to-all inside a node (comms/a2a/heads.send_heads) leaves every rank of node p holding, for its share
of the heads, the tokens of global ranks p*intra .. p*intra + intra - 1, rank-major, each in its local order
(`node_chunks`). The hierarchical region puts them in global order with one copy (`sorted_order`), and to the ring
across the nodes node p is then one rank of a chunk layout whose `rank_chunks(p, inter)` are its chunks ascending,
runs of consecutive chunks joined into one (`level_layout`): flat over the nodes for flat, zigzag over the nodes
for zigzag (node p holds the runs p and 2*inter-1-p), so the ring steps (comms/ring/schedule.py) are those of a 1-D ring
of `inter` ranks: step 0 one causal square (flat) or two plus one rectangle (zigzag), later steps one or two
rectangles. Without the copy, zigzag's interleaved chunks (front, back, front, back, ...) would cost a causal square
and several rectangles per chunk at step 0 and a rectangle per held chunk at every later step.
"""

from __future__ import annotations

from ...layouts.base import ChunkLayout


def node_chunks(base: ChunkLayout, node: int, nodes: int, per_node: int) -> list[int]:
    """Node `node`'s chunks of the base layout over nodes * per_node ranks, in the exchanged buffer's order."""
    world = nodes * per_node
    return [c for r in range(node * per_node, (node + 1) * per_node) for c in base.rank_chunks(r, world)]


def sorted_order(base: ChunkLayout, node: int, nodes: int, per_node: int) -> list[int]:
    """For each of node `node`'s chunks in global order, its position in the exchanged buffer."""
    held = node_chunks(base, node, nodes, per_node)
    return sorted(range(len(held)), key=held.__getitem__)


class LevelLayout(ChunkLayout):
    """Node p's chunks in global order, every `join` consecutive ones as one chunk (see the module docstring)."""

    def __init__(self, base: ChunkLayout, per_node: int, join: int = 1) -> None:
        self.base, self.per_node, self.join = base, per_node, join
        self.name = f"{base.name}/{per_node}"
        self.chunks_per_rank = per_node * base.chunks_per_rank // join

    def rank_chunks(self, rank: int, cp: int) -> tuple[int, ...]:
        fine = sorted(node_chunks(self.base, rank, cp, self.per_node))
        return tuple(fine[i] // self.join for i in range(0, len(fine), self.join))


def _joins(fine: list[int], join: int) -> bool:
    """Whether every run of `join` chunks of `fine` is chunks join*k .. join*k + join - 1 in order."""
    starts = range(0, len(fine), join)
    return all(fine[i] % join == 0 and fine[i : i + join] == list(range(fine[i], fine[i] + join)) for i in starts)


def level_layout(base: ChunkLayout, nodes: int, per_node: int) -> LevelLayout:
    """The ring's layout over `nodes` nodes of `per_node` ranks each, with the longest runs joined that every node
    holds (its chunk: the base layout's chunk times `join`)."""
    count = per_node * base.chunks_per_rank
    held = [sorted(node_chunks(base, p, nodes, per_node)) for p in range(nodes)]
    join = next(j for j in range(count, 0, -1) if count % j == 0 and all(_joins(h, j) for h in held))
    return LevelLayout(base, per_node, join)

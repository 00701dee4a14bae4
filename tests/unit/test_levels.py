"""comms/hierarchical/levels.py: what a node of a 2-D CP mesh holds after the intra-node exchange, and the ring's layout over
the nodes. Put in global order, a node's chunks are one rank of the same layout over the nodes (flat: one run;
zigzag: the runs p and 2*nodes-1-p), so the ring across the nodes runs the 1-D ring's steps."""

from __future__ import annotations

import pytest

from cpcompile.comms.hierarchical.levels import level_layout, node_chunks, sorted_order
from cpcompile.layouts import LAYOUTS

MESHES = [(1, 2), (2, 1), (2, 2), (2, 3), (3, 2), (4, 4), (2, 8)]


@pytest.mark.parametrize("nodes, per_node", MESHES)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_node_is_one_rank_of_the_layout_over_the_nodes(name, nodes, per_node):
    base = LAYOUTS[name]
    lay = level_layout(base, nodes, per_node)
    for p in range(nodes):
        fine = [c * lay.join + i for c in lay.rank_chunks(p, nodes) for i in range(lay.join)]
        assert fine == sorted(node_chunks(base, p, nodes, per_node))
        if nodes > 1:  # one node holds the whole sequence as one run
            assert (lay.rank_chunks(p, nodes), lay.chunks_per_rank) == (
                base.rank_chunks(p, nodes),
                base.chunks_per_rank,
            )


@pytest.mark.parametrize("nodes, per_node", MESHES)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_sorted_order_puts_the_exchanged_buffer_in_global_order(name, nodes, per_node):
    base = LAYOUTS[name]
    world = nodes * per_node
    every = []
    for p in range(nodes):
        held = node_chunks(base, p, nodes, per_node)
        assert held == [c for r in range(p * per_node, (p + 1) * per_node) for c in base.rank_chunks(r, world)]
        ordered = [held[i] for i in sorted_order(base, p, nodes, per_node)]
        assert ordered == sorted(held)
        every += held
    assert sorted(every) == list(range(base.num_chunks(world)))  # the nodes hold every chunk once
    if name == "flat":  # rank-major is global order already: the region copies nothing
        assert all(sorted_order(base, p, nodes, per_node) == list(range(per_node)) for p in range(nodes))

"""The chain of a chunk layout's chunks under state passing (cpcompile/mixers/chain.py): which tails each rank sends
by which rank offset, where each of its chunks' halo comes from, and which rank owns each chunk.
Checked against a brute-force reading of the layout: every chunk's halo is the tail of the chunk before it."""

from __future__ import annotations

import pytest

from cpcompile.layouts import LAYOUTS
from cpcompile.mixers.chain import HaloRoutes, HaloSource, chunk_owners, halo_routes, tails_received


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("cp", [2, 3, 4, 5, 8])
def test_every_chunk_gets_the_tail_of_the_chunk_before_it(name, cp):
    """Simulate the shifts with chunk ids as the tails: each chunk's halo must be chunk c - 1 (None for chunk 0)."""
    layout = LAYOUTS[name]
    routes = [halo_routes(layout, cp, r) for r in range(cp)]
    offsets = [offset for offset, _ in routes[0].sends]
    assert all([o for o, _ in r.sends] == offsets for r in routes)  # every rank issues the same shifts
    for r in range(cp):
        mine = layout.rank_chunks(r, cp)
        for slot, (c, source) in enumerate(zip(mine, routes[r].sources)):
            if source.kind == "zero":
                got = None
            elif source.kind == "local":
                got = mine[source.index]
            else:
                offset, slots = routes[(r - offsets[source.index]) % cp].sends[source.index]
                sender = (r - offset) % cp
                got = layout.rank_chunks(sender, cp)[slots[source.position]]
            assert got == (c - 1 if c else None), (name, cp, r, slot, source)


def test_zigzag_sends_to_both_neighbours_and_once_at_cp_2():
    zigzag = LAYOUTS["zigzag"]
    # cp 4: rank 1 holds chunks 1 and 6; chunk 1 follows rank 0's first chunk, chunk 6 rank 2's second (chunk 5)
    assert halo_routes(zigzag, 4, 1) == HaloRoutes(
        sends=((1, (0,)), (3, (1,))), sources=(HaloSource("recv", 0, 0), HaloSource("recv", 1, 0))
    )
    # the last rank's second chunk (cp) follows its own first (cp - 1); rank 0's first chunk reads the zero padding
    assert halo_routes(zigzag, 4, 3).sources[1] == HaloSource("local", 0)
    assert halo_routes(zigzag, 4, 0).sources[0] == HaloSource("zero")
    assert [o for o, _ in halo_routes(zigzag, 2, 0).sends] == [1]
    assert tails_received(zigzag, 2) == 1 and tails_received(zigzag, 4) == 2 and tails_received(LAYOUTS["flat"], 4) == 1


def test_chunk_owners():
    assert chunk_owners(LAYOUTS["zigzag"], 2) == [(0, 0), (1, 0), (1, 1), (0, 1)]

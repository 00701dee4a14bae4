"""Index math of the a2a exchange: buffers hold every chunk once, and the blocks cover exactly the mask."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpcompile.comms.a2a.schedule import buffer_chunks, exchange_blocks, exchange_slots
from cpcompile.layouts import LAYOUTS
from cpcompile.layouts.heads import HeadSplit, head_split_problem


def _pairs(buffers: list[list[int]], chunk_len: int, causal: bool) -> Counter:
    """Every (global q position, global key position) the blocks attend, with multiplicity."""
    position = [[c * chunk_len + t for c in chunks for t in range(chunk_len)] for chunks in buffers]
    seen: Counter = Counter()
    for q_buf, blocks in enumerate(exchange_blocks(buffers, chunk_len, causal)):
        for b in blocks:
            for i in range(b.q_len):
                for j in range(b.kv_len):
                    if b.causal and j > i:
                        continue
                    seen[(position[q_buf][b.q_start + i], position[b.source][b.kv_start + j])] += 1
    return seen


@given(
    layout=st.sampled_from(sorted(LAYOUTS)),
    cp=st.integers(1, 8),
    chunk_len=st.integers(1, 3),
    causal=st.booleans(),
)
def test_blocks_cover_the_mask_exactly_once(layout, cp, chunk_len, causal):
    lay = LAYOUTS[layout]
    buffers = [buffer_chunks(lay, cp, slots) for slots in exchange_slots(lay, causal)]
    assert sorted(c for b in buffers for c in b) == list(range(lay.num_chunks(cp)))
    seq = lay.num_chunks(cp) * chunk_len
    want = Counter({(i, j): 1 for i in range(seq) for j in range(seq) if not causal or j <= i})
    assert _pairs(buffers, chunk_len, causal) == want


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_block_counts(cp):
    """Flat and non-causal: one kernel call over the whole sequence. Zigzag causal: one causal square for the
    ascending half, and for the descending half cp causal squares, cp-1 in-half rectangles, one rectangle
    over the whole first half (a regression that splits blocks further fails here)."""
    flat, zigzag = LAYOUTS["flat"], LAYOUTS["zigzag"]
    for lay, causal in ((flat, True), (flat, False), (zigzag, False)):
        buffers = [buffer_chunks(lay, cp, s) for s in exchange_slots(lay, causal)]
        assert [len(b) for b in exchange_blocks(buffers, 4, causal)] == [1]
    buffers = [buffer_chunks(zigzag, cp, s) for s in exchange_slots(zigzag, True)]
    assert buffers == [list(range(cp)), list(range(2 * cp - 1, cp - 1, -1))]
    assert [len(b) for b in exchange_blocks(buffers, 4, True)] == [1, 2 * cp]


def test_head_split():
    assert head_split_problem(8, 2, 4) is None
    assert HeadSplit(8, 2, 4).kv_heads_of(3) == [1] and HeadSplit(8, 2, 4).kv_replicas == 2
    assert HeadSplit(8, 8, 4).kv_heads_of(1) == [2, 3] and HeadSplit(8, 8, 4).kv_replicas == 1
    # GQA: q head i reads kv head i // (q_heads // kv_heads); every rank's q heads read its kv heads only.
    for hq, hkv, cp in ((8, 2, 4), (8, 1, 4), (8, 4, 2), (12, 6, 3), (4, 4, 4), (16, 2, 8)):
        split = HeadSplit(hq, hkv, cp)
        for r in range(cp):
            needed = {i // (hq // hkv) for i in range(r * split.q_per_rank, (r + 1) * split.q_per_rank)}
            assert needed == set(split.kv_heads_of(r))
    assert "6 q heads" in head_split_problem(6, 2, 4)[0]
    assert "6 kv heads" in head_split_problem(12, 6, 4)[0]
    assert "multiple of 3" in head_split_problem(12, 3, 4)[0]

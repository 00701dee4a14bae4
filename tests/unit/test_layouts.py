"""Pure index math of the chunk layouts: sharding is a partition, unshard inverts it, blocks tile the mask."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpcompile.layouts import LAYOUTS, LOCAL_SOURCE

layouts = st.sampled_from(sorted(LAYOUTS))
cps = st.integers(min_value=1, max_value=8)
chunk_lens = st.integers(min_value=1, max_value=5)


@settings(max_examples=60, deadline=None)
@given(layouts, cps, chunk_lens)
def test_shard_indices_partition_the_sequence(name, cp, chunk):
    layout = LAYOUTS[name]
    seq = layout.num_chunks(cp) * chunk
    owned = torch.cat([layout.shard_index(seq, cp, r) for r in range(cp)])
    assert sorted(owned.tolist()) == list(range(seq))


@settings(max_examples=60, deadline=None)
@given(layouts, cps, chunk_lens)
def test_unshard_order_inverts_shard(name, cp, chunk):
    layout = LAYOUTS[name]
    seq = layout.num_chunks(cp) * chunk
    gathered = torch.cat([layout.shard_index(seq, cp, r) for r in range(cp)])  # rank-major, as all_gather
    pieces = gathered.view(-1, chunk)[torch.tensor(layout.unshard_chunk_order(cp))]
    assert pieces.flatten().tolist() == list(range(seq))


def _global_keys(layout, cp, rank, chunk, block):
    """Global key positions a block reads, from its source's chunk order."""
    if block.source == LOCAL_SOURCE:
        order = list(layout.rank_chunks(rank, cp))
    else:
        order = layout.source_chunks(block.source - 1, cp)
    buffer = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in order])
    return buffer[block.kv_start : block.kv_start + block.kv_len]


@settings(max_examples=80, deadline=None)
@given(layouts, cps, chunk_lens, st.booleans())
def test_blocks_cover_the_mask_exactly_once(name, cp, chunk, causal):
    layout = LAYOUTS[name]
    seq = layout.num_chunks(cp) * chunk
    for rank in range(cp):
        q_global = layout.shard_index(seq, cp, rank)
        hits = torch.zeros(len(q_global), seq, dtype=torch.int64)
        for b in layout.blocks(cp, rank, chunk, causal):
            keys = _global_keys(layout, cp, rank, chunk, b)
            rows = q_global[b.q_start : b.q_start + b.q_len]
            mask = rows[:, None] >= keys[None, :] if b.causal else torch.ones(len(rows), len(keys), dtype=torch.bool)
            if b.causal:  # a causal square must be the same tokens on both sides
                assert torch.equal(rows, keys)
            else:  # an unmasked block must not contain any future key
                assert not causal or bool((rows[:, None] >= keys[None, :]).all())
            local_rows = torch.arange(b.q_start, b.q_start + b.q_len)[:, None].expand_as(mask)
            hits.index_put_((local_rows, keys.expand_as(mask)), mask.to(torch.int64), accumulate=True)
        expected = (q_global[:, None] >= torch.arange(seq)[None, :]) if causal else torch.ones(len(q_global), seq)
        assert torch.equal(hits, expected.to(torch.int64)), f"rank {rank}: some (q, k) pair missed or repeated"


@given(cps, chunk_lens)
def test_zigzag_balances_causal_work(cp, chunk):
    layout = LAYOUTS["zigzag"]

    def work(rank):
        return sum(b.q_len * b.kv_len / (2 if b.causal else 1) for b in layout.blocks(cp, rank, chunk, True))

    assert len({work(r) for r in range(cp)}) == 1


def test_zigzag_rank_blocks_are_few_and_contiguous():
    # cp=4, rank 1 owns chunks 1 and 6: two causal squares and exactly three unmasked slices, no reorder.
    blocks = LAYOUTS["zigzag"].blocks(4, 1, 10, True)
    assert [(b.q_start, b.source, b.kv_start, b.kv_len, b.causal) for b in blocks] == [
        (0, 0, 0, 10, True),
        (0, 1, 0, 10, False),
        (10, 0, 10, 10, True),
        (10, 1, 0, 40, False),
        (10, 2, 20, 20, False),
    ]

"""Ring steps (comms/ring/schedule.py): over all cp steps every rank's blocks against the K/V it holds at each step
cover its rows of the (causal) mask, each (q, key) pair exactly once; zigzag and thd_zigzag do the same work
at every step on every rank; packed blocks keep the executor's range rules and what they vouch for."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpcompile.comms.ring.schedule import (
    causal_square,
    held_rank,
    packed_step_blocks,
    packed_visited_steps,
    ring_blocks,
    step_blocks,
)
from cpcompile.layouts import LAYOUTS
from cpcompile.layouts.block import NO_WINDOW, Block
from cpcompile.layouts.thd import THD_LAYOUTS
from tests.unit.test_thd_layouts import _block_pairs, _cu, _documents, _expected_mask


def _work(block) -> float:
    return block.q_len * block.kv_len * (0.5 if block.causal else 1.0)


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(sorted(LAYOUTS)), st.integers(1, 8), st.integers(1, 4), st.booleans())
def test_dense_steps_cover_the_mask_exactly_once(name, cp, chunk, causal):
    layout = LAYOUTS[name]
    seq = layout.num_chunks(cp) * chunk
    for rank in range(cp):
        rows_global = layout.shard_index(seq, cp, rank)
        hits = torch.zeros(len(rows_global), seq, dtype=torch.int64)
        for step, blocks in enumerate(ring_blocks(layout, cp, rank, chunk, causal)):
            held = layout.shard_index(seq, cp, held_rank(rank, step, cp))  # the held buffer, in its local order
            for b in blocks:
                assert b.source == 0
                rows = rows_global[b.q_start : b.q_start + b.q_len]
                keys = held[b.kv_start : b.kv_start + b.kv_len]
                if b.causal:  # a causal square: the same tokens on both sides, only at step 0
                    assert step == 0 and torch.equal(rows, keys)
                    mask = rows[:, None] >= keys[None, :]
                    local = torch.arange(b.q_len)[:, None] >= torch.arange(b.kv_len)[None, :]
                    assert torch.equal(mask, local), "the kernel's causal mask (local order) is not the true one"
                else:  # unmasked: never a future key under causal attention
                    assert not causal or bool((rows[:, None] >= keys[None, :]).all())
                    mask = torch.ones(len(rows), len(keys), dtype=torch.bool)
                hits[b.q_start : b.q_start + b.q_len, keys] += mask.long()
        expected = rows_global[:, None] >= torch.arange(seq)[None, :] if causal else torch.ones_like(hits, dtype=bool)
        assert torch.equal(hits, expected.long()), f"rank {rank}: some (q, key) pair is not attended exactly once"


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 8), st.integers(1, 4))
def test_zigzag_steps_are_balanced(cp, chunk):
    """Every step the same work on every rank (a causal square counts half): no rank waits for another."""
    layout = LAYOUTS["zigzag"]
    for step in range(cp):
        work = {sum(_work(b) for b in step_blocks(layout, cp, r, step, chunk, True)) for r in range(cp)}
        assert work == {2 * chunk * chunk}, f"step {step}: per-rank work {work}"


def test_zigzag_step_blocks_are_single_rectangles():
    """The chunk order lets every later step be ONE kernel call: the held front chunk for both local chunks, or
    the local back chunk against both held chunks."""
    layout = LAYOUTS["zigzag"]
    early = step_blocks(layout, 4, 2, 1, 3, True)[0]  # held rank 1 < 2: its front chunk, both local chunks
    assert (early.q_start, early.q_len, early.kv_start, early.kv_len) == (0, 6, 0, 3)
    late = step_blocks(layout, 4, 1, 3, 3, True)[0]  # held rank 2 > 1: both its chunks, the local back chunk
    assert (late.q_start, late.q_len, late.kv_start, late.kv_len) == (3, 3, 0, 6)
    for rank in range(4):
        for step in range(1, 4):
            assert len(step_blocks(layout, 4, rank, step, 3, True)) == 1


def test_zigzag_step_zero_is_one_causal_call():
    """Step 0's two causal squares and the back chunk's full square against the front one are, in local order,
    the causal mask over both chunks: one causal call on every rank, no partials to merge."""
    layout = LAYOUTS["zigzag"]
    for cp in (2, 3, 8):
        for rank in range(cp):
            assert step_blocks(layout, cp, rank, 0, 5, True) == [Block(0, 10, 0, 0, 10, True)]


def test_causal_square_only_where_the_blocks_are_its_mask():
    square = [Block(0, 4, 0, 0, 4, True), Block(4, 4, 0, 0, 4, False), Block(4, 4, 0, 4, 4, True)]
    assert causal_square(square) == [Block(0, 8, 0, 0, 8, True)]
    assert causal_square(square[::-1]) == [Block(0, 8, 0, 0, 8, True)]
    for kept in (
        square[:2],  # the back chunk's own square missing
        [square[0], Block(4, 4, 0, 0, 3, False), square[2]],  # a key of the front chunk missing
        [square[0], Block(4, 4, 0, 1, 4, False), square[2]],  # a key right of the diagonal
        [square[0], Block(4, 4, 0, 0, 4, False), Block(4, 4, 0, 4, 4, False)],  # the back square unmasked
        [square[0], square[1], Block(4, 4, 1, 4, 4, True)],  # another source
        [*square[:2], Block(4, 4, 0, 4, 4, False, (2, 0))],  # a window
        [square[0], Block(4, 4, 0, 0, 4, False), Block(4, 4, 0, 0, 4, False), Block(4, 4, 0, 4, 4, True)],  # twice
    ):
        assert causal_square(kept) == kept


def _packed_coverage(
    strategy: str, lengths: list[int], cp: int, causal: bool, max_doc: int | None = None
) -> list[list[float]]:
    """Assert exact coverage over all ranks and the steps the ring visits (documents of at most `max_doc` tokens,
    default the longest); return each rank's work per step (0 for a step the ring skips)."""
    layout = THD_LAYOUTS[strategy]
    cu = _cu(lengths)
    total = int(cu[-1])
    local = total // cp
    max_doc = max(lengths) if max_doc is None else max_doc
    visited = packed_visited_steps(strategy, local, cp, NO_WINDOW, causal, max_doc)
    index = [layout.shard_index(cu, total, cp, r) for r in range(cp)]
    got = torch.zeros(total, total, dtype=torch.int64)
    work = []
    for r in range(cp):
        per_step = []
        for step in range(cp):
            keys = index[held_rank(r, step, cp)]  # the held rank's local tokens
            step_work = 0
            blocks = packed_step_blocks(strategy, cu, local, cp, r, step, causal, max_doc)
            assert step in visited or not blocks, f"step {step} is skipped but rank {r} has blocks there"
            for b in blocks:
                qs, qe, ks, ke = b.ranges
                assert b.source == 0 and (b.causal is False or step == 0)
                ordered = (qs[1:] >= qe[:-1]).all() and (ks[1:] >= ke[:-1]).all()
                assert bool((qe >= qs).all() and (ke >= ks).all() and ordered), "ranges in order, no overlap"
                assert int((qe - qs).max()) <= b.max_q and int((ke - ks).max()) <= b.max_k
                if b.square:  # cuDNN anchors the band top-left: the same mask on squares only
                    assert bool(((qe - qs == ke - ks) | (qe == qs)).all()), "a square block has a rectangle"
                pairs = _block_pairs(b.ranges, local, local, b.causal)
                if b.covers_rows:
                    assert bool((pairs.sum(1) > 0).all()), "a block that covers its rows left a row without keys"
                if b.covers_keys:
                    in_range = torch.zeros(local, dtype=torch.bool)
                    for a, z, n in zip(ks.tolist(), ke.tolist(), (qe - qs).tolist()):
                        in_range[a:z] = n > 0
                    assert bool(in_range.all()), "a block that covers its keys left a key outside every range"
                got.index_put_((index[r][:, None].expand_as(pairs), keys[None, :].expand_as(pairs)), pairs, True)
                step_work += int(pairs.sum())
            per_step.append(step_work)
        work.append(per_step)
    assert torch.equal(got, _expected_mask(cu, causal).long()), "some same-document pair not attended exactly once"
    return work


@settings(max_examples=40, deadline=None)
@given(_documents(0), st.booleans(), st.integers(0, 6))
def test_thd_steps_cover_document_mask(case, causal, slack):
    """Over the steps the ring visits: the longest document (or a looser bound) keeps the far steps out, and
    what they skip holds no pair of one document (the mask is still covered exactly once)."""
    cp, lengths = case
    _packed_coverage("thd", lengths, cp, causal, max(lengths) + slack)


def test_thd_ring_visits_only_the_steps_a_document_reaches():
    """A document of n tokens spans pieces at most 1 + (n - 2) // L apart: the held pieces further back (and,
    both ways, further ahead) are never visited; a window and max_doc each bound it, the smaller wins."""
    assert packed_visited_steps("thd", 8, 4, NO_WINDOW, True, None) == (0, 1, 2, 3)
    assert packed_visited_steps("thd", 8, 4, NO_WINDOW, True, 1) == (0,)
    assert packed_visited_steps("thd", 8, 4, NO_WINDOW, True, 2) == (0, 1)
    assert packed_visited_steps("thd", 8, 4, NO_WINDOW, True, 9) == (0, 1)
    assert packed_visited_steps("thd", 8, 4, NO_WINDOW, True, 10) == (0, 1, 2)
    assert packed_visited_steps("thd", 8, 8, NO_WINDOW, False, 9) == (0, 1, 7)
    assert packed_visited_steps("thd", 8, 4, (3, -1), True, 30) == (0, 1)
    assert packed_visited_steps("thd", 8, 4, (30, -1), True, 3) == (0, 1)
    assert packed_visited_steps("thd_zigzag", 8, 4, NO_WINDOW, True, 2) == (0, 1, 2, 3)
    cu = _cu([3, 9, 4, 8, 8])  # L = 8, cp = 4: the 9-token document spans pieces 0 and 1 only
    assert packed_step_blocks("thd", cu, 8, 4, 3, 2, True, 9) == []
    assert len(packed_step_blocks("thd", cu, 8, 4, 1, 1, True, 9)) == 1


def test_thd_zigzag_ring_step_zero_is_one_causal_call():
    """Per document, the two local chunks in local order: their causal squares and the back chunk against the
    front are that pair's causal mask, so step 0 is one causal square call (no partials to merge)."""
    cu = _cu([8, 16, 24])
    for rank in range(2):
        (block,) = packed_step_blocks("thd_zigzag", cu, 24, 2, rank, 0, True, 24)
        qs, qe, ks, ke = block.ranges
        assert block.causal and block.square and block.covers_rows and block.covers_keys
        assert torch.equal(qs, ks) and torch.equal(qe, ke) and (qe - qs).tolist() == [4, 8, 12]


@settings(max_examples=20, deadline=None)
@given(_documents(2), st.booleans())
def test_thd_zigzag_steps_cover_document_mask_and_are_balanced(case, causal):
    cp, lengths = case
    work = _packed_coverage("thd_zigzag", lengths, cp, causal)
    if causal:  # per document, each step after the first is 2 chunk-squares on every rank
        chunks = [n // (2 * cp) for n in lengths]
        later = {w for per_rank in work for w in per_rank[1:]}
        assert later == {sum(2 * c * c for c in chunks)}, f"unbalanced ring steps: {work}"


def _coverage(blocks: list[Block], size: int = 12) -> torch.Tensor:
    """How many times each (local q row, held key) pair is attended (a causal block: its top-left triangle)."""
    hits = torch.zeros(size, size, dtype=torch.int64)
    for b in blocks:
        mask = torch.ones(b.q_len, b.kv_len, dtype=torch.int64)
        hits[b.q_start : b.q_start + b.q_len, b.kv_start : b.kv_start + b.kv_len] += mask.tril() if b.causal else mask
    return hits


_BLOCK = st.tuples(st.integers(0, 6), st.integers(1, 5), st.integers(0, 6), st.integers(1, 5), st.booleans())


@settings(max_examples=300, deadline=None)
@given(st.lists(_BLOCK, min_size=2, max_size=4))
def test_causal_square_never_changes_which_pairs_are_attended(raw):
    """Any block set (overlaps, gaps, off-diagonal causal squares included): merged into one causal square only
    when the square attends exactly the same (row, key) pairs, each as often."""
    blocks = [Block(q0, qn, 0, q0 if causal else k0, qn if causal else kn, causal) for q0, qn, k0, kn, causal in raw]
    merged = causal_square(blocks)
    assert merged == blocks or torch.equal(_coverage(merged), _coverage(blocks))


def test_hierarchical_node_steps_cover_the_mask_exactly_once():
    """The hierarchical region's ring runs over node layouts (comms/hierarchical/levels.py) through the same step
    blocks, causal_square included: every (q, key) pair of every node exactly once, by global positions."""
    from cpcompile.comms.hierarchical.levels import level_layout

    for name in ("flat", "zigzag"):
        for nodes, per_node in ((2, 1), (2, 3), (3, 2), (4, 4)):
            lay, chunk = level_layout(LAYOUTS[name], nodes, per_node), 2
            seq = lay.num_chunks(nodes) * chunk
            for node in range(nodes):
                rows = lay.shard_index(seq, nodes, node)
                hits = torch.zeros(len(rows), seq, dtype=torch.int64)
                for step, blocks in enumerate(ring_blocks(lay, nodes, node, chunk, True)):
                    held = lay.shard_index(seq, nodes, held_rank(node, step, nodes))
                    for b in blocks:
                        keys = held[b.kv_start : b.kv_start + b.kv_len]
                        mask = torch.ones(b.q_len, b.kv_len, dtype=torch.int64)
                        hits[b.q_start : b.q_start + b.q_len, keys] += mask.tril() if b.causal else mask
                expected = (rows[:, None] >= torch.arange(seq)[None, :]).long()
                assert torch.equal(hits, expected), f"{name} nodes={nodes} per_node={per_node} node {node}"

"""Index math of the THD layouts: sharding is a permutation, and every rank's varlen blocks cover exactly its
rows of the per-document (causal) mask, each (q, key) pair once. Also FA2's ranges -> cu_seqlens encodings."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpcompile.kernels.base import range_ids
from cpcompile.kernels.varlen_ranges import adjacent_cu_seqlens, tiled_cu_seqlens
from cpcompile.layouts.thd import THD_LAYOUTS, whole_sequence_blocks


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _expected_mask(cu: torch.Tensor, causal: bool, left: int = -1) -> torch.Tensor:
    total = int(cu[-1])
    doc = torch.searchsorted(cu.long(), torch.arange(total), right=True)
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask &= torch.ones(total, total, dtype=torch.bool).tril()
    if left >= 0:
        mask &= torch.ones(total, total, dtype=torch.bool).triu(-left)
    return mask


def _block_pairs(ranges: torch.Tensor, tq: int, tk: int, causal: bool, left: int = -1) -> torch.Tensor:
    """(tq, tk) int: how often each (q row, key) pair is attended by this block (bottom-right causal, keys at
    most `left` before the diagonal when left >= 0)."""
    qs, qe, ks, ke = ranges
    counts = torch.zeros(tq, tk, dtype=torch.int64)
    for i in range(qs.numel()):
        for t in range(int(qs[i]), int(qe[i])):
            for j in range(int(ks[i]), int(ke[i])):
                shift = int(ke[i] - ks[i]) - int(qe[i] - qs[i])
                rel = j - int(ks[i]) - (t - int(qs[i]) + shift)  # key position relative to the diagonal
                if (not causal or rel <= 0) and (left < 0 or rel >= -left):
                    counts[t, j] += 1
    return counts


def _check_fold(fold: torch.Tensor | None, key_index: torch.Tensor | None, total: int, used: int) -> None:
    """The fold inverts the index: every key-buffer position before `used` (thd_balanced: a tail no range reads
    follows) is listed once, under the token it copies."""
    if key_index is None:
        assert fold is None
        return
    assert fold.shape[1] == total
    listed = fold[fold >= 0]
    assert torch.equal(listed.sort().values, torch.arange(used)), "each copy folded exactly once"
    tokens = torch.arange(total).expand_as(fold)[fold >= 0]
    assert torch.equal(key_index[listed], tokens), "a copy is folded onto the token it holds"


def _coverage(strategy: str, lengths: list[int], cp: int, causal: bool, left: int = -1) -> None:
    """Every rank's blocks, read through its key buffer, attend each same-document (causal, windowed) pair of
    the packed sequence exactly once."""
    layout = THD_LAYOUTS[strategy]
    window = (left, 0) if left >= 0 else (-1, -1)
    offsets = _cu(lengths)
    total = int(offsets[-1])
    cu = layout.prepare(offsets, total, cp)  # thd_balanced: the offsets and this batch's plan
    local = total // cp
    index = [layout.shard_index(cu, total, cp, r) for r in range(cp)]
    assert torch.equal(torch.cat(index).sort().values, torch.arange(total)), "shard is not a permutation"
    gathered = torch.cat(index)
    got = torch.zeros(total, total, dtype=torch.int64)
    for r in range(cp):
        key_index, fold = layout.key_buffer(cu, local, cp, r, causal) or (None, None)
        keys = gathered if key_index is None else gathered[key_index]
        # the blocks as the all-gather region hands them to the kernel: bounds from the longest document, and
        # (thd) over only the keys the bounds let the rank reach
        blocks, read = layout.kernel_blocks(cu, local, cp, r, causal, max(lengths), window)
        if read is not None:
            assert key_index is None, "a key window is a slice of the all-gather buffer, not of a key buffer"
            keys = keys[read[0] : read[1]]
        used = keys.numel() if not layout.carries_plan else int(blocks[0].ranges[3].max())
        _check_fold(fold, key_index, total, used)
        assert len(blocks) == 1, "one kernel call a rank: nothing to merge"
        for b in blocks:
            qs, qe, ks, ke = b.ranges
            assert b.source == 0 and b.window == window
            assert bool(
                (qe >= qs).all() and (ke >= ks).all() and (qs[1:] >= qe[:-1]).all() and (ks[1:] >= ke[:-1]).all()
            )
            assert int(qe.max()) <= local and int(ke.max()) <= keys.numel()
            assert int((qe - qs).max()) <= b.max_q and int((ke - ks).max()) <= b.max_k
            assert not b.causal or bool((ke - ks >= qe - qs).all()), "a causal q range ends its key range"
            if b.square:  # the cuDNN provider then anchors the band top-left: only the same mask on squares
                assert bool(((qe - qs == ke - ks) | (qe == qs)).all()), "a square block has a rectangle"
            pairs = _block_pairs(b.ranges, local, keys.numel(), b.causal, left)
            if b.covers_rows:  # the executor then skips the row masks: every row must see a key
                assert bool((pairs.sum(1) > 0).all()), "a block that covers its rows left a row without keys"
            used = int(ke.max())  # thd_balanced's static key buffer ends in a tail no range reads
            if b.covers_keys:  # ... and the key masks: every key must lie in a range that has q rows
                assert used == keys.numel() or layout.carries_plan, "only a plan's key buffer has an unused tail"
                in_range = torch.zeros(used, dtype=torch.bool)
                for a, z, rows in zip(ks.tolist(), ke.tolist(), (qe - qs).tolist()):
                    in_range[a:z] = rows > 0
                assert bool(in_range.all()), "a block that covers its keys left a key outside every range with rows"
            if b.covers_rows and b.covers_keys:  # the executor passes tiled=True: cu_seqlens without gaps
                cu_q, cu_k = tiled_cu_seqlens(b.ranges)
                assert torch.equal(torch.stack((cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])).long(), b.ranges)
                assert int(cu_q[0]) == int(cu_k[0]) == 0 and int(cu_q[-1]) == local and int(cu_k[-1]) == used
            got.index_put_((index[r][:, None].expand_as(pairs), keys[None, :].expand_as(pairs)), pairs, True)
    assert torch.equal(got, _expected_mask(offsets, causal, left).long())


@st.composite
def _documents(draw, multiple_of: int):
    cp = draw(st.integers(2, 4))
    unit = multiple_of * cp if multiple_of else 1
    lengths = draw(st.lists(st.integers(1, 6), min_size=1, max_size=6))
    lengths = [n * unit for n in lengths]
    if not multiple_of:  # pad the total to a multiple of cp with one more document
        extra = -sum(lengths) % cp
        lengths += [extra] if extra else []
    return cp, lengths


@settings(max_examples=25, deadline=None)
@given(_documents(0), st.booleans())
def test_thd_blocks_cover_document_mask(case, causal):
    cp, lengths = case
    _coverage("thd", lengths, cp, causal)


@settings(max_examples=15, deadline=None)
@given(_documents(2), st.booleans())
def test_thd_zigzag_blocks_cover_document_mask(case, causal):
    cp, lengths = case
    _coverage("thd_zigzag", lengths, cp, causal)


@settings(max_examples=10, deadline=None)
@given(_documents(0), st.integers(0, 5))
def test_thd_sliding_window_blocks_cover_windowed_mask(case, left):
    cp, lengths = case
    _coverage("thd", lengths, cp, True, left)


@settings(max_examples=10, deadline=None)
@given(_documents(2), st.integers(0, 9))
def test_thd_zigzag_sliding_window_blocks_cover_windowed_mask(case, left):
    cp, lengths = case
    _coverage("thd_zigzag", lengths, cp, True, left)


@settings(max_examples=25, deadline=None)
@given(_documents(0), st.booleans())
def test_thd_balanced_blocks_cover_document_mask(case, causal):
    cp, lengths = case
    _coverage("thd_balanced", lengths, cp, causal)


@settings(max_examples=10, deadline=None)
@given(_documents(0), st.integers(0, 5))
def test_thd_balanced_sliding_window_blocks_cover_windowed_mask(case, left):
    cp, lengths = case
    _coverage("thd_balanced", lengths, cp, True, left)


def test_thd_balanced_long_document_and_empty_documents():
    _coverage("thd_balanced", [30, 1, 1], 4, True)  # a document longer than T/cp: pieces on every rank
    _coverage("thd_balanced", [30, 1, 1], 4, False)
    _coverage("thd_balanced", [0, 5, 0, 3, 0], 2, True)
    _coverage("thd_balanced", [1] * 12, 3, True)


def test_thd_zigzag_key_buffer_holds_each_chunk_prefix():
    """Rank 1 of cp=2 over one 8-token document (chunks of 2): front keys = chunks 0..1, back = chunks 0..2."""
    layout = THD_LAYOUTS["thd_zigzag"]
    cu = _cu([8])
    gathered = torch.cat([layout.shard_index(cu, 8, 2, r) for r in range(2)])
    keys = gathered[layout.key_buffer(cu, 4, 2, 1, True)[0]]
    assert keys.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    assert gathered[layout.key_buffer(cu, 4, 2, 1, False)[0]].tolist() == list(range(8))


def test_thd_one_token_documents_and_long_spans():
    _coverage("thd", [1, 1, 1, 9, 1, 1, 2], 4, True)  # the 9-token document spans 3+ ranks
    _coverage("thd", [16], 4, True)
    _coverage("thd", [0, 5, 0, 3], 2, True)  # empty documents (padded cu_seqlens) are harmless
    _coverage("thd_zigzag", [0, 8, 0, 16, 0], 2, True)
    _coverage("thd_zigzag", [0, 8, 0, 16, 0], 2, False)
    _coverage("thd", [0, 5, 0, 3], 2, False)


@st.composite
def _ranges(draw):
    """Non-overlapping increasing ranges on both sides, with empty ranges and gaps; after each range at most one
    side has a gap (the layouts' ranges: adjacent_cu_seqlens may pair gap rows with gap keys otherwise)."""
    n = draw(st.integers(1, 5))
    q, k = [draw(st.integers(0, 3))], [draw(st.integers(0, 3))]
    qs, qe, ks, ke = [], [], [], []
    for _ in range(n):
        qs.append(q[-1])
        ks.append(k[-1])
        qe.append(qs[-1] + draw(st.integers(0, 4)))
        ke.append(ks[-1] + draw(st.integers(0, 4)))
        gap_q, gap_k = draw(st.integers(0, 3)), draw(st.integers(0, 3))
        if draw(st.booleans()):
            gap_q = 0
        else:
            gap_k = 0
        q.append(qe[-1] + gap_q)
        k.append(ke[-1] + gap_k)
    return torch.tensor([qs, qe, ks, ke]), q[-1] + draw(st.integers(0, 2)), k[-1] + draw(st.integers(0, 2))


@settings(max_examples=40, deadline=None)
@given(_ranges(), st.booleans())
def test_adjacent_cu_seqlens_keeps_the_mask(case, causal):
    """FA2's encoding of a block's ranges (each range, then its gap as one sequence) attends exactly the
    ranges' (q row, key) pairs."""
    ranges, tq, tk = case
    cu_q, cu_k = adjacent_cu_seqlens(ranges)
    adjacent = torch.stack((cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]))
    assert torch.equal(_block_pairs(adjacent, tq, tk, causal), _block_pairs(ranges, tq, tk, causal))


def test_range_ids():
    ids = range_ids(torch.tensor([1, 4, 4]), torch.tensor([3, 4, 6]), 7)
    assert ids.tolist() == [-1, 0, 0, -1, 2, 2, -1]


@settings(max_examples=20, deadline=None)
@given(_documents(0), st.booleans(), st.integers(-1, 4), st.integers(-1, 4))
def test_whole_sequence_block_covers_what_it_claims(case, causal, left, right):
    """a2a's cp=1 block: every row sees at least one key (its diagonal) under any window, every key is in a range."""
    _, lengths = case
    cu = _cu([0, *lengths, 0])  # empty documents at both ends, as padded cu_seqlens give
    total = int(cu[-1])
    (b,) = whole_sequence_blocks(cu, total, causal, (left, right))
    assert b.covers_rows and b.covers_keys and b.square
    assert bool((b.ranges[1] - b.ranges[0] == b.ranges[3] - b.ranges[2]).all()), "every document against itself"
    assert bool((_block_pairs(b.ranges, total, total, causal, left if right in (-1, 0) else -1).sum(1) > 0).all())
    qs, qe, ks, ke = b.ranges
    assert int(ks[0]) == 0 and int(ke[-1]) == total and bool((ks[1:] == ke[:-1]).all())


def test_whole_sequence_block_bounds_the_grid_by_max_doc():
    """a2a hands the kernel varlen_attn's max_q/max_k (the longest document), not the packed length: FA2's grid
    is ceil(bound / 128) tiles per document and head, so the packed length would launch mostly empty tiles."""
    cu = _cu([0, 5, 32, 40])
    (b,) = whole_sequence_blocks(cu, 40, True, max_doc=27)
    assert (b.max_q, b.max_k) == (27, 27)
    (b,) = whole_sequence_blocks(cu, 40, True)
    assert (b.max_q, b.max_k) == (40, 40)


def test_thd_key_window_is_the_reach_of_the_bounds():
    """The all-gather region's key slice under thd: causal rows read nothing past the rank's end; max_doc - 1
    and a window's left side bound how far back, max_doc - 1 how far ahead under full attention; no bound, the
    whole buffer (None). Other layouts read a key buffer of their own (None). The coverage tests above check
    that the slice loses no key pair; this one that it is as narrow as the bounds allow."""
    thd, local, cp = THD_LAYOUTS["thd"], 4096, 8
    assert thd.key_window(local, cp, 0, True, None, (-1, 0)) == (0, local)
    assert thd.key_window(local, cp, 3, True, 1000, (-1, 0)) == (3 * local - 999, 4 * local)
    assert thd.key_window(local, cp, 3, True, 1000, (100, 0)) == (3 * local - 100, 4 * local)
    assert thd.key_window(local, cp, 3, True, None, (100, 0)) == (3 * local - 100, 4 * local)
    assert thd.key_window(local, cp, 3, False, 1000, (-1, -1)) == (3 * local - 999, 4 * local + 999)
    assert thd.key_window(local, cp, 7, False, 1000, (-1, -1)) == (7 * local - 999, 8 * local)
    assert thd.key_window(local, cp, 7, True, None, (-1, 0)) is None
    assert thd.key_window(local, cp, 3, False, None, (-1, -1)) is None
    assert THD_LAYOUTS["thd_zigzag"].key_window(local, cp, 3, True, 1000, (-1, 0)) is None

"""Index math of the THD layouts: sharding is a permutation, and every rank's varlen blocks cover exactly its
rows of the per-document (causal) mask, each (q, key) pair once. Also the ranges -> cu_seqlens encoding."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpcompile.kernels.base import range_ids, ranges_to_cu_seqlens
from cpcompile.layouts.thd import GATHERED, LOCAL, THD_LAYOUTS


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _expected_mask(cu: torch.Tensor, causal: bool) -> torch.Tensor:
    total = int(cu[-1])
    doc = torch.searchsorted(cu.long(), torch.arange(total), right=True)
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask &= torch.ones(total, total, dtype=torch.bool).tril()
    return mask


def _block_pairs(ranges: torch.Tensor, tq: int, tk: int, causal: bool) -> torch.Tensor:
    """(tq, tk) int: how often each (q row, key) pair is attended by this block (bottom-right causal)."""
    qs, qe, ks, ke = ranges
    counts = torch.zeros(tq, tk, dtype=torch.int64)
    for i in range(qs.numel()):
        for t in range(int(qs[i]), int(qe[i])):
            for j in range(int(ks[i]), int(ke[i])):
                shift = int(ke[i] - ks[i]) - int(qe[i] - qs[i])
                if not causal or j - int(ks[i]) <= t - int(qs[i]) + shift:
                    counts[t, j] += 1
    return counts


def _coverage(strategy: str, lengths: list[int], cp: int, causal: bool) -> None:
    layout = THD_LAYOUTS[strategy]
    cu = _cu(lengths)
    total = int(cu[-1])
    local = total // cp
    index = [layout.shard_index(cu, total, cp, r) for r in range(cp)]
    assert torch.equal(torch.cat(index).sort().values, torch.arange(total)), "shard is not a permutation"
    gathered = torch.cat(index)
    got = torch.zeros(total, total, dtype=torch.int64)
    for r in range(cp):
        for b in layout.blocks(cu, local, cp, r, causal, max(lengths)):  # bounds tightened by the longest doc
            assert b.causal is False or torch.equal(b.ranges[1] - b.ranges[0], b.ranges[3] - b.ranges[2])
            assert int((b.ranges[1] - b.ranges[0]).max()) <= b.max_q
            assert int((b.ranges[3] - b.ranges[2]).max()) <= b.max_k
            keys = index[r] if b.source == LOCAL else gathered
            assert b.source in (LOCAL, GATHERED)
            pairs = _block_pairs(b.ranges, local, keys.numel(), b.causal)
            got.index_put_((index[r][:, None].expand_as(pairs), keys[None, :].expand_as(pairs)), pairs, True)
    assert torch.equal(got, _expected_mask(cu, causal).long())


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


def test_thd_one_token_documents_and_long_spans():
    _coverage("thd", [1, 1, 1, 9, 1, 1, 2], 4, True)  # the 9-token document spans 3+ ranks
    _coverage("thd", [16], 4, True)
    _coverage("thd", [0, 5, 0, 3], 2, True)  # empty documents (padded cu_seqlens) are harmless


@st.composite
def _ranges(draw):
    """Non-overlapping increasing ranges on both sides, with gaps and empty ranges."""
    n = draw(st.integers(1, 5))
    q, k = [0], [0]
    for _ in range(n):
        q += [q[-1] + draw(st.integers(0, 3)), 0]
        q[-1] = q[-2] + draw(st.integers(0, 4))
        k += [k[-1] + draw(st.integers(0, 3)), 0]
        k[-1] = k[-2] + draw(st.integers(0, 4))
    qs, qe, ks, ke = q[1::2], q[2::2], k[1::2], k[2::2]
    return torch.tensor([qs, qe, ks, ke]), q[-1] + draw(st.integers(0, 2)), k[-1] + draw(st.integers(0, 2))


@settings(max_examples=40, deadline=None)
@given(_ranges(), st.booleans())
def test_ranges_to_cu_seqlens_keeps_the_mask(case, causal):
    ranges, tq, tk = case
    cu_q, cu_k = ranges_to_cu_seqlens(ranges)
    adjacent = torch.stack((cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]))
    assert torch.equal(_block_pairs(adjacent, tq, tk, causal), _block_pairs(ranges, tq, tk, causal))


def test_range_ids():
    ids = range_ids(torch.tensor([1, 4, 4]), torch.tensor([3, 4, 6]), 7)
    assert ids.tolist() == [-1, 0, 0, -1, 2, 2, -1]

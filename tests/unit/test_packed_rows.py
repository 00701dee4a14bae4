"""integrations/rows.py, the adapters' host side: document offsets from positions, padding for each layout, and
packed batches whose shapes do not change with their documents (so the compiled model never recompiles)."""

from __future__ import annotations

import pytest
import torch

from cpcompile import CPCompileError
from cpcompile.integrations.rows import document_offsets, pack_rows
from cpcompile.layouts import get_packed_layout


def _batch(lengths_per_row: list[list[int]], seed: int = 0):
    """tokens, labels, positions (rows, seq) with documents of the given lengths in each row."""
    g = torch.Generator().manual_seed(seed)
    seq = sum(lengths_per_row[0])
    positions = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths_per_row])
    tokens = torch.randint(0, 100, (len(lengths_per_row), seq), generator=g)
    labels = torch.randint(0, 100, tokens.shape, generator=g)
    labels[:, -1] = -100
    return tokens, labels, positions


def test_document_offsets_start_at_resets_and_rows():
    positions = torch.tensor([[0, 1, 2, 0, 1], [3, 4, 0, 1, 2]])  # row 1 starts mid-document: still a start
    assert document_offsets(positions).tolist() == [0, 3, 5, 7, 10]


@pytest.mark.parametrize("strategy,cp,multiple", [("zigzag", 3, 6), ("flat", 4, 4)])
def test_dense_rows_padded_to_the_layout(strategy, cp, multiple):
    tokens, labels, positions = _batch([[7, 8, 10], [25]])
    full = pack_rows(tokens, labels, positions, strategy=strategy, cp=cp, pad_id=5)
    pad = -25 % multiple
    assert full.tokens.shape == (2, 25 + pad) and full.padding == 2 * pad and full.cu_seqlens is None
    assert torch.equal(full.tokens[:, :25], tokens) and (full.tokens[:, 25:] == 5).all()
    assert (full.labels[:, 25:] == -100).all() and (full.positions[:, 25:] == 0).all()
    assert full.num_tokens == int((labels != -100).sum())


def _real(full, strategy, cp):
    """The non-padding tokens of a packed GlobalBatch, in order, and its documents' lengths."""
    cu = full.cu_seqlens.tolist()
    keep = full.labels[0] != -100
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    assert get_packed_layout(strategy).document_error(cu, full.tokens.shape[1], cp) is None
    return full.tokens[0], keep, lengths


def test_thd_one_packed_buffer_of_fixed_shape():
    shapes = set()
    for seed, rows in enumerate(([[5, 10, 30], [45]], [[1] * 45, [20, 25]], [[45], [44, 1]])):
        tokens, labels, positions = _batch(rows, seed)
        full = pack_rows(tokens, labels, positions, strategy="thd", cp=4)
        shapes.add((tuple(full.tokens.shape), tuple(full.cu_seqlens.shape), full.max_seqlen))
        flat, _, lengths = _real(full, "thd", 4)
        assert torch.equal(flat[:90], tokens.flatten()) and full.padding == 2  # 90 -> 92, a multiple of 4
        real_lengths = [n for row in rows for n in row]
        assert lengths[: len(real_lengths)] == real_lengths and lengths[len(real_lengths)] == 2
        assert set(lengths[len(real_lengths) + 1 :]) <= {0}
        assert max(lengths) <= full.max_seqlen
    assert shapes == {((1, 92), (92,), 45)}  # max_documents defaults to B*L: cu has B*L + 2 entries


def test_thd_zigzag_pads_each_document_to_fixed_total():
    cp, shapes = 2, set()
    for seed, rows in enumerate(([[5, 10, 30], [45]], [[1] * 15 + [30], [20, 25]], [[45], [44, 1]])):
        tokens, labels, positions = _batch(rows, seed)
        full = pack_rows(tokens, labels, positions, strategy="thd_zigzag", cp=cp, max_documents=20)
        shapes.add((tuple(full.tokens.shape), tuple(full.cu_seqlens.shape), full.max_seqlen))
        flat, _, lengths = _real(full, "thd_zigzag", cp)
        assert all(n % (2 * cp) == 0 for n in lengths) and max(lengths) <= full.max_seqlen
        cu = full.cu_seqlens.tolist()
        real = [n for row in rows for n in row]
        # each real document starts where its padded predecessors end, its tokens in order
        pieces = [flat[a : a + n] for a, n in zip(cu, real)]
        assert torch.equal(torch.cat(pieces), tokens.flatten())
        assert full.padding == full.tokens.shape[1] - 90
    assert len(shapes) == 1, shapes  # 90 + 20 * 3 = 150 -> 152 tokens, 22 offsets, whatever the documents
    assert shapes.pop()[:2] == ((1, 152), (22,))


def test_thd_zigzag_needs_max_documents():
    tokens, labels, positions = _batch([[5, 10, 30], [45]])
    with pytest.raises(CPCompileError, match="needs max_documents="):
        pack_rows(tokens, labels, positions, strategy="thd_zigzag", cp=2)


def test_more_documents_than_max_documents():
    tokens, labels, positions = _batch([[5, 10, 30], [45]])
    with pytest.raises(CPCompileError, match="holds 4 documents.*more than max_documents=3"):
        pack_rows(tokens, labels, positions, strategy="thd", cp=2, max_documents=3)


def test_positions_none_is_one_document_per_row():
    tokens, labels, _ = _batch([[16], [16]])
    full = pack_rows(tokens, labels, None, strategy="thd", cp=2, max_documents=2)
    assert full.cu_seqlens.tolist() == [0, 16, 32, 32] and full.max_seqlen == 16

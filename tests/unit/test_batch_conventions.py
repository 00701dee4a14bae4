"""shard_batch's batch conventions (sharding/conventions.py): the global position_ids when missing, and the
globally shifted labels plus the global target count for Hugging Face's own loss (fake group, one process)."""

from __future__ import annotations

import pytest
import torch

import cpcompile
from cpcompile import CPCompileError
from cpcompile.sharding.conventions import document_positions, with_hf_labels
from tests.support.fake_pg import fake_group

IDS = torch.arange(10, 26).reshape(2, 8)


def _shard(t, strategy="zigzag"):
    return cpcompile.shard(t, strategy=strategy, seq_dim=1)


@pytest.mark.parametrize("strategy", ["flat", "zigzag"])
def test_missing_position_ids_are_the_global_ones_sharded(strategy):
    with fake_group(1, 2):
        local = cpcompile.shard_batch({"input_ids": IDS}, strategy=strategy)
        expected = _shard(torch.arange(8).expand(2, 8), strategy)
        ids = _shard(IDS, strategy)
    assert torch.equal(local["position_ids"], expected)
    assert torch.equal(local["input_ids"], ids)


def test_given_position_ids_are_kept_and_position_ids_false_adds_none():
    given = torch.arange(100, 108).expand(2, 8)
    with fake_group(0, 2):
        kept = cpcompile.shard_batch({"input_ids": IDS, "position_ids": given}, strategy="zigzag")
        none = cpcompile.shard_batch({"input_ids": IDS}, strategy="zigzag", position_ids=False)
        expected = _shard(given)
    assert torch.equal(kept["position_ids"], expected)
    assert "position_ids" not in none


def test_packed_positions_restart_per_document():
    cu = torch.tensor([0, 3, 8, 12], dtype=torch.int32)
    assert document_positions(cu, 12).tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3]


def test_causal_lm_labels_are_shifted_globally():
    labels = IDS.clone()
    labels[0, 3] = -100
    out = with_hf_labels({"input_ids": IDS, "labels": labels}, 1, "causal_lm", -100)
    expected = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)  # HF's ForCausalLMLoss shift
    assert torch.equal(out["shift_labels"], expected)
    assert out["num_items_in_batch"].item() == int((expected != -100).sum())
    assert torch.equal(out["labels"], labels)


def test_shift_labels_are_sharded_like_the_tokens():
    with fake_group(1, 2):
        local = cpcompile.shard_batch({"input_ids": IDS, "labels": IDS}, strategy="zigzag", hf_loss="causal_lm")
        shifted = _shard(torch.cat([IDS[:, 1:], torch.full((2, 1), -100)], dim=1))
    assert torch.equal(local["shift_labels"], shifted)
    assert local["num_items_in_batch"].item() == 14  # global: 2 rows x 7 targets, not this rank's share


def test_masked_lm_counts_targets_and_shifts_nothing():
    labels = torch.full_like(IDS, -100)
    labels[:, ::3] = IDS[:, ::3]
    out = with_hf_labels({"labels": labels}, 1, "masked_lm", -100)
    assert "shift_labels" not in out and out["num_items_in_batch"].item() == 6


@pytest.mark.parametrize(
    "batch,hf_loss,message",
    [
        ({"input_ids": IDS}, "causal_lm", "needs batch\\['labels'\\]"),
        ({"labels": IDS}, "seq2seq", "unknown"),
        ({"labels": IDS, "shift_labels": IDS}, "causal_lm", "has shift_labels already"),
    ],
)
def test_label_conventions_refuse_what_they_cannot_do(batch, hf_loss, message):
    with pytest.raises(CPCompileError, match=message):
        with_hf_labels(batch, 1, hf_loss, -100)

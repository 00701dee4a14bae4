"""shard_batch(..., hf_packing=True)'s host side (sharding/hf_packing.py): the GLOBAL cu_seqlens derived from HF's
restarting position_ids, a padding attention_mask or a collator's cu_seq_lens_q, the batch packed into one row, and
the flash-attention kwargs the model gets (thd_balanced: the plan, cut for every rank of a stand-in group)."""

from __future__ import annotations

import pytest
import torch

import cpcompile
from cpcompile.errors import CPCompileError
from cpcompile.sharding.batch import SEQUENCE_KEYS
from cpcompile.sharding.hf_packing import hf_documents
from tests.support.fake_pg import fake_group


def test_restarting_position_ids_are_documents():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 4]])
    batch, cu = hf_documents({"input_ids": torch.zeros(1, 10), "position_ids": pos}, 1, SEQUENCE_KEYS)
    assert cu.tolist() == [0, 3, 5, 10] and batch["position_ids"].shape == (1, 10)


def test_every_row_starts_a_document():
    pos = torch.arange(4).expand(2, 4)  # two rows of 0..3: consecutive across the row boundary only by chance
    batch, cu = hf_documents({"input_ids": torch.zeros(2, 4), "position_ids": pos}, 1, SEQUENCE_KEYS)
    assert cu.tolist() == [0, 4, 8] and batch["input_ids"].shape == (1, 8)


def test_padding_runs_become_documents_and_the_mask_goes():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    batch, cu = hf_documents({"input_ids": torch.zeros(2, 5), "attention_mask": mask}, 1, SEQUENCE_KEYS)
    assert cu.tolist() == [0, 2, 5, 9, 10] and "attention_mask" not in batch
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]]  # HF's 0..L-1 per row


def test_a_collators_flash_kwargs_are_the_offsets():
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    batch = {"input_ids": torch.zeros(1, 10), "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 6}
    out, found = hf_documents(batch, 1, SEQUENCE_KEYS)
    assert found.tolist() == [0, 4, 10] and not any(k.startswith(("cu_seq", "max_length")) for k in out)


def test_nothing_to_pack_is_refused():
    with pytest.raises(CPCompileError, match="marks no documents"):
        hf_documents({"input_ids": torch.zeros(1, 4)}, 1, SEQUENCE_KEYS)


def test_shard_batch_gives_the_model_hf_flash_kwargs():
    ids = torch.arange(12)[None]
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    full = {"input_ids": ids, "labels": ids.clone(), "position_ids": pos}
    with fake_group(0, 2):
        local = cpcompile.shard_batch(full, strategy="thd_balanced", hf_packing=True, hf_loss="causal_lm")
        with pytest.raises(CPCompileError, match="packed documents need a packed layout"):
            cpcompile.shard_batch(full, strategy="zigzag", hf_packing=True)
    assert local["max_length_q"] == local["max_length_k"] == 5
    assert local["cu_seq_lens_q"] is local["cu_seq_lens_k"] and local["input_ids"].shape == (1, 6)
    assert local["num_items_in_batch"].item() == 11  # shifted globally before packing: the last target is gone

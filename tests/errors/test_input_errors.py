"""Small inputs that used to crash, hang or silently do the wrong thing: each is one clear CPCompileError."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn

import cpcompile
from cpcompile import CPCompileError
from tests.errors.test_dense_errors import _compile_error
from tests.support.fake_pg import fake_group


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_empty_sequence():
    """S=0 killed both ranks with SIGFPE inside aten's CPU flash kernel."""
    q = torch.randn(1, 2, 0, 4)
    assert "0 local tokens" in _compile_error(_sdpa, q, q, q)
    t = torch.randn(0, 2, 4)
    cu = torch.tensor([0, 0], dtype=torch.int32)
    fn = lambda q, k, v, cu: varlen_attn(q, k, v, cu, cu, 4, 4)  # noqa: E731
    assert "0 local packed tokens" in _compile_error(fn, t, t, t, cu, strategy="thd")


def test_rank_outside_the_cp_group():
    with fake_group(2, 4):
        group = dist.new_group([0, 1])
        with pytest.raises(CPCompileError, match="not a member of the CP group"):
            cpcompile.shard(torch.zeros(1, 8), strategy="flat", seq_dim=1, group=group)


@pytest.mark.parametrize("seq_dim", [2, -3, 5])
def test_seq_dim_out_of_range(seq_dim):
    with fake_group(0, 2):
        x = torch.zeros(4, 16)
        with pytest.raises(CPCompileError, match=f"seq_dim={seq_dim} is out of range"):
            cpcompile.shard(x, strategy="flat", seq_dim=seq_dim)
        with pytest.raises(CPCompileError, match=f"seq_dim={seq_dim} is out of range"):
            cpcompile.unshard(x, strategy="flat", seq_dim=seq_dim)
        with pytest.raises(CPCompileError, match=f"dim={seq_dim} is out of range"):
            cpcompile.pad_to_multiple(x, 4, dim=seq_dim)


def test_shard_batch_seq_dim():
    """shard_batch(seq_dim=2) on (4, 16) input_ids returned half the batch; seq_dim=-1 sharded the hidden dim
    of inputs_embeds."""
    batch = {"input_ids": torch.zeros(4, 16, dtype=torch.long), "inputs_embeds": torch.zeros(4, 16, 8)}
    with fake_group(0, 2):
        with pytest.raises(CPCompileError, match="no sequence dim 2"):
            cpcompile.shard_batch({"input_ids": batch["input_ids"]}, strategy="flat", seq_dim=2)
        with pytest.raises(CPCompileError, match="non-negative index"):
            cpcompile.shard_batch(batch, strategy="flat", seq_dim=-1)
        out = cpcompile.shard_batch(batch, strategy="flat")
        assert out["input_ids"].shape == (4, 8) and out["inputs_embeds"].shape == (4, 8, 8)


def test_pad_documents_refuses_what_it_would_drop():
    x = torch.arange(6.0)
    with pytest.raises(CPCompileError, match="end at x.shape"):
        cpcompile.pad_documents(x, torch.tensor([0, 2, 4]), 4, dim=0)  # tokens 4-5 are in no document
    for bad in (0, -2):
        with pytest.raises(CPCompileError, match="multiple >= 1"):
            cpcompile.pad_documents(x, torch.tensor([0, 2, 6]), bad, dim=0)


def test_cu_seqlens_type_errors_name_what_was_given():
    with fake_group(0, 2):
        x = torch.zeros(8)
        with pytest.raises(CPCompileError, match="torch.float32 tensor"):
            cpcompile.shard(x, strategy="thd", seq_dim=0, cu_seqlens=torch.tensor([0.0, 8.0]))
        with pytest.raises(CPCompileError, match="2-D torch.int64 tensor"):
            cpcompile.shard(x, strategy="thd", seq_dim=0, cu_seqlens=torch.tensor([[0, 8]]))


def test_shard_fix_matches_the_broken_rule():
    """Offsets that do not describe the buffer get "pass the batch's own offsets", not a padding recipe."""
    with fake_group(0, 2):
        x = torch.zeros(8)
        with pytest.raises(CPCompileError, match="Fix: pass the batch's own GLOBAL document offsets"):
            cpcompile.shard(x, strategy="thd", seq_dim=0, cu_seqlens=torch.tensor([0, 5, 3, 8]))
        with pytest.raises(CPCompileError, match="Fix: pad the packed buffer"):
            cpcompile.shard(torch.zeros(7), strategy="thd", seq_dim=0, cu_seqlens=torch.tensor([0, 7]))


def test_pad_cu_seqlens_takes_a_list():
    assert cpcompile.pad_cu_seqlens([0, 3, 7], 8, 5).tolist() == [0, 3, 7, 8, 8]
    with pytest.raises(CPCompileError, match="1-D integer tensor or a list"):
        cpcompile.pad_cu_seqlens(torch.tensor([0.0, 3.0]), 8)

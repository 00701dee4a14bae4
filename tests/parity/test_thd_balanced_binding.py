"""thd_balanced's plan is bound to the tokens it sharded: a model given another plan than the one its tokens were
sharded with (the previous batch's, or another row's) fails on every rank with one message, through the position
ids the model takes (regions/batch_check.check_batch); the matching plan runs."""

from __future__ import annotations

import pytest
import torch

import cpcompile
from cpcompile.regions.batch_check import PLAN_MISMATCH
from cpcompile.testing.distributed import run_ranks
from cpcompile.testing.model import TinyConfig
from cpcompile.testing.varlen_model import VarlenTinyLlama

pytestmark = pytest.mark.multirank

CFG = TinyConfig(layers=1, dim=32, hidden=64)
LENGTHS = {"a": [3, 9, 4], "b": [10, 2, 4]}


def _batch(name: str) -> dict:
    lengths = LENGTHS[name]
    cu = cpcompile.pad_cu_seqlens(torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]), 16, 6)
    ids = torch.randint(0, CFG.vocab, (16,), generator=torch.Generator().manual_seed(len(name)))
    return cpcompile.shard_batch({"input_ids": ids}, strategy="thd_balanced", seq_dim=0, cu_seqlens=cu)


def _mismatched(rank, world):
    torch.manual_seed(0)
    model = VarlenTinyLlama(CFG, max_len=16)
    compiled = torch.compile(model, backend=cpcompile.backend(strategy="thd_balanced", inner="eager"), fullgraph=True)
    a, b = _batch("a"), _batch("b")
    assert not torch.equal(a["cu_seqlens"], b["cu_seqlens"])
    compiled(a["input_ids"], a["position_ids"], a["cu_seqlens"])  # its own plan: runs
    try:
        compiled(a["input_ids"], a["position_ids"], b["cu_seqlens"])  # batch a's tokens, batch b's plan
    except RuntimeError as e:
        return str(e)
    return None


def test_tokens_sharded_with_another_plan_fail_every_rank():
    for message in run_ranks(_mismatched, 2, timeout=300):
        assert message is not None and PLAN_MISMATCH in message

"""thd_balanced's plan binding (regions/batch_check.plan_positions_ok), rank by rank on a fake group: the position ids
each rank holds under the plan it was sharded with pass, as positions inside documents, over the packed buffer,
or over HF's padded rows; positions that count up through every piece but from a start no plan gives fail."""

from __future__ import annotations

import torch

import cpcompile
from cpcompile.regions.batch_check import plan_positions_ok
from cpcompile.testing.varlen_model import document_position_ids
from tests.support.fake_pg import fake_group

WORLD = 2
LENGTHS = [5, 11, 3, 13]  # 32 tokens; rows of 16 for the padded case: [5 pad | 11 real], [3 real | 13 pad]


def _verdicts(positions: torch.Tensor, cu: torch.Tensor, shift_piece_of_rank: int | None = None) -> list[bool]:
    out = []
    for rank in range(WORLD):
        with fake_group(rank, WORLD):
            plan = cpcompile.plan_documents(cu, strategy="thd_balanced")
            local = cpcompile.shard(positions, strategy="thd_balanced", seq_dim=0, cu_seqlens=plan)
            if rank == shift_piece_of_rank:  # every piece 7 tokens later: each still counts up by one, from a
                local = local + 7  # start that is no document's 0, offset or previous length
            out.append(bool(plan_positions_ok(local, plan, layout="thd_balanced", rank=rank, world=WORLD)))
    return out


def _cu() -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)


def test_positions_under_their_own_plan_pass():
    cu = _cu()
    assert _verdicts(document_position_ids(cu), cu) == [True, True]  # inside documents
    assert _verdicts(torch.arange(32), cu) == [True, True]  # over the packed buffer
    assert _verdicts(torch.arange(16).repeat(2), cu) == [True, True]  # HF's padded rows (0..15 per row)


def test_positions_from_a_start_no_plan_gives_fail():
    cu = _cu()
    for positions in (document_position_ids(cu), torch.arange(32)):
        verdicts = _verdicts(positions, cu, shift_piece_of_rank=0)
        assert verdicts[0] is False and verdicts[1] is True, verdicts

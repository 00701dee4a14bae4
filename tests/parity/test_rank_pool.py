"""testing.RankPool: ranks spawned once run one function after another, a failure is raised with the rank's
traceback, and the next run gets fresh ranks. One rank (each spawn costs seconds on CI's 2 cores); the zoo
(tests/parity/test_hf_zoo.py) runs pools of 2 and 4."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from cpcompile.testing.distributed import RankPool


def _sum_of_ranks(rank, world):
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return t.item(), world, os.getpid()


def _fail(rank, world):
    raise ValueError(f"rank {rank} refuses")


def test_pool_reuses_ranks_and_restarts_after_a_failure():
    pool = RankPool(1)
    try:
        first = pool.run(_sum_of_ranks, timeout=120)
        assert first == pool.run(_sum_of_ranks, timeout=120) and first[0][:2] == (1, 1)  # the same process
        with pytest.raises(RuntimeError, match="rank 0 failed:(.|\n)*ValueError: rank 0 refuses"):
            pool.run(_fail, timeout=120)
        third = pool.run(_sum_of_ranks, timeout=120)
        assert third[0][:2] == (1, 1) and third[0][2] != first[0][2]  # a fresh process
    finally:
        pool.close()

"""testing.RankPool: ranks spawned once run one function after another, a failure is raised with the rank's
traceback, and the next run gets fresh ranks. One rank (each spawn costs seconds on CI's 2 cores); the zoo
(tests/parity/test_hf_zoo.py) runs pools of 2 and 4."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from cpcompile.testing.distributed import SHARED_RANKS_ENV, RankPool, close_shared_pools, run_ranks


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


def _leave_state_behind(rank, world):
    """A run that changes what a later run on the same ranks would see, then reports what it started with."""
    seen = (torch.get_default_dtype(), os.environ.get("CPCOMPILE_LEFT_BEHIND"), os.getpid())
    torch.set_default_dtype(torch.float64)
    os.environ["CPCOMPILE_LEFT_BEHIND"] = "1"
    return seen


def test_shared_ranks_are_reused_and_start_each_run_fresh(monkeypatch):
    """run_ranks under the suite's shared ranks: the second run lands in the same processes, yet sees the default
    dtype and environment a freshly spawned rank sees; fresh=True spawns its own."""
    monkeypatch.setenv(SHARED_RANKS_ENV, "1")
    close_shared_pools()
    try:
        first = run_ranks(_leave_state_behind, 2, timeout=120)
        second = run_ranks(_leave_state_behind, 2, timeout=120)
        assert [r[2] for r in first] == [r[2] for r in second]  # the same processes
        assert first[0][:2] == second[0][:2] == (torch.float32, None)
        spawned = run_ranks(_leave_state_behind, 2, timeout=120, fresh=True)
        assert spawned[0][:2] == first[0][:2] and spawned[0][2] not in {r[2] for r in first}
    finally:
        close_shared_pools()

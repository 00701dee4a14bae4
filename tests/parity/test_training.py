"""A small transformer trained a few steps with CP matches the single-process run (losses and weights)."""

from __future__ import annotations

import pytest

from cpcompile.testing.distributed import run_ranks
from cpcompile.testing.training import train
from tests.support.training import CFG, _assert_matches, _batches


def _cp_train(rank, world, strategy, inner):
    return train(CFG, _batches(), strategy=strategy, inner=inner)


@pytest.mark.parametrize("strategy,world", [("flat", 3), ("zigzag", 2), ("zigzag", 4)])
def test_training_parity_aot_eager(strategy, world):
    _assert_matches(run_ranks(_cp_train, world, strategy, "aot_eager", timeout=400), "aot_eager")


def test_training_parity_inductor():
    _assert_matches(run_ranks(_cp_train, 2, "zigzag", "inductor", timeout=600), "inductor")

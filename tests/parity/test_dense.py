"""Multi-rank parity of the CP SDPA region against single-process full-sequence SDPA (outputs and grads)."""

from __future__ import annotations

import pytest
import torch

from cpcompile.testing.distributed import run_ranks
from tests.support.parity import _assert_reports, compare_sdpa

# (batch, q heads, kv heads, global seq, head dim): GQA with Hkv < Hq and plain MHA.
SHAPES = {"gqa": (2, 4, 2, 48, 16), "mha": (1, 2, 2, 48, 8)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _sweep(rank, world, strategy):
    results = {}
    for shape_name, shape in SHAPES.items():
        for causal in (True, False):
            for dname, dtype in DTYPES.items():
                results[(shape_name, causal, dname)] = compare_sdpa(strategy, causal, dtype, shape)
    scaled = compare_sdpa(strategy, True, torch.float32, SHAPES["gqa"], scale=0.37)
    results[("gqa-scale", True, "fp32")] = scaled
    return results


@pytest.mark.parametrize(
    "strategy,world",
    [("flat", 2), ("flat", 3), ("flat", 4), ("zigzag", 2), ("zigzag", 3), ("zigzag", 4)],
)
def test_sdpa_parity(strategy, world):
    _assert_reports(run_ranks(_sweep, world, strategy, timeout=400))

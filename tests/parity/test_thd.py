"""Multi-rank parity of packed documents (varlen_attn under thd / thd_zigzag) against per-document SDPA.

One spawn per world size runs several seeded random document mixes (1-token documents, documents spanning
3+ ranks, empty padding documents), causal, full and sliding causal windows, fp64 and bf16, GQA and MHA,
outputs and q/k/v grads; under thd also a tight max_q/max_k (the all-gather region then hands the kernel only the
keys each rank can reach: layouts.thd.key_window).
"""

from __future__ import annotations

import pytest
import torch

from cpcompile.testing.distributed import run_ranks
from tests.support.parity import _assert_reports
from tests.support.thd_parity import compare_packed, random_lengths


def _mixes(world: int, gen: torch.Generator) -> dict[str, list[list[int]]]:
    """Document-length mixes per strategy: fixed edge cases plus seeded random ones."""
    edge = [n for n in (1, 1, 3 * world, world - 2) if n]  # two 1-token docs, then one spanning 3+ ranks
    thd = [edge] + [random_lengths(gen, world * int(torch.randint(3, 9, (1,), generator=gen))) for _ in range(3)]
    unit = 2 * world
    zigzag = [[unit, 3 * unit, unit]] + [
        random_lengths(gen, unit * int(torch.randint(2, 5, (1,), generator=gen)), unit)
    ]
    zigzag.append(random_lengths(gen, unit * 3, unit))
    return {"thd": thd, "thd_zigzag": zigzag}


def _sweep(rank, world):
    gen = torch.Generator().manual_seed(1000 + world)
    results = {}
    for strategy, mixes in _mixes(world, gen).items():
        for i, lengths in enumerate(mixes):
            for causal in (True, False):
                key = (strategy, tuple(lengths), causal)
                results[(*key, "fp64")] = compare_packed(strategy, causal, torch.float64, lengths, seed=i)
        lengths = mixes[-1]
        for left in (0, 3):  # sliding causal windows (left, 0): the rank's single block carries the window
            key = (strategy, tuple(lengths), f"window({left}, 0)", "fp64")
            results[key] = compare_packed(strategy, True, torch.float64, lengths, seed=3, window=(left, 0))
        if strategy == "thd":  # a tight max_q/max_k: the all-gather region reads only the keys it reaches
            tight = [1, 2 * world, 3, world + 1, 2, 2 * world - 1]
            tight += [1] * (-sum(tight) % world)
            for causal in (True, False):
                key = (strategy, tuple(tight), causal, "max_doc", "fp64")
                results[key] = compare_packed(strategy, causal, torch.float64, tight, seed=5, max_doc=max(tight))
        for causal in (True, False):
            key = (strategy, tuple(lengths), causal, "bf16-mha")
            results[key] = compare_packed(strategy, causal, torch.bfloat16, lengths, heads=(2, 2), seed=7)
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
def test_thd_parity(world):
    _assert_reports(run_ranks(_sweep, world, timeout=600))

"""The small-model training run the parity tests share: its config, its batches, and the check that CP training
matches the single-process run (losses and weights)."""

from __future__ import annotations

from cpcompile.testing.model import TinyConfig
from cpcompile.testing.training import make_batches, train

CFG = TinyConfig(layers=2, heads=4, kv_heads=2)


def _batches():
    """One batch seen three times: the loss must fall, so a broken backward cannot pass unnoticed."""
    return make_batches(CFG, steps=1, batch=2, seq=48, seed=1) * 3


def _assert_matches(results, inner):
    ref = train(CFG, _batches(), strategy=None, inner="eager")
    for rank, res in enumerate(results):
        assert res.rewritten == CFG.layers, f"rank {rank}: {res.rewritten} attention nodes rewritten"
        for step, (got, want) in enumerate(zip(res.losses, ref.losses)):
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), f"rank {rank} step {step}: {got} vs {want}"
        for name, p in res.params.items():
            err = (p - ref.params[name]).abs().max().item()
            assert err <= 2e-5, f"rank {rank} {name} after {len(res.losses)} steps: max error {err}"
    # the loss must actually move, or this test could not tell a broken backward from a working one
    assert ref.losses[-1] < ref.losses[0]

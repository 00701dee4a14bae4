"""One pipeline: the backend and cpcompile.explain run the same steps, passes.PASSES, in the same order; a step
added to PASSES runs under both; explain stops where the backend refuses (or, for a site refusal, at the rank
agreement, where the other ranks would stop too)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cpcompile
from cpcompile import passes
from tests.support.fake_pg import fake_group

STEPS = [step.__name__ for step in passes.PASSES]


class Attend(nn.Module):
    """One causal SDPA site (or one with an explicit mask, which the planner refuses); `after` runs on its output."""

    def __init__(self, mask: bool = False, after=lambda out: out):
        super().__init__()
        self.mask, self.after = mask, after
        self.qkv = nn.Linear(16, 3 * 16)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        mask = torch.ones(s, s, dtype=torch.bool).tril() if self.mask else None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not self.mask)
        return self.after(out.transpose(1, 2).flatten(2))


def _record(monkeypatch, *extra) -> list[str]:
    """Every step of PASSES (plus `extra`) records its name when it runs; the list of names run so far."""
    ran = []

    def recorded(step):
        @functools.wraps(step)
        def run(gm, state):
            ran.append(step.__name__)
            return step(gm, state)

        return run

    monkeypatch.setattr(passes, "PASSES", tuple(recorded(step) for step in (*passes.PASSES, *extra)))
    return ran


def _backend_steps(model, ran: list[str]) -> tuple[list[str], Exception | None]:
    """The steps the backend ran on rank 0 of a fake group of 2 (the model compiled once), and its refusal."""
    ran.clear()
    error = None
    with fake_group(0, 2):
        be = cpcompile.backend(strategy="zigzag", inner="eager")
        try:
            torch.compile(model, backend=be, fullgraph=True)(torch.randn(1, 32, 16))
        except Exception as e:  # noqa: BLE001  (Dynamo wraps the backend's CPCompileError)
            error = e
    return list(ran), error


def _explain_steps(model, ran: list[str]) -> tuple[list[str], cpcompile.explain.Report]:
    ran.clear()
    report = cpcompile.explain(model, torch.randn(1, 64, 16), strategy="zigzag", world=2)
    return list(ran), report


def test_explain_runs_the_backends_steps(monkeypatch):
    """The same step names in the same order, every step of PASSES, and a step added to PASSES runs under both
    with the plans the steps before it made."""
    seen = []

    def audit(gm, state):
        seen.append([p.comm for p in state.plans])

    ran = _record(monkeypatch, audit)
    backend, error = _backend_steps(Attend(), ran)
    explained, report = _explain_steps(Attend(), ran)
    assert error is None and not report.refusals, (error, str(report))
    assert backend == explained == [*STEPS, "audit"]
    assert seen == [["all_gather"], ["all_gather"]]


@pytest.mark.parametrize(
    ("model", "backend_stops", "explain_stops", "where"),
    [
        (Attend(after=lambda out: out.cumsum(1)), "guard", "guard", "token guard"),  # mixes tokens after the rewrite
        (Attend(mask=True), "plan", "agree_ranks", "test_pipeline.py"),  # an explicit mask: the planner refuses
    ],
)
def test_explain_stops_where_the_backend_refuses(monkeypatch, model, backend_stops, explain_stops, where):
    ran = _record(monkeypatch)
    backend, error = _backend_steps(model, ran)
    explained, report = _explain_steps(model, ran)
    assert error is not None and "CPCompileError" in f"{type(error).__name__}{error}"
    assert backend == STEPS[: STEPS.index(backend_stops) + 1]
    assert explained == STEPS[: STEPS.index(explain_stops) + 1]
    (refusal,) = report.refusals
    assert where in refusal.where and refusal.message.split("\n")[0] in str(error)

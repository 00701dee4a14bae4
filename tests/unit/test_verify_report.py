"""verify()'s Report and tolerance rule, without ranks: the verdict, the worst row, NaN, the table."""

from __future__ import annotations

import torch

from cpcompile.verify import Report, Row
from cpcompile.verify.report import allowed_error, relative_error


def test_tolerance_rule_by_dtype():
    assert allowed_error(torch.float64, None) == 1e-9
    assert allowed_error(torch.float32, 0.5) == 5e-5  # fp32: fixed, whatever one process errs
    assert allowed_error(torch.bfloat16, 0.01) == 2 * 0.01 + 2e-3
    assert allowed_error(torch.float16, 0.0) == 5e-4


def test_relative_error_is_relative_to_the_reference():
    want = torch.tensor([100.0, -200.0])
    assert relative_error(want + torch.tensor([0.0, 2.0]), want) == 2.0 / 200.0
    assert relative_error(torch.zeros(2), torch.zeros(2)) == 0.0


def test_report_verdict_worst_and_table():
    rows = [Row("logits", 1e-7, 5e-5), Row("grad w", 3e-2, 5e-5), Row("loss", float("nan"), 5e-5)]
    report = Report("strategy=flat", torch.float32, rows)
    assert not report.passed and not report
    assert report.worst.name == "loss"  # NaN is the worst there is
    assert [r.name for r in report.failures()] == ["grad w", "loss"]
    text = str(report)
    assert text.splitlines()[0] == "cpcompile.verify: FAIL, strategy=flat, float32"
    lines = {ln.split()[-1]: ln for ln in text.splitlines()[-3:]}
    assert [ln.split()[0] for ln in text.splitlines()[-3:]] == ["loss", "grad", "logits"]  # worst first
    assert set(lines) == {"FAIL", "yes"}
    ok = Report("strategy=flat", torch.float32, rows[:1])
    assert ok.passed and str(ok).startswith("cpcompile.verify: PASS")
    assert not Report("x", torch.float32, []).passed  # nothing compared is no pass

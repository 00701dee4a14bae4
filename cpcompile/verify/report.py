"""verify()'s result: one row per compared tensor (logits, loss, each parameter gradient), its error, what is
allowed, and the verdict; str() is a table that leads with the worst tensor.

The tolerance rule (`allowed`): errors are relative to the largest magnitude of the reference tensor, so one rule
fits logits and gradients of any scale.
- fp64 / fp32 models: a fixed bound (TIGHT), the gap between two correct fp32 reductions in different orders.
- bf16 / fp16 models: the project's rounding rule, 2 x the error of the one-process run in the model's dtype
  against the same run in fp64, plus a floor (LOW_FLOOR): CP rounds in other places than one process, never
  more than one process errs by itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TIGHT = {torch.float64: 1e-9, torch.float32: 5e-5}
"""Allowed relative error of fp64 / fp32 models."""
LOW_FLOOR = {torch.bfloat16: 2e-3, torch.float16: 5e-4}
"""The floor added to 2 x the one-process low-precision error (relative) of bf16 / fp16 models."""


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (floored at 1e-6, since some gradients are 0 up to rounding)."""
    want = want.detach().double()
    diff = (got.detach().double() - want).abs().max()
    return (diff / want.abs().max().clamp(min=1e-6)).item()


def allowed_error(dtype: torch.dtype, low_precision_error: float | None) -> float:
    """The tolerance rule above, for a tensor computed in `dtype`."""
    if dtype in TIGHT:
        return TIGHT[dtype]
    return 2.0 * (low_precision_error or 0.0) + LOW_FLOOR.get(dtype, LOW_FLOOR[torch.bfloat16])


@dataclass(frozen=True)
class Row:
    """One compared tensor: its name, its relative error, the allowed error."""

    name: str
    error: float
    allowed: float

    @property
    def ok(self) -> bool:
        return self.error <= self.allowed  # NaN is never ok

    @property
    def ratio(self) -> float:
        return self.error / self.allowed if self.error == self.error else float("inf")


@dataclass
class Report:
    """What verify() compared and found: `passed`, `worst` (the row with the largest error / allowed), `rows`."""

    setup: str
    dtype: torch.dtype
    rows: list[Row] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.ok for r in self.rows)

    @property
    def worst(self) -> Row | None:
        return max(self.rows, key=lambda r: r.ratio, default=None)

    def failures(self) -> list[Row]:
        return [r for r in self.rows if not r.ok]

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        worst = self.worst
        verdict = "PASS" if self.passed else "FAIL"
        lines = [f"cpcompile.verify: {verdict}, {self.setup}, {str(self.dtype).replace('torch.', '')}"]
        if worst is not None:
            lines.append(f"worst: {worst.name}  error {worst.error:.3g} (allowed {worst.allowed:.3g})")
        if not self.passed:
            lines.append(
                "the CP run differs from one process: the tensors marked FAIL are computed from a rank's own tokens "
                "somewhere the token guard could not see (or the loss is not a sum over tokens / a global count)."
            )
        shown = sorted(self.rows, key=lambda r: -r.ratio)
        width = max([len(r.name) for r in shown] + [6])
        lines.append(f"{'tensor':<{width}}  {'error':>10}  {'allowed':>10}  ok")
        for r in shown:
            lines.append(f"{r.name:<{width}}  {r.error:>10.3g}  {r.allowed:>10.3g}  {'yes' if r.ok else 'FAIL'}")
        return "\n".join(lines)

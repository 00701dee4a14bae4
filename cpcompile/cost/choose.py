"""comm="auto" / kernel="auto": pick the (comm, kernel) with the lowest estimated time, today's order breaking ties.

The options come in today's order (the comm registry's order, then kernels.AUTO_ORDER / VARLEN_AUTO_ORDER), and
the first option within TIE of the fastest estimate wins: the model's errors on the benchmark's ranks are a few
percent (rates.json), so a smaller difference is no evidence, and the old choice stands. Estimates depend only
on shapes and configuration (packed sites: the assumed documents of families/varlen/costing.py), never on the
rank or the data, so every rank makes the same choice (rank agreement compares it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .model import Estimate, estimate
from .shape import SiteShape

TIE = 0.05
"""Estimates within this fraction of the fastest count as equal (the benchmark's repeat spread is ~2%, the
model's median error on its ranks 1-2%, its largest 7-14%)."""


@dataclass(frozen=True)
class Choice:
    """What "auto" chose for a site: the estimates of every option, in today's order."""

    chosen: Estimate
    options: tuple[Estimate, ...]

    @property
    def runner_up(self) -> Estimate | None:
        others = sorted((e for e in self.options if e is not self.chosen), key=_rank_key(self.options))
        return others[0] if others else None

    def describe(self) -> str:
        """E.g. `a2a + flash_varlen 3.1 ms (runner-up all_gather + cudnn_varlen 3.55 ms)`."""
        text = f"{_name(self.chosen)} {_ms(self.chosen)}"
        if (other := self.runner_up) is not None:
            text += f" (runner-up {_name(other)} {_ms(other)})"
        return text


def _name(e: Estimate) -> str:
    return f"{e.comm} + {e.kernel}"


def _ms(e: Estimate) -> str:
    return f"{e.total_ms:.3g} ms" + (f" (measured {e.measured_ms:.3g} ms)" if e.measured_ms is not None else "")


def measured_options(estimates: tuple[Estimate, ...]) -> list[Estimate]:
    """The measured options, when the measurements speak for every comm among the options (some kernel of each
    measured at this point), else none: an unmeasured comm's model time cannot be compared with a measured step."""
    measured = [e for e in estimates if e.measured_ms is not None]
    return measured if {e.comm for e in measured} == {e.comm for e in estimates} else []


def _rank_key(estimates: tuple[Estimate, ...]):
    if measured_options(estimates):
        return lambda e: (e.measured_ms is None, e.measured_ms or 0.0, e.total_ms)
    return lambda e: e.total_ms


@functools.lru_cache(maxsize=256)
def _estimate(shape: SiteShape, layout: str, comm: str, kernel: str) -> Estimate:
    return estimate(shape, layout, comm, kernel)  # the sites of one model share shapes: one estimate each


def choose(shape: SiteShape, layout: str, options: list[tuple[str, str]]) -> Choice:
    """The first (comm, kernel) of `options` (today's order) whose estimate is within TIE of the fastest; where
    the site is a measured point for every comm of the options (cost/measured.py), the measured option with the
    lowest measured time."""
    estimates = tuple(_estimate(shape, layout, comm, kernel) for comm, kernel in options)
    measured = measured_options(estimates)
    if measured:  # measurements include the communication's overlap, which the model cannot see: no tie rule
        return Choice(min(measured, key=lambda e: e.measured_ms), estimates)
    fastest = min(e.total_ms for e in estimates)
    chosen = next(e for e in estimates if e.total_ms <= fastest * (1 + TIE))
    return Choice(chosen, estimates)

"""What explain() returns: per attention site its plan and costs per rank, every refusal with its fix, the
recommended layout; str() renders it as the table docs/guide.md shows ("explain() and auto")."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

from ..comm.wire import format_bytes
from ..cost import TIE, Choice, Estimate
from ..cost.rates import provenance, table

WIDTH = 120
"""Lines of the rendered report are wrapped at this width (the compact table fits in it for typical sites)."""


@dataclass(frozen=True)
class SiteReport:
    """One attention site as the pass would rewrite it, costed with the example batch (per rank)."""

    graph: int
    node: str
    source: str
    """The node and the user's source line, as CPCompileErrors name them."""
    kind: str
    q_shape: tuple
    k_shape: tuple
    v_shape: tuple
    """This rank's q/k/v (local) shapes."""
    layout: str
    comm: str
    kernel: str
    causal: bool
    window: tuple[int, int] | None
    estimate: Estimate | None
    """blocks, FLOPs and time per rank, bytes a rank sends per forward / backward (cost/model.py); None for
    flex_attention sites (not costed: the BlockMask sets their work)."""
    choice: Choice | None = None
    """What comm="auto" / kernel="auto" weighed (the planner's shape-only estimates); None: nothing to choose."""
    deferred_bytes: tuple[int, int] | None = None
    """(forward, backward) bytes backend(deferred_merge=True) holds beyond the running merge on the rank that holds
    the most; None: no deferred merge."""

    @property
    def blocks(self) -> tuple[int, ...] | None:
        return None if self.estimate is None else self.estimate.blocks

    @property
    def flops(self) -> tuple[float, ...] | None:
        return None if self.estimate is None else self.estimate.flops

    @property
    def balance(self) -> float | None:
        return None if self.estimate is None else self.estimate.balance


@dataclass(frozen=True)
class Refusal:
    """Something the pass (or the token guard, or the input sharding) would refuse, with the fix."""

    where: str
    message: str
    """The CPCompileError's full text: what was found, the rule, the fix."""

    @property
    def fix(self) -> str:
        return self.message.split("Fix: ", 1)[1] if "Fix: " in self.message else ""


@dataclass(frozen=True)
class Recommendation:
    layout: str
    reason: str
    estimates_ms: dict[str, float] = field(default_factory=dict)
    """Per layout: the sum over the sites of the estimates of the comm and kernel the planner picks there (ms,
    forward + backward); the asked layout's is the sum of the table's est. ms."""
    runs_with: str = ""
    """The comm + kernel the recommended layout's sites run with, e.g. "a2a + cudnn" (the planner's choice)."""
    asked: str = ""
    """The layout explain() was asked about (its `strategy`)."""
    gain: float = 0.0
    """The estimated time saved by switching from `asked` to `layout`, a fraction of `asked`'s (0: no switch)."""

    def advice(self) -> str:
        """One line: the layout to use and, when it is not the one asked for, what switching is estimated to gain
        and that a gain within the cost model's error (cost.TIE) is no reason to switch."""
        if self.layout == "none":
            return "Recommended layout: none"
        ms = self.estimates_ms.get(self.layout, 0.0)
        if self.layout == self.asked:
            others = {k: v for k, v in self.estimates_ms.items() if k != self.layout}
            if not others:
                return f"Recommended layout: {self.layout}, as asked ({ms:.3g} ms, the only layout costed)"
            name, other = min(others.items(), key=lambda kv: kv[1])
            change = f"{other / ms - 1:.0%} slower" if other >= ms else f"{1 - other / ms:.0%} faster, within the error"
            change = "as fast" if abs(other / ms - 1) < 0.005 else change
            return (
                f"Recommended layout: {self.layout}, as asked ({ms:.3g} ms with {self.runs_with}); {name} is "
                f"estimated {change}: no reason to switch (worth it above {TIE:.0%}, the cost model's error)"
            )
        if self.asked not in self.estimates_ms:
            return f"Recommended layout: {self.layout} with {self.runs_with} ({ms:.3g} ms; {self.asked} cannot run)"
        return (
            f"Recommended layout: {self.layout} with {self.runs_with}: an estimated {self.gain:.0%} faster than "
            f"{self.asked} ({ms:.3g} ms against {self.estimates_ms[self.asked]:.3g} ms), worth switching (above "
            f"{TIE:.0%}, the cost model's error): strategy='{self.layout}' in shard_batch and backend"
        )


@dataclass
class Report:
    """explain()'s answer; str(report) is a table."""

    strategy: str
    comm: str
    kernel: str
    world: int | tuple[int, int]
    graphs: int = 0
    sites: list[SiteReport] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    recommendation: Recommendation | None = None
    notes: list[str] = field(default_factory=list)
    device: str = ""
    """The device type the kernels were planned for ("cpu", "cuda"; "" when no site was found)."""

    def __str__(self) -> str:
        return render(self)

    def details(self) -> str:
        """The table with every column: local q/k/v shapes and the bytes a rank sends, too."""
        return render(self, details=True)


def _per_rank(values, fmt=str) -> str:
    """One value when every rank has it, else the list (rank 0 first)."""
    shown = [fmt(v) for v in values]
    return shown[0] if len(set(shown)) == 1 else "/".join(shown)


def _flops(n: float) -> str:
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.3g}"


def _shape(s: tuple) -> str:
    return "x".join(str(d) for d in s)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _wrap(text: str, indent: str = "  ") -> list[str]:
    return textwrap.wrap(text, WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def _cuda_name() -> str | None:
    """The current CUDA device's name, or None without CUDA."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def _rates_line(report: Report) -> str:
    """Which device the est. ms are for: the one the kernel rates were measured on, said plainly when the plan is
    for another device (a CPU's kernels are costed at the H200's rates of their GPU counterpart)."""
    measured = table()["device"]
    if report.device == "cpu":
        return (
            f"est. ms: for one {measured} (its measured kernel rates; the CPU kernels are costed at its "
            "FlashAttention-2 rates), not this CPU: CPU runs check correctness, not speed"
        )
    here = _cuda_name() if report.device == "cuda" else None
    if here is None or here == measured:
        return f"est. ms: kernel rates measured on {measured}" + (", this device" if here else "")
    return f"est. ms: kernel rates measured on {measured}, not on this {here}: read the ms as relative"


def render(report: Report, details: bool = False) -> str:
    """The report as text; details=True adds the local q/k/v shapes and the bytes sent per rank."""
    head = (
        f"cpcompile.explain: strategy={report.strategy} comm={report.comm} kernel={report.kernel} "
        f"world={report.world}: {len(report.sites)} attention site(s) in {report.graphs} graph(s), "
        f"{len(report.refusals)} refusal(s)"
    )
    lines = _wrap(head)
    if report.sites:
        lines += _wrap(_rates_line(report) + ("; report.details() adds shapes and bytes" if not details else ""))
    lines.append("")
    if report.sites:
        wide = ["q / k / v (local)", "sent fwd / bwd per rank"] if details else []
        rows = [["#", "node", "source", *wide[:1], "layout", "comm", "kernel", "blocks/rank", *wide[1:],
                 "FLOPs/rank", "max/mean", "est. ms"]]  # fmt: skip
        for i, s in enumerate(report.sites):
            e = s.estimate
            shapes = [" / ".join(_shape(x) for x in (s.q_shape, s.k_shape, s.v_shape))] if details else []
            sent = [f"{format_bytes(e.sent_fwd)} / {format_bytes(e.sent_bwd)}" if e is not None else "-"]
            sent = sent if details else []
            if e is None:
                costs = ["-"] * (5 if details else 4)
            else:
                flops = _per_rank(e.flops, _flops)
                costs = [_per_rank(e.blocks), *sent, flops, f"{e.balance:.2f}", f"{e.total_ms:.3g}"]
            rows.append([str(i), s.node, s.source, *shapes, s.layout, s.comm, s.kernel, *costs])  # fmt: skip
        lines += _table(rows)
        for i, s in enumerate(report.sites):
            if s.estimate is None:
                continue
            extra = []
            if s.choice is not None:
                basis = f", {s.choice.chosen.documents}" if s.choice.chosen.documents else ""
                extra.append(f"auto chose {s.choice.describe()} (the planner's estimates{basis})")
            if s.estimate.documents:
                extra.append(f"costed with {s.estimate.documents}")
            if s.estimate.rates != s.kernel and report.device != "cpu":  # on CPU the header says whose rates
                extra.append(f"rates of {s.estimate.rates}")
            if s.deferred_bytes is not None:
                fwd, bwd = (format_bytes(b) for b in s.deferred_bytes)
                extra.append(f"deferred merge holds {fwd} more in forward, {bwd} in backward (the most on a rank)")
            if s.estimate.levels:
                sent = ", ".join(f"{lv.dim} ({lv.comm}) {format_bytes(lv.fwd)} / {format_bytes(lv.bwd)}"
                                 for lv in s.estimate.levels)  # fmt: skip
                extra.append(f"sent fwd / bwd per rank on each level: {sent}")
            if extra:
                lines += _wrap(f"  site {i}: " + "; ".join(extra), "    ")
        lines += _wrap(f"  estimates: {provenance()}; forward + backward (FLOPs too), slowest rank + time on the "
                       "wire", "    ")  # fmt: skip
    lines.append("")
    if report.refusals:
        lines.append("Refused:")
        for r in report.refusals:
            text = f"  - {r.message}" if r.where in r.message else f"  - [{r.where}] {r.message}"
            lines += _wrap(text, "    ")
    else:
        lines.append("Refused: nothing")
    if report.recommendation is not None:
        lines += [""] + _wrap(report.recommendation.advice())
        lines += _wrap(f"  ({report.recommendation.reason})", "    ")
    for n in report.notes:
        lines += _wrap(f"Note: {n}")
    return "\n".join(lines)

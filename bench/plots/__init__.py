"""Plots of bench/results/*.json into docs/*.png, plus the markdown tables of docs/benchmarks.md
(`python -m bench.plots.single_gpu`, `python -m bench.plots.multi_gpu`; CPU, matplotlib)."""


def reference_lines(ax, target: float, target_label: str) -> None:
    """The ideal (1.0) and the target as labelled horizontal lines (they appear in the legend)."""
    ax.axhline(1.0, color="gray", lw=0.8, label="1.0: ideal")
    ax.axhline(target, color="gray", lw=0.8, ls=":", label=f"{target:g}: {target_label}")

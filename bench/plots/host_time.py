"""Plot bench/results/host_time_ab.json (python -m bench.host_time over two cpcompile trees in one device call) into
docs/host_time.png: a rank's host time and GPU time a layer step, before and after the traced executor, per row of
the last device call. Runs on a CPU machine (matplotlib), from the repository root:

    python -m bench.plots.host_time [bench/results/host_time_ab.json] [docs/host_time.png]
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _row(r: dict) -> str:
    """comm/layout[:options] rank, e.g. ring/thd:deferred r7."""
    options = "".join(f":{o}" for o in r.get("options", []))
    return f"{r['comm']}/{r['layout']}{options} r{r['rank']}"


def main(src: str = "bench/results/host_time_ab.json", png: str = "docs/host_time.png") -> None:
    data = json.load(open(src))
    last = max(r["device_call"] for r in data["runs"])
    runs = {r["label"]: r["records"] for r in data["runs"] if r["device_call"] == last}
    rows = [_row(r) for r in runs["new"]]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.2
    for i, (label, field, color) in enumerate(
        (("old", "host_ms", "#d62728"), ("old", "gpu_ms", "#ff9896"), ("new", "host_ms", "#1f77b4"),
         ("new", "gpu_ms", "#aec7e8"))
    ):  # fmt: skip
        ys = [r[field] for r in runs[label]]
        ax.bar([j + i * width for j in range(len(rows))], ys, width, label=f"{label}: {field[:-3]} ms", color=color)
    ax.set_xticks([j + 1.5 * width for j in range(len(rows))], rows, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("ms a layer step (fwd + bwd)")
    ax.set_title(f"one CP rank, S=32K, cp=8 (4K tokens a rank), {data['machine']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    for label in ("old", "new"):
        for r in runs[label]:
            row = f"| {label} | {_row(r)} | {r['host_ms']:.2f} | {r['gpu_ms']:.2f} | "
            print(row + f"{r['host_ratio']:.2f} | {r['step_efficiency']:.3f} | {r['pipelined_efficiency']:.3f} |")


if __name__ == "__main__":
    main(*sys.argv[1:])

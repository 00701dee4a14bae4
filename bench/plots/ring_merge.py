"""Plot bench/results/ring_merge_h100.json (python -m bench.host_time, two device calls on one warm machine) into
docs/ring_merge.png: the dense ring's GPU busy time and host time a layer step, ranks 0 and 7, for the tree before
this change (old), after it (new: step 0 one causal call, a step on the rows it reaches) and with
backend(deferred_merge=True). Runs on a CPU machine (matplotlib), from the repository root:

    python -m bench.plots.ring_merge [bench/results/ring_merge_h100.json] [docs/ring_merge.png]
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _rows(data: dict) -> list[tuple[str, dict]]:
    """(label, record) in plot order: old and new (one call), then running and deferred (the next call)."""
    rows = [(f"{r['tree']} (call B) r{r['rank']}", r) for r in data["old_vs_new"]]
    for r in data["running_vs_deferred"]:
        mode = "deferred" if "deferred" in r["options"] else "running"
        rows.append((f"{mode} (call A) r{r['rank']}", r))
    return rows


def main(src: str = "bench/results/ring_merge_h100.json", png: str = "docs/ring_merge.png") -> None:
    data = json.load(open(src))
    rows = _rows(data)
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.38
    xs = range(len(rows))
    ax.bar([x - width / 2 for x in xs], [r["gpu_ms"] for _, r in rows], width, label="GPU busy ms", color="#1f77b4")
    ax.bar([x + width / 2 for x in xs], [r["host_ms"] for _, r in rows], width, label="host ms", color="#ff7f0e")
    for x, (_, r) in zip(xs, rows):
        ax.text(x, r["gpu_ms"] + 0.1, f"{r['pipelined_efficiency']:.2f}", ha="center", fontsize=7)
    ax.set_xticks(list(xs), [label for label, _ in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("ms a layer step (fwd + bwd)")
    ax.set_title(f"ring/zigzag, one CP rank, S=32K, cp=8 (4K tokens a rank), {data['meta']['machine']}; "
                 "numbers: back-to-back efficiency", fontsize=8)  # fmt: skip
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Plot bench/results/flex.json into docs/flex.png (slowest CP rank's efficiency against single-GPU flex / cp, per
mask x comm x S x cp) and print the markdown table used in docs/benchmarks.md. Runs on a CPU machine:

    python -m bench.plots.flex
"""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from . import reference_lines  # noqa: E402


def table(rows: list[dict]) -> str:
    lines = ["| mask | S | cp | comm | single-GPU ms | ideal ms | slowest rank ms | efficiency |", "|" + "---|" * 8]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mask']} | {r['seq']} | {r['cp']} | {r['comm']} | {r['single_ms']:.2f} | | error | |")
            continue
        lines.append(
            f"| {r['mask']} | {r['seq'] // 1024}K | {r['cp']} | {r['comm']} | {r['single_ms']:.2f} | "
            f"{r['ideal_ms']:.2f} | {r['slowest_ms']:.2f} | {r['efficiency']:.2f} |"
        )
    return "\n".join(lines)


def main(path: str = "bench/results/flex.json", png: str = "docs/flex.png") -> None:
    rec = json.load(open(path))
    rows = [r for r in rec["rows"] if "efficiency" in r]
    groups = sorted({(r["mask"], r["comm"]) for r in rows})
    cases = sorted({(r["seq"], r["cp"]) for r in rows})
    fig, ax = plt.subplots(figsize=(8, 3.2))
    width = 0.8 / len(groups)
    for i, g in enumerate(groups):
        by = {(r["seq"], r["cp"]): r["efficiency"] for r in rows if (r["mask"], r["comm"]) == g}
        ax.bar([j + i * width for j in range(len(cases))], [by.get(c, 0) for c in cases], width, label="/".join(g))
    ax.set_xticks([j + width * (len(groups) - 1) / 2 for j in range(len(cases))])
    ax.set_xticklabels([f"S={s // 1024}K cp={c}" for s, c in cases], fontsize=8)
    reference_lines(ax, 0.95, "target")
    ax.set_ylabel("ideal / slowest rank")
    ax.legend(fontsize=7, ncols=2, loc="lower left")
    ax.set_title(f"one CP rank's flex_attention fwd+bwd, zigzag, {rec['gpu']}, torch {rec['torch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(table(rec["rows"]))


if __name__ == "__main__":
    main()

"""Plot bench/results/overlap.json (bench.overlap: one CP rank of the compiled attention layer with its collectives
on a stand-in link, against the same graph compute only) into docs/overlap.png: the exposed-communication fraction
per comm against tokens a rank, one panel per (cp, topology). Runs on a CPU machine (matplotlib):

    python -m bench.plots.overlap [bench/results/overlap.json] [docs/overlap.png]

It also prints the records as the markdown table docs/benchmarks.md quotes.
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main(src: str = "bench/results/overlap.json", png: str = "docs/overlap.png") -> None:
    recs = [r for r in json.load(open(src)) if r.get("step_ms_link") is not None]
    panels = sorted({(r["cp"], r["levels"]) for r in recs})
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2), squeeze=False, sharey=True)
    for ax, (cp, levels) in zip(axes[0], panels):
        mine = [r for r in recs if (r["cp"], r["levels"]) == (cp, levels)]
        for key in sorted({(r["layout"], r["comm"]) for r in mine}):
            pts = sorted((r["S"], r["exposed_frac"]) for r in mine if (r["layout"], r["comm"]) == key)
            ax.plot([p[0] // 1024 for p in pts], [p[1] for p in pts], marker="o", label=f"{key[1]} ({key[0]})")
        ax.axhline(0.05, color="gray", lw=0.8, ls="--")
        ax.set_title(f"cp={cp}, {levels}", fontsize=9)
        ax.set_xlabel("tokens a rank (K)")
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("exposed comm / step")
    r0 = recs[0]
    fig.suptitle(f"stand-in link: intra {r0['intra_gbps']:g} GB/s, inter {r0['inter_gbps']:g} GB/s "
                 f"({r0['device']}, {r0['torch']})", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print("| layout | comm | S a rank | cp | levels | kernel | link ms | step ms (link) | step ms (compute) | exposed "
          "| eff (link) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in sorted(recs, key=lambda r: (r["cp"], r["levels"], r["S"], r["layout"], r["comm"])):
        print(f"| {r['layout']} | {r['comm']} | {r['S'] // 1024}K | {r['cp']} | {r['levels']} | {r['kernel']} | "
              f"{r['link_ms']:.2f} | {r['step_ms_link']:.2f} | {r['step_ms_compute']:.2f} | "
              f"{r['exposed_frac']:.3f} | {_fmt(r['efficiency_link'], '.3f')} |")  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:])

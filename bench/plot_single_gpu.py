"""Plot bench/results/single_gpu.json (efficiency of the slowest rank vs ideal) into docs/single_gpu.png and
print the markdown table used in docs/benchmarks.md. Runs on a CPU machine (matplotlib)."""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str = "bench/results/single_gpu.json", png: str = "docs/single_gpu.png") -> None:
    recs = json.load(open(src))
    seqs = sorted({r["S"] for r in recs})
    fig, axes = plt.subplots(1, len(seqs), figsize=(4.2 * len(seqs), 3.6), sharey=True)
    for ax, seq in zip(axes, seqs):
        for (layout, kernel), style in {
            ("zigzag", "cudnn"): "o-",
            ("zigzag", "flash"): "o--",
            ("flat", "cudnn"): "s-",
            ("flat", "flash"): "s--",
        }.items():
            pts = sorted(
                (r["cp"], r["efficiency"]) for r in recs if (r["layout"], r["kernel"], r["S"]) == (layout, kernel, seq)
            )
            if pts:
                ax.plot(*zip(*pts), style, label=f"{layout} / {kernel}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.axhline(0.95, color="gray", lw=0.8, ls=":")
        ax.set_title(f"S = {seq // 1024}K")
        ax.set_xlabel("cp")
        ax.set_xticks(sorted({r["cp"] for r in recs}))
        ax.set_ylim(0, 1.1)
    axes[0].set_ylabel("ideal / slowest rank (fwd+bwd)")
    axes[-1].legend(loc="lower left", fontsize=8)
    fig.suptitle(f"One CP rank's attention on {recs[0]['device']} (torch {recs[0]['torch']}), Llama3-8B shape, bf16")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print("| layout | kernel | S | cp | slowest rank ms | ideal ms | efficiency | merge+copy overhead |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in sorted(recs, key=lambda r: (r["layout"] != "zigzag", r["kernel"], r["S"], r["cp"])):
        ov = f"{100 * r['overhead_frac']:.1f}%" if "overhead_frac" in r else "-"
        print(f"| {r['layout']} | {r['kernel']} | {r['S'] // 1024}K | {r['cp']} | {r['slowest_rank_ms']:.2f} | "
              f"{r['ideal_ms']:.2f} | {r['efficiency']:.3f} | {ov} |")  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:])

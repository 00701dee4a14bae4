"""Plot bench/results/compiled_layer.json (the GPU check's speed rows: one CP rank of the compiled Llama3-8B
attention layer on a fake process group against single-GPU time / cp) into docs/compiled_layer.png. Runs on a
CPU machine (matplotlib), from the repository root:

    python -m bench.plots.compiled_layer [bench/results/compiled_layer.json] [docs/compiled_layer.png]

It also prints the records as the markdown table docs/benchmarks.md quotes.
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str = "bench/results/compiled_layer.json", png: str = "docs/compiled_layer.png") -> None:
    data = json.load(open(src))
    recs, meta = data["records"], data["meta"]
    worst: dict[tuple[str, str], dict] = {}  # the slowest timed rank of each layout x comm
    for r in recs:
        key = (r["layout"], r["comm"])
        if key not in worst or r["efficiency"] < worst[key]["efficiency"]:
            worst[key] = r
    layouts = sorted({k[0] for k in worst}, key=["zigzag", "thd", "thd_zigzag", "thd_balanced"].index)
    comms = sorted({k[1] for k in worst})
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(comms)
    for i, comm in enumerate(comms):
        xs = [j + i * width for j, lay in enumerate(layouts) if (lay, comm) in worst]
        ys = [worst[(lay, comm)]["efficiency"] for lay in layouts if (lay, comm) in worst]
        ax.bar(xs, ys, width, label=comm)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(0.9, color="gray", lw=0.8, ls=":", label="0.90: target at 4K tokens a rank")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(layouts))], layouts)
    ax.set_ylabel("single-GPU time / cp / rank time")
    ax.legend(fontsize=8, ncol=2)
    first = recs[0]
    fig.suptitle(
        f"Compiled Llama3-8B attention layer, one CP rank's compute (fake group), S={first['S']}, cp={first['cp']}\n"
        f"{meta['device']}, torch {meta['torch']}, cpcompile/ at {meta['commit'][:10]}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print("| layout | comm | kernel | rank | rank ms | single-GPU ms | efficiency |")
    print("|---|---|---|---|---|---|---|")
    for r in recs:
        print(f"| {r['layout']} | {r['comm']} | {r['kernel']} | {r['rank']} | {r['rank_ms']:.2f} | "
              f"{r['single_gpu_ms']:.2f} | {r['efficiency']:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:])

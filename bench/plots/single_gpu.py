"""Plot bench/results/single_gpu.json (efficiency of the slowest rank vs ideal) into docs/single_gpu.png (dense)
and docs/single_gpu_thd.png (packed documents), and print the markdown tables used in docs/benchmarks.md.
Runs on a CPU machine (matplotlib), from the repository root:

    python -m bench.plots.single_gpu [bench/results/single_gpu.json] [docs/single_gpu.png]

The THD rows re-measured on an H100 (packed only: docs/single_gpu_h100_thd.png):

    python -m bench.plots.single_gpu bench/results/single_gpu_thd_h100.json docs/single_gpu_h100.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from . import reference_lines  # noqa: E402

THD_KERNEL = "cudnn_varlen"
"""The varlen kernel docs/single_gpu_thd.png shows: cuDNN THD, the one the README measures for packed documents."""

DENSE_STYLES = {
    ("zigzag", "cudnn"): "o-",
    ("zigzag", "flash"): "o--",
    ("flat", "cudnn"): "s-",
    ("flat", "flash"): "s--",
}


def _figure(recs, series: dict, key, png: str, title: str, top: float = 1.1) -> None:
    seqs = sorted({r["S"] for r in recs})
    fig, axes = plt.subplots(1, len(seqs), figsize=(4.2 * len(seqs), 3.6), sharey=True)
    for ax, seq in zip(axes, seqs):
        for name, style in series.items():
            pts = sorted((r["cp"], r["efficiency"]) for r in recs if key(r) == name and r["S"] == seq)
            if pts:
                ax.plot(*zip(*pts), style, label=" / ".join(name))
        reference_lines(ax, 0.95, "target")
        ax.set_title(f"S = {seq // 1024}K")
        ax.set_xlabel("cp")
        ax.set_xticks(sorted({r["cp"] for r in recs}))
        ax.set_ylim(0, top)
    axes[0].set_ylabel("ideal / slowest rank (fwd+bwd)")
    axes[-1].legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=7)  # beside the data, not on it
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(src: str = "bench/results/single_gpu.json", png: str = "docs/single_gpu.png") -> None:
    recs = json.load(open(src))
    dense = [r for r in recs if not r["layout"].startswith("thd")]
    # packed rows: cuDNN THD's, against the corrected ideal (the fastest single-GPU call timed in the same run)
    thd = [r for r in recs if r["layout"].startswith("thd") and r["kernel"] == THD_KERNEL]
    where = f"{recs[0]['device']} (torch {recs[0]['torch']}), Llama3-8B shape, bf16"
    if dense:  # a packed-only re-measure (bench/results/single_gpu_thd_h100.json) has no dense rows
        _figure(dense, DENSE_STYLES, lambda r: (r["layout"], r["kernel"]), png, f"One CP rank's attention on {where}")
    mixes = sorted({r["mix"] for r in thd})
    paths = [("thd", "all_gather", "s"), ("thd_zigzag", "all_gather", "o"), ("thd_balanced", "all_gather", "D"),
             ("thd", "a2a", "^"), ("thd_balanced", "a2a", "v")]  # fmt: skip
    thd_styles = {(lay, comm, m): marker + ("-" if i == 0 else "--")
                  for i, m in enumerate(mixes) for lay, comm, marker in paths}  # fmt: skip
    _figure(thd, thd_styles, lambda r: (r["layout"], r["comm"], r["mix"]), png.replace(".png", "_thd.png"),
            f"Packed documents, one CP rank (cudnn_varlen) vs the fastest single-GPU call / cp, {where}")  # fmt: skip
    print("| layout | kernel | S | cp | slowest rank ms | ideal ms | efficiency | merge+copy overhead | measured |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in sorted(dense, key=lambda r: (r["layout"] != "zigzag", r["kernel"], r["S"], r["cp"])):
        ov = f"{100 * r['overhead_frac']:.1f}%" if "overhead_frac" in r else "-"
        when = "re-run" if "measured_at" in r else "earlier"
        print(f"| {r['layout']} | {r['kernel']} | {r['S'] // 1024}K | {r['cp']} | {r['slowest_rank_ms']:.2f} | "
              f"{r['ideal_ms']:.2f} | {r['efficiency']:.3f} | {ov} | {when} |")  # fmt: skip
    print()
    print("| layout | comm | mix (docs, longest) | S | cp | slowest rank ms | ideal ms | efficiency | slowest / mean "
          "rank | kernels alone: ideal / slowest | executor overhead |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in sorted(thd, key=lambda r: (r["mix"], r["layout"], r["comm"] != "all_gather", r["S"], r["cp"])):
        imb = max(r["per_rank_ms"]) / (sum(r["per_rank_ms"]) / len(r["per_rank_ms"]))
        bare = r["ideal_ms"] / r["kernels_only_ms"][r["slowest_rank"]]
        mix = f"{r['mix']} ({r['n_docs']}, {r['longest_doc']})"
        print(f"| {r['layout']} | {r['comm']} | {mix} | {r['S'] // 1024}K | {r['cp']} | "
              f"{r['slowest_rank_ms']:.2f} | {r['ideal_ms']:.2f} | {r['efficiency']:.3f} | {imb:.2f} | {bare:.3f} | "
              f"{100 * r['overhead_frac']:.1f}% |")  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:])

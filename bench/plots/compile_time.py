"""Plot bench/results/compile_time.json (cold compile time of TinyLlama vs layers, plain Inductor and the
cpcompile backend, and the pass's own seconds) into docs/compile_time.png. Runs on a CPU machine (matplotlib),
from the repository root:

    python -m bench.plots.compile_time [bench/results/compile_time.json] [docs/compile_time.png]
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str = "bench/results/compile_time.json", png: str = "docs/compile_time.png") -> None:
    recs = sorted(json.load(open(src)), key=lambda r: r["layers"])
    layers = [r["layers"] for r in recs]
    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(12, 3.6))  # one metric per axis
    left.plot(layers, [r["inductor_s"] for r in recs], "s-", label="Inductor")
    left.plot(layers, [r["cpcompile_s"] for r in recs], "o--", label="cpcompile (inner Inductor)")
    left.set_ylabel("cold compile, CPU s (fwd + bwd)")
    left.legend(fontsize=8)
    mid.plot(layers, [100 * r["overhead_frac"] for r in recs], "o-")
    mid.axhline(0, color="gray", lw=0.8)
    mid.axhline(10, color="gray", lw=0.8, ls=":", label="10%: target")
    mid.set_ylabel("cpcompile / Inductor - 1 (%)")
    mid.legend(fontsize=8)
    right.plot(layers, [r["pass_s"] * 1e3 for r in recs], "o-")
    right.set_ylabel("the pass's own steps, CPU ms")
    for ax in (left, mid, right):
        ax.set_xlabel("layers (= attention sites)")
        ax.set_xticks(layers)
    first = recs[0]
    fig.suptitle(
        f"What the cpcompile pass adds to a compile: {first.get('gpu') or first['cpu']}, torch {first['torch']}, "
        f"caches off, median of {'-'.join(str(n) for n in sorted({r['repeats'] for r in recs}))} run(s) a row",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print("| layers | sites | inductor s | cpcompile s | overhead | pass s | pass / inductor |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in recs:
        print(
            f"| {r['layers']} | {r['sites']} | {r['inductor_s']:.1f} | {r['cpcompile_s']:.1f} | "
            f"{r['overhead_frac']:+.1%} | {r['pass_s']:.3f} | {r['pass_frac']:.2%} |"
        )


if __name__ == "__main__":
    main(*sys.argv[1:])

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
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    left.plot(layers, [r["inductor_s"] for r in recs], "s-", label="Inductor")
    left.plot(layers, [r["cpcompile_s"] for r in recs], "o--", label="cpcompile (inner Inductor)")
    left.set_xlabel("layers (= attention sites)")
    left.set_ylabel("cold compile, CPU s (fwd + bwd)")
    left.set_xticks(layers)
    left.legend(fontsize=8)
    right.plot([r["sites"] for r in recs], [r["pass_s"] * 1e3 for r in recs], "o-", label="the pass's steps")
    right.set_xlabel("attention sites")
    right.set_ylabel("pass, CPU ms")
    right.set_xticks([r["sites"] for r in recs])
    for r in recs:
        right.annotate(f"{r['overhead_frac']:+.1%}", (r["sites"], r["pass_s"] * 1e3), fontsize=7)
    right.set_title("labels: cpcompile / Inductor - 1", fontsize=8)
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

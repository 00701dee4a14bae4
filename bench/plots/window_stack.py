"""Plot bench/results/window_stack.json (bench.window_stack: one CP rank of a Gemma-3-like 5:1 windowed stack on
a fake process group, per comm, against the whole stack on one GPU) into docs/window_stack.png: speed and
activation memory, each against single-GPU / cp. Runs on a CPU machine (matplotlib), from the repository root:

    python -m bench.plots.window_stack [bench/results/window_stack.json] [docs/window_stack.png]

It also prints the records as the markdown table docs/benchmarks.md quotes.
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str = "bench/results/window_stack.json", png: str = "docs/window_stack.png") -> None:
    data = json.load(open(src))
    recs = [r for r in data["records"] if "error" not in r]
    single = data["single_gpu"]
    comms = [r["comm"] for r in recs]
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(8, 3.5))
    speed.bar(comms, [r["efficiency"] for r in recs])
    speed.axhline(1.0, color="gray", lw=0.8)
    speed.set_ylabel("single-GPU step / cp / rank step")
    speed.set_title("speed (compute only)", fontsize=9)
    memory.bar(comms, [r["memory_vs_single_over_cp"] for r in recs], color="tab:orange")
    memory.axhline(1.0, color="gray", lw=0.8)
    memory.set_ylabel("rank activations / (single-GPU / cp)")
    memory.set_title("activation memory", fontsize=9)
    fig.suptitle(
        f"Gemma-3-like stack ({single['layers']} windowed:global, window {single['window']}), S={single['S']}, "
        f"cp={single['cp']}, {single['layout']}, rank {single['rank']}\n{single['device']}, torch {single['torch']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print("| comm | rank step ms | single-GPU ms | efficiency | rank activations GiB | vs single-GPU / cp |")
    print("|---|---|---|---|---|---|")
    for r in data["records"]:
        if "error" in r:
            print(f"| {r['comm']} | {r['error']} | | | | |")
            continue
        print(f"| {r['comm']} | {r['step_ms']:.1f} | {r['single_gpu_step_ms']:.1f} | {r['efficiency']:.3f} | "
              f"{r['activation_bytes'] / 2**30:.2f} | {r['memory_vs_single_over_cp']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Plot bench/results/multi_gpu.json into docs/multi_gpu.png (efficiency vs ideal and speedup vs PyTorch's
context_parallel per layout x comm) and print the markdown tables used in docs/benchmarks.md. Runs on a CPU
machine (matplotlib), from the repository root:

    python -m bench.plots.multi_gpu
"""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from . import reference_lines  # noqa: E402


def main(path: str = "bench/results/multi_gpu.json", png: str = "docs/multi_gpu.png") -> None:
    recs = json.load(open(path))
    layer = [r for r in recs if r.get("kind") != "train_step" and r["latency_ms"] is not None]
    names = sorted({(r["layout"], r["comm"]) for r in layer})
    tokens = sorted({r["tokens_per_gpu"] for r in layer})
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    width = 0.8 / len(tokens)
    for i, tpg in enumerate(tokens):
        by = {(r["layout"], r["comm"]): r for r in layer if r["tokens_per_gpu"] == tpg}
        xs = [j + i * width for j in range(len(names))]
        for ax, field in zip(axes, ("efficiency", "speedup_vs_pytorch_cp")):
            ax.bar(xs, [by[n][field] if n in by else 0 for n in names], width, label=f"{tpg // 1024}K tokens/GPU")
    for ax, label, target in zip(axes, ("ideal / latency", "PyTorch CP latency / cpcompile"), (0.95, 1.3)):
        ax.set_xticks([j + width * (len(tokens) - 1) / 2 for j in range(len(names))])
        ax.set_xticklabels(["/".join(n) for n in names], fontsize=7)
        reference_lines(ax, target, "target")
        ax.set_ylabel(label)
        ax.legend(fontsize=7, loc="lower left")
    cp = ", ".join(str(c) for c in sorted({r["cp"] for r in layer}))
    fig.suptitle(f"one attention layer fwd+bwd, cp={cp}, {layer[0]['device']}, NCCL", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    cols = ["layout", "comm", "cp", "tokens/GPU", "latency ms", "ideal ms", "efficiency", "PyTorch CP ms"]
    print("| " + " | ".join(cols) + " | speedup vs PyTorch CP |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in sorted(layer, key=lambda r: (r["tokens_per_gpu"], r["layout"], r["comm"])):
        print(
            f"| {r['layout']} | {r['comm']} | {r['cp']} | {r['tokens_per_gpu'] // 1024}K | {r['latency_ms']:.2f} | "
            f"{r['ideal_ms']:.2f} | {r['efficiency']:.3f} | {r['pytorch_cp_ms']:.2f} | "
            f"{r['speedup_vs_pytorch_cp']:.2f}x |"
        )
    print()
    print("| cp | tokens/GPU | cpcompile zigzag step ms | no CP (full sequence on each GPU) ms |")
    print("| --- | --- | --- | --- |")
    for r in (r for r in recs if r.get("kind") == "train_step"):
        print(
            f"| {r['cp']} | {r['tokens_per_gpu'] // 1024}K | {r['cpcompile_zigzag_ms']:.1f} | "
            f"{r['no_cp_full_sequence_per_gpu_ms']:.1f} |"
        )


if __name__ == "__main__":
    main()

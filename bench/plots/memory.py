"""Plot bench/results/memory.json into docs/memory.png: per-rank activation memory (peak - static) of one
training step against S, one line per comm, against single-GPU activations / cp (dashed); one panel per measured
(stack, cp) pair (layers, MLP, checkpointing). Prints the markdown table for docs/scale.md. Runs on a CPU
machine (matplotlib), from the repository root:

    python -m bench.plots.memory [--json bench/results/memory.json] [--png docs/memory.png]
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

GIB = 2**30


def _stack(r: dict) -> str:
    return f"{r['layers']} layers{' +MLP' if r['mlp'] else ''}{' ckpt' if r['checkpoint'] else ''}"


def table(recs: list[dict]) -> str:
    cols = ("peak", "static", "activations", "single-GPU act. / cp", "target")
    head = "| stack | S | cp | comm | " + " | ".join(f"{c} GiB" for c in cols) + " | meets |"
    lines = [head, "| --- " * 10 + "|"]
    for r in recs:
        if "skipped" in r:
            lines.append(f"| {_stack(r)} | {r['S'] // 1024}K | {r['cp']} | {r['name']} | skipped: {r['skipped']} |")
            continue
        single = r["single_gpu_peak_bytes"]
        per_cp = None if single is None else (single - r["single_gpu_static_bytes"]) / r["cp"]
        act = None if r["peak_bytes"] is None else r["peak_bytes"] - r["static_bytes"]
        cells = [r["peak_bytes"], r["static_bytes"], act, per_cp, r["target_bytes"]]
        row = " | ".join("-" if c is None else f"{c / GIB:.2f}" for c in cells)
        meets = "-" if r["meets_target"] is None else r["meets_target"]
        lines.append(f"| {_stack(r)} | {r['S'] // 1024}K | {r['cp']} | {r['name']} | {row} | {meets} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default="bench/results/memory.json")
    p.add_argument("--png", default="docs/memory.png")
    args = p.parse_args(argv)
    recs = json.load(open(args.json))
    done = [r for r in recs if "skipped" not in r and r.get("activation_bytes") is not None]
    panels = sorted({(_stack(r), r["cp"]) for r in done})  # only what was measured: no empty panel
    if not done:
        raise SystemExit(f"{args.json}: no measured records with a single-GPU baseline")
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3.2), squeeze=False)
    for ax, (stack, cp) in zip(axes[0], panels):
        mine = [r for r in done if _stack(r) == stack and r["cp"] == cp]
        for name in sorted({r["name"] for r in mine}):
            pts = sorted((r["S"], r["activation_bytes"] / GIB) for r in mine if r["name"] == name)
            ax.plot([s / 1024 for s, _ in pts], [b for _, b in pts], marker="o", label=name)
        base = sorted({(r["S"], (r["single_gpu_peak_bytes"] - r["single_gpu_static_bytes"]) / cp / GIB) for r in mine})
        ax.plot([s / 1024 for s, _ in base], [b for _, b in base], "k--", label="single GPU / cp")
        ax.set_xscale("log", base=2)
        ticks = sorted({r["S"] // 1024 for r in mine})
        ax.set_xticks(ticks, [f"{t}K" for t in ticks])
        ax.minorticks_off()
        ax.set_title(f"{stack}, cp={cp}", fontsize=8)
        ax.set_xlabel("S (K tokens)", fontsize=8)
        ax.set_ylabel("activations GiB / rank", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=6)
    d = done[0]
    fig.suptitle(f"per-rank peak - static, one fwd+bwd, {d['layout']}, {d['device']}, torch {d['torch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(table(recs))


if __name__ == "__main__":
    main()

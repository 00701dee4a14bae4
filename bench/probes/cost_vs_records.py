"""Does the shipped cost model rank the varlen kernels as a results file measured them? Out of sample: the records
need not be the ones its rates were fitted on (bench/cost_rates.py reads bench/results/single_gpu.json).

For every packed record pair that differs only in the kernel (cudnn_varlen vs flash_varlen: same layout, comm,
mix, S, cp), the model's estimate of each (cost.estimate with the record's documents, thd_balanced's plan made
of them as shard_batch makes it; host time a call included, as kernel="auto" weighs it) against the measured
slowest rank. A pair measured within cost.TIE is a tie; otherwise kernel="auto"'s pick (the first option, in
VARLEN_AUTO_ORDER, within TIE of the fastest estimate: cost/choose.py) is right or wrong, and a wrong pick costs
the measured ratio. Then the same for the (comm, kernel) pairs of each layout's run, what comm="auto" with
kernel="auto" weighs, on the records' compute (the bench times no communication: the estimates' time on the
wire is left out). CPU only:

    python -m bench.probes.cost_vs_records [bench/results/single_gpu_thd_h100.json] [--gpu-only]

--gpu-only leaves the host term out of the estimates: the single-GPU bench times steps back to back, where a
call's host time hides behind the GPU's work, while the model adds it in full (a compiled step at a few thousand
tokens a rank is host-bound). Without it the check judges the GPU side of the model alone, the part the rates fit.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections import defaultdict

import torch

from bench.thd_cases import doc_lengths
from cpcompile.comms.registry import COMMS
from cpcompile.cost import TIE, Estimate, SiteShape, estimate
from cpcompile.families.varlen.costing import PACKED
from cpcompile.kernels import VARLEN_AUTO_ORDER
from cpcompile.layouts.thd import get_packed_layout

KERNELS = ("cudnn_varlen", "flash_varlen")


def site(rec: dict, lengths: list[int]) -> SiteShape:
    """The record's attention site: its heads and head dim, bf16, causal, batch 1, the rank's share of S."""
    return SiteShape(
        costing=PACKED, batch=1, tokens=rec["S"] // rec["cp"], q_heads=rec["hq"], kv_heads=rec["hkv"],
        head_dim=rec["head_dim"], v_head_dim=rec["head_dim"], elt=2, acc_elt=4, causal=True, world=rec["cp"],
        max_doc=max(lengths), return_lse=False,
    )  # fmt: skip


def documents(rec: dict, lengths: list[int]) -> torch.Tensor:
    """The cu_seqlens the site's varlen_attn gets: the offsets, or thd_balanced's plan made of them."""
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    return get_packed_layout(rec["layout"]).prepare(offsets, sum(lengths), rec["cp"]).long()


def estimated(rec: dict) -> Estimate:
    """The model's estimate of the record's site, comm and kernel, with the record's documents."""
    lengths = doc_lengths(rec["S"], rec["mix"])
    if len(lengths) != rec["n_docs"] or max(lengths) != rec["longest_doc"]:
        raise SystemExit(f"{rec['mix']} at S={rec['S']}: the mix regenerates otherwise than the record's documents")
    return estimate(site(rec, lengths), rec["layout"], rec["comm"], rec["kernel"], documents(rec, lengths))


def model_ms(est: Estimate, gpu_only: bool) -> float:
    """What kernel="auto" weighs (`total_ms`: compute, host, wire), or the slowest rank's compute alone."""
    return max(est.compute_ms) + est.wire_ms if gpu_only else est.total_ms


def auto_pick(est: dict[str, float]) -> str:
    """kernel="auto" between the two: the first in VARLEN_AUTO_ORDER within TIE of the fastest estimate."""
    best = min(est.values())
    return next(k for k in VARLEN_AUTO_ORDER if k in est and est[k] <= best * (1 + TIE))


def main(path: str = "bench/results/single_gpu_thd_h100.json", *flags: str) -> None:
    if set(flags) - {"--gpu-only"}:
        raise SystemExit(f"unknown flags {flags}: only --gpu-only")
    gpu_only = "--gpu-only" in flags
    runs: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for rec in json.load(open(path)):
        if rec["layout"].startswith("thd") and rec["kernel"] in KERNELS:
            runs[(rec["layout"], rec["comm"], rec["mix"], rec["S"], rec["cp"])][rec["kernel"]] = rec
    runs = {key: pair for key, pair in runs.items() if set(pair) == set(KERNELS)}
    est_of = {id(rec): estimated(rec) for pair in runs.values() for rec in pair.values()}  # each record once
    ranked = ties = 0
    wrong: list[float] = []
    print("| layout | comm | mix | S | cp | measured ms cuDNN / FA2 | estimated ms cuDNN / FA2 | auto | verdict |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for key, pair in sorted(runs.items()):
        meas = {k: pair[k]["slowest_rank_ms"] for k in KERNELS}
        est = {k: model_ms(est_of[id(pair[k])], gpu_only) for k in KERNELS}
        pick, faster = auto_pick(est), min(meas, key=meas.get)
        if abs(meas["cudnn_varlen"] - meas["flash_varlen"]) <= TIE * min(meas.values()):
            verdict, ties = "tie", ties + 1
        else:
            ranked += 1
            verdict = "right" if pick == faster else f"WRONG: {meas[pick] / meas[faster]:.2f}x"
            if pick != faster:
                wrong.append(meas[pick] / meas[faster])
        layout, comm, mix, seq, cp = key
        print(f"| {layout} | {comm} | {mix} | {seq // 1024}K | {cp} | {meas['cudnn_varlen']:.2f} / "
              f"{meas['flash_varlen']:.2f} | {est['cudnn_varlen']:.2f} / {est['flash_varlen']:.2f} | {pick} | "
              f"{verdict} |")  # fmt: skip
    worst = f", the worst {max(wrong):.2f}x the faster kernel's time" if wrong else ""
    print(f"\n{ranked} pairs ranked, {ties} ties; auto picks the slower kernel at {len(wrong)}{worst}")
    both_auto(runs, est_of, gpu_only)


def both_auto(runs: dict[tuple, dict[str, dict]], est_of: dict[int, Estimate], gpu_only: bool = False) -> None:
    """Per layout x mix x S x cp: the (comm, kernel) the model ranks first (compute and host, no wire; ties
    within TIE to the first in the comm registry's and VARLEN_AUTO_ORDER's order) against the measured fastest."""
    points: dict[tuple, list[dict]] = defaultdict(list)
    for (layout, _, mix, seq, cp), pair in runs.items():
        points[(layout, mix, seq, cp)] += pair.values()
    comm_order = {c: i for i, c in enumerate(COMMS)}  # the registry's order: comm="auto"'s ties
    print("\n| layout | mix | S | cp | measured fastest | auto's pick | its measured time / the fastest |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    wrong = []
    for (layout, mix, seq, cp), recs in sorted(points.items()):
        est = {(r["comm"], r["kernel"]): model_ms(est_of[id(r)], gpu_only) - est_of[id(r)].wire_ms for r in recs}
        meas = {(r["comm"], r["kernel"]): r["slowest_rank_ms"] for r in recs}
        order = sorted(est, key=lambda o: (comm_order[o[0]], VARLEN_AUTO_ORDER.index(o[1])))
        pick = next(o for o in order if est[o] <= min(est.values()) * (1 + TIE))
        fastest = min(meas, key=meas.get)
        ratio = meas[pick] / meas[fastest]
        if ratio > 1 + TIE:
            wrong.append(ratio)
        print(f"| {layout} | {mix} | {seq // 1024}K | {cp} | {' + '.join(fastest)} | {' + '.join(pick)} | "
              f"{ratio:.2f} |")  # fmt: skip
    worst = f", the worst {max(wrong):.2f}x" if wrong else ""
    print(f"\n{len(points)} runs; auto's (comm, kernel) more than TIE slower than the fastest at {len(wrong)}{worst}")


if __name__ == "__main__":
    main(*sys.argv[1:])

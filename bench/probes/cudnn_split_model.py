"""The cost model's counts of cuDNN's calls against the split probe's measurements (CPU only, no GPU).

For every case of a `cudnn_split_probe` log, the model's time of the slowest rank's all_gather block
(cost/work.py's counts x cost/rates.json's fitted rates) as four calls: one bottom-right call through the
adjacent cu_seqlens encoding ("one", what cuDNN ran before it addressed ranges directly), FA2 over the same
encoding, cuDNN's split (its `launches` above SPLIT_MIN_ROWS) and its direct one call (below it), beside the
probe's measured GPU ms:

    python -m bench.probes.cudnn_split_model [--log bench/results/logs/cudnn_split_probe_padded_h100.txt]
"""

from __future__ import annotations

import argparse
import re

import torch

from bench.thd_cases import doc_lengths
from cpcompile.comms.registry import get_comm
from cpcompile.cost.rates import kernel_rate
from cpcompile.cost.work import CallWork, sequence_work
from cpcompile.kernels import get_varlen_kernel
from cpcompile.kernels.varlen_ranges import encoded_launch
from cpcompile.layouts import get_packed_layout

LINE = re.compile(
    r"(\w+):(\S+):(\d+):(\d+): ideal [\d.]+ ms.*?"
    r"one ([\d.]+) ms.*?fa2 ([\d.]+) ms.*?split ([\d.]+) ms.*?direct ([\d.]+) ms"
)
HQ, D = 32, 128
"""The probe's heads and head dim (Llama3-8B attention)."""


def counted(calls) -> CallWork:
    """The counts of a provider's calls (kernels.base.VarlenLaunch), as cost/work.varlen_work adds them."""
    total = CallWork()
    for c in calls:
        qs, qe, ks, ke = c.ranges
        total = total + sequence_work(qe - qs, ke - ks, c.causal, c.window, bound_q=c.max_q, bound_k=c.max_k,
                                      launched=c.sequences, top_left=c.top_left)  # fmt: skip
    return total


def modelled(layout: str, mix: str, seq: int, cp: int) -> dict[str, float]:
    """The model's ms of the slowest rank, per way of running its block."""
    lengths = doc_lengths(seq, mix)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packed = get_packed_layout(layout)
    docs = packed.prepare(cu, seq, cp) if packed.carries_plan else cu
    region = get_comm("all_gather").regions["varlen"]
    cudnn, fa2 = kernel_rate("cudnn_varlen", "varlen"), kernel_rate("flash_varlen", "varlen")
    provider = get_varlen_kernel("cudnn_varlen")
    worst = dict.fromkeys(("one", "fa2", "split", "direct"), 0.0)
    for rank in range(cp):
        (b,) = region.rank_blocks(layout, True, rank, cp, seq // cp, docs, max(lengths), (-1, -1))
        args = (b.ranges.long(), b.causal, tuple(b.window), b.square, b.covers_rows and b.covers_keys)
        encoded = counted(encoded_launch(*args, b.max_q, b.max_k))
        ways = {
            "one": (encoded, cudnn),
            "fa2": (encoded, fa2),
            "split": (counted(provider.launches(*args, 1 << 40, b.max_q, b.max_k)), cudnn),
            "direct": (counted(provider.launches(*args, 0, b.max_q, b.max_k)), cudnn),
        }
        for way, (work, rate) in ways.items():
            worst[way] = max(worst[way], rate.ms(work, HQ, D, D))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log", default="bench/results/logs/cudnn_split_probe_padded_h100.txt")
    log = open(ap.parse_args().log).read()
    print(
        "case | measured one / fa2 / split / direct ms | model one / fa2 / split / direct ms | split/direct meas, model"
    )
    for m in LINE.finditer(log):
        layout, mix, seq, cp = m.group(1), m.group(2), int(m.group(3)), int(m.group(4))
        meas = dict(zip(("one", "fa2", "split", "direct"), map(float, m.group(5, 6, 7, 8))))
        model = modelled(layout, mix, seq, cp)
        fmt = " / ".join
        print(f"{layout}:{mix}:{seq}:{cp} | {fmt(f'{v:.2f}' for v in meas.values())} | "
              f"{fmt(f'{v:.2f}' for v in model.values())} | "
              f"{meas['split'] / meas['direct']:.2f}, {model['split'] / model['direct']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()

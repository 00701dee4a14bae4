"""How much FA2 varlen's static grid costs a THD rank: the same calls with the length bounds x1, x2, x4.

FA2 sizes its grid by max_q (forward: q tiles) and max_k (backward: key tiles) x sequences x heads; tiles past a
sequence's real length exit at once but are still scheduled. If doubling the bounds adds X ms, the bounds the
layouts pass cost about X ms too. One case per --cases entry (layout:mix:S:cp:rank), kernels alone, fwd and bwd
timed separately. Prints one line a bound; nothing is written. Log: bench/results/logs/grid_probe_h200.txt.

    python -m bench.probes.grid_probe [--cases thd_zigzag:docs-median-1K:32768:8:0,...]
"""

from __future__ import annotations

import argparse

from bench import thd_cases
from bench.common import time_many_ms
from cpcompile.comms.all_gather.varlen import read_keys
from cpcompile.executor import decode_varlen
from cpcompile.kernels import get_varlen_kernel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="thd_zigzag:docs-median-1K:32768:8:0,thd_zigzag:docs-median-8K:131072:8:0")
    args = ap.parse_args()
    impl = get_varlen_kernel("flash_varlen")
    for spec in args.cases.split(","):
        layout, mix, seq, cp, rank = spec.split(":")
        q, gathered, (key_index, _), dout, ranges, blocks = thd_cases.rank_case(
            layout, thd_cases.doc_lengths(int(seq), mix), int(cp), int(rank)
        )
        keys = read_keys(gathered, key_index)
        k, v = keys[:, 0], keys[:, 1]
        (r,), (block,) = ranges, decode_varlen(blocks)
        causal, mq, mk, kw = block.causal, block.max_q, block.max_k, block.kernel_kwargs()
        out, lse = impl.forward(q, k, v, r, mq, mk, causal, thd_cases.SCALE, **kw)
        fwd = dict(q=q, k=k, v=v, ranges=r, causal=causal, scale=thd_cases.SCALE, **kw)
        bwd = dict(fwd, dout=dout, out=out, lse=lse)
        fns = []
        for f in (1, 2, 4):
            bounds = dict(max_q=mq * f, max_k=mk * f)
            fns.append(lambda a=fwd, b=bounds: impl.forward(**a, **b))
            fns.append(lambda a=bwd, b=bounds: impl.backward(**a, **b))
        ms = time_many_ms(fns, 7, 2)
        for i, f in enumerate((1, 2, 4)):
            bounds = f"max_q {mq * f}, max_k {mk * f}"
            print(f"{spec} bounds x{f} ({bounds}): fwd {ms[2 * i]:.3f} ms, bwd {ms[2 * i + 1]:.3f} ms")


if __name__ == "__main__":
    main()

"""Host ops a packed region dispatches inside its executor ops, per call (ring step), on CPU (no GPU needed).

    python -m bench.probes.host_ops [--cp 8] [--ranks 0,7]

Runs each packed region eagerly on a fake process group with cudnn_varlen on its CPU stand-in (its kernel
calls count one op each) and prints, per (comm, layout, rank), the ops inside every forward and backward
executor call, and the region call's total (eager: its own metadata ops too, which Inductor compiles into a
few kernels). What the compiled layer still dispatches op by op on the host is the executor calls' share.
"""

from __future__ import annotations

import argparse

from tests.support.host_ops import count_region

CASES = [
    ("ring", "thd_zigzag"),
    ("ring", "thd"),
    ("all_gather", "thd_zigzag"),
    ("all_gather", "thd"),
    ("all_gather", "thd_balanced"),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cp", type=int, default=8)
    ap.add_argument("--ranks", default="0,7")
    args = ap.parse_args()
    print("comm/layout rank: forward ops per call | backward ops per call | executor total | region call (eager)")
    for comm, layout in CASES:
        for rank in map(int, args.ranks.split(",")):
            try:
                count = count_region(comm, layout, world=args.cp, rank=rank)
            except AssertionError:  # the stand-in asserts that max_seqlen bounds every sequence, gaps included
                print(f"{comm}/{layout} rank {rank}: the stand-in refused a sequence longer than its max_seqlen")
                continue
            fwd, bwd = count.per_call("attend_varlen_blocks"), count.per_call("attend_varlen_blocks_backward")
            print(f"{comm}/{layout} rank {rank}: {fwd} | {bwd} | {sum(fwd) + sum(bwd)} | {count.total}", flush=True)


if __name__ == "__main__":
    main()

"""Where a THD rank's time goes: torch.profiler over the region's work between collectives (bench/thd_cases.py).

    python -m bench.probes.profile_thd [--cases thd:docs-median-1K:32768:2:1,thd_zigzag:docs-median-1K:32768:8:0]

Prints, per case, the CUDA kernels by total time over 5 runs (fwd+bwd, after warm-up).
"""

from __future__ import annotations

import argparse

import torch

from bench import thd_cases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="thd:docs-median-1K:32768:2:1,thd_zigzag:docs-median-1K:32768:8:0")
    ap.add_argument("--kernel", default="flash_varlen")
    args = ap.parse_args()
    for spec in args.cases.split(","):
        layout, mix, seq, cp, rank = spec.split(":")
        lengths = thd_cases.doc_lengths(int(seq), mix)
        case = thd_cases.rank_case(layout, lengths, int(cp), int(rank))
        run = thd_cases.region_fn(*case, args.kernel)
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                run()
            torch.cuda.synchronize()
        print(f"\n=== {spec} (5 runs)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))


if __name__ == "__main__":
    main()

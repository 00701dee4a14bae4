"""Where the host time of one CP rank's compiled layer step goes (the GPU check's layer, bench/gpu_speed.py):
each step runs behind a long GPU sleep (nothing on the host waits for the GPU), under cProfile, and the top
functions by own time are printed, beside the single-GPU layer's host time as the floor.

    python -m bench.probes.host_profile [--cases ring:zigzag,a2a:zigzag,all_gather:thd] [--rank 0] [--rows 25]

cProfile inflates Python's share; read the ranking, and the un-profiled host ms printed first.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch

from bench.common import host_and_gpu_ms
from bench.gpu_speed import SPEED_CP, _single, check_layer, fake_group, warm_rank_step

SLEEP = 200_000_000


def _profiled(step, rows: int) -> str:
    prof = cProfile.Profile()
    for _ in range(5):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP)
        prof.enable()
        step()
        prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(rows)
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="ring:zigzag,a2a:zigzag,all_gather:thd")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--kernel", default="auto")
    args = ap.parse_args()
    layer, dense_x, cu = check_layer()
    longest = int((cu[1:] - cu[:-1]).max())
    singles = {"dense": _single(layer, dense_x, None, 0), "packed": _single(layer, dense_x[0], cu, longest)}
    for kind, single in singles.items():
        for _ in range(3):
            single()
        host, gpu = host_and_gpu_ms(single)
        print(f"single-GPU {kind} layer: host {host:.2f} ms / GPU {gpu:.2f} ms", flush=True)
    with fake_group(args.rank, SPEED_CP):
        for case in args.cases.split(","):
            step, kernel = warm_rank_step(layer, case, dense_x, cu, args.rank, args.kernel)
            host, gpu = host_and_gpu_ms(step)
            print(f"\n=== {case} rank {args.rank} ({kernel}): host {host:.2f} ms / GPU {gpu:.2f} ms", flush=True)
            print(_profiled(step, args.rows), flush=True)


if __name__ == "__main__":
    main()

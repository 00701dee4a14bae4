"""Host time a step, three ways, for one CP rank's compiled layer (the GPU check's layer, bench/gpu_speed.py): why
the one-step host time can exceed the step time back to back.

- first: the GPU check's measure (bench.common.host_and_gpu_ms): the CPU time of one step enqueued behind a long
  GPU sleep, the host cold after the synchronise before it;
- steady: the CPU time of `--steps` steps enqueued in a row behind one long sleep (nothing waits for the GPU:
  the sleep outlasts them; few enough steps that their launches fit the driver's queue, which would otherwise
  block), a step's share: what a training loop's host pays once it is warm;
- back to back: the step time of steps run back to back, no sleep (bench.common.back_to_back_ms).

If steady is well below first, the one-step measure charges a cold start (caches, the CUDA driver's first
launches after a synchronise) that a loop over many layers does not pay.

    python -m bench.probes.host_steady [--cases a2a:thd,all_gather:thd,a2a:zigzag] [--kernel auto] [--rank 0]
"""

from __future__ import annotations

import argparse

import torch

from bench.common import HOST_SLEEP_CYCLES, back_to_back_ms, host_and_gpu_ms, queued_host_ms
from bench.gpu_speed import SPEED_CP, check_layer, fake_group, warm_rank_step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="a2a:thd,all_gather:thd,a2a:zigzag")
    ap.add_argument("--kernel", default="auto")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--steps", type=int, default=5)  # x ~75 launches: well inside the driver's launch queue
    args = ap.parse_args()
    layer, dense_x, cu = check_layer()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ms a step, rank {args.rank}", flush=True)
    with fake_group(args.rank, SPEED_CP):
        for case in args.cases.split(","):
            step, kernel = warm_rank_step(layer, case, dense_x, cu, args.rank, args.kernel)
            first, gpu = host_and_gpu_ms(step)
            steady = queued_host_ms(step, args.steps, sleep_cycles=HOST_SLEEP_CYCLES * args.steps)
            b2b = back_to_back_ms(step)
            print(f"{case} ({kernel}): host first {first:.2f}, steady {steady:.2f}; GPU {gpu:.2f}; "
                  f"back to back {b2b:.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

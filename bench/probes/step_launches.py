"""What one CP rank's compiled layer step launches, by name, for each kernel choice (the GPU check's layer,
bench/gpu_speed.py): the CPU-side launches (`cudaLaunchKernel` and the like) and the GPU kernels of one step,
counted under torch.profiler, so two kernel choices of the same row can be told apart launch by launch.

    python -m bench.probes.step_launches [--cases a2a:thd,all_gather:thd] [--kernels cudnn_varlen,flash_varlen]
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from bench.gpu_layer import PACKED
from bench.gpu_speed import SPEED_CP, check_layer, fake_group, warm_rank_step


def _launches(step) -> tuple[Counter, Counter]:
    """(GPU kernels by name, CPU runtime calls by name) of one step."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    gpu, cpu = Counter(), Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            gpu[e.name[:90]] += 1
        elif e.name.startswith(("cuda", "cu")) and "Launch" in e.name:
            cpu[e.name] += 1
    return gpu, cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="a2a:thd,all_gather:thd")
    ap.add_argument("--kernels", default="cudnn_varlen,flash_varlen")
    ap.add_argument("--rank", type=int, default=0)
    args = ap.parse_args()
    layer, dense_x, cu = check_layer()
    with fake_group(args.rank, SPEED_CP):
        for case in args.cases.split(","):
            assert case.split(":")[1] in PACKED, f"{case}: this probe counts the packed rows"
            for kernel in args.kernels.split(","):
                step, resolved = warm_rank_step(layer, case, dense_x, cu, args.rank, kernel)
                gpu, cpu = _launches(step)
                print(f"\n=== {case} rank {args.rank} ({resolved}): {sum(gpu.values())} GPU kernels, "
                      f"CPU launches {dict(cpu)}", flush=True)  # fmt: skip
                for name, n in sorted(gpu.items(), key=lambda kv: (-kv[1], kv[0])):
                    print(f"  {n:3d}  {name}")


if __name__ == "__main__":
    main()

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

from bench.gpu_layer import LLAMA3_8B, PACKED, build, cu_of, documents
from bench.gpu_speed import DTYPE, SPEED_CP, SPEED_SEQ, fake_group, rank_step


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
    torch._dynamo.config.cache_size_limit = 256
    layer = build(LLAMA3_8B, DTYPE)
    x = torch.randn(SPEED_SEQ, LLAMA3_8B.hidden, device="cuda", dtype=DTYPE)
    cu = cu_of(documents(SPEED_SEQ, seed=3, unit=2 * SPEED_CP))
    with fake_group(args.rank, SPEED_CP):
        for case in args.cases.split(","):
            comm, layout = case.split(":")
            assert layout in PACKED, f"{layout}: this probe times the packed rows"
            for kernel in args.kernels.split(","):
                step, resolved = rank_step(layer, layout, comm, x, cu, args.rank, kernel)
                for _ in range(3):
                    step()
                gpu, cpu = _launches(step)
                print(f"\n=== {case} rank {args.rank} ({resolved}): {sum(gpu.values())} GPU kernels, "
                      f"CPU launches {dict(cpu)}", flush=True)  # fmt: skip
                for name, n in sorted(gpu.items(), key=lambda kv: (-kv[1], kv[0])):
                    print(f"  {n:3d}  {name}")


if __name__ == "__main__":
    main()

"""Where one CP rank of the GPU check's compiled layer spends its time (bench/gpu_speed.py's speed rows): wall time
of a step against the GPU time inside it, then torch.profiler's top ops by CUDA and by CPU time.

    python -m bench.probes.profile_layer [--cases ring:thd_zigzag,ring:thd,all_gather:thd_zigzag] [--rank 0]

A step whose wall time far exceeds its GPU time is host-bound (Python, graph builds, syncs), not kernel-bound.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.gpu_layer import LLAMA3_8B, PACKED, build, cu_of, documents
from bench.gpu_speed import DTYPE, SPEED_CP, SPEED_SEQ, fake_group, rank_step


def _profile(step, label: str, rows: int) -> None:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / 5 * 1e3
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]  # op rows repeat their kernels
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 5 / 1e3
    print(f"\n=== {label}: wall {wall_ms:.2f} ms/step, GPU busy {gpu_ms:.2f} ms/step", flush=True)
    print(events.table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=70), flush=True)
    print(events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=70), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="ring:thd_zigzag,ring:thd,all_gather:thd_zigzag")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--rows", type=int, default=18)
    args = ap.parse_args()
    torch._dynamo.config.cache_size_limit = 256
    layer = build(LLAMA3_8B, DTYPE)
    dense_x = torch.randn(1, SPEED_SEQ, LLAMA3_8B.hidden, device="cuda", dtype=DTYPE)
    cu = cu_of(documents(SPEED_SEQ, seed=3, unit=2 * SPEED_CP))
    with fake_group(args.rank, SPEED_CP):
        for spec in args.cases.split(","):
            comm, layout = spec.split(":")
            x = dense_x[0] if layout in PACKED else dense_x
            step, kernel = rank_step(layer, layout, comm, x, cu, args.rank)
            _profile(step, f"{comm}/{layout} rank {args.rank} kernel {kernel}", args.rows)


if __name__ == "__main__":
    main()

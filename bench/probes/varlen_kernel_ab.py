"""The compiled layer's packed rows with each varlen kernel, side by side in one process: the GPU check's layer
(bench/gpu_speed.py: Llama3-8B attention, bf16, Inductor, S=32K, cp=8, its packed document mix) for every packed
comm x layout the registry runs, compiled with kernel="cudnn_varlen" and "flash_varlen", each timed against
the single-GPU packed layer in the same interleaved run. Settles which varlen provider "auto" should prefer.

    python -m bench.probes.varlen_kernel_ab [--ranks 0 7] [--out f.json]

Prints one row per (comm, layout, rank, kernel): one step at a time, back to back, host ms / GPU busy ms.
"""

from __future__ import annotations

import argparse
import json
import traceback

import torch

from bench.common import back_to_back_ms, host_and_gpu_ms, time_many_ms
from bench.gpu_layer import LLAMA3_8B, build, cu_of, documents
from bench.gpu_speed import DTYPE, SPEED_CP, SPEED_SEQ, _single, fake_group, rank_step, refused_by_design

CASES = [("all_gather", "thd"), ("a2a", "thd"), ("ring", "thd"), ("all_gather", "thd_balanced"),
         ("a2a", "thd_balanced"), ("ring", "thd_zigzag")]  # fmt: skip
KERNELS = ("cudnn_varlen", "flash_varlen")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="*", default=[0, SPEED_CP - 1])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 1024
    layer = build(LLAMA3_8B, DTYPE)
    x = torch.randn(SPEED_SEQ, LLAMA3_8B.hidden, device="cuda", dtype=DTYPE)
    cu = cu_of(documents(SPEED_SEQ, seed=3, unit=2 * SPEED_CP))
    single = _single(layer, x, cu, int((cu[1:] - cu[:-1]).max()))
    single()
    records = []
    for rank in args.ranks:
        with fake_group(rank, SPEED_CP):
            for comm, layout in CASES:
                if refused_by_design(comm, layout) or (rank != 0 and layout != "thd"):
                    continue
                steps = []
                for kernel in KERNELS:
                    try:
                        steps.append((kernel, *rank_step(layer, layout, comm, x, cu, rank, kernel)))
                    except Exception:  # noqa: BLE001  a probe: report and go on
                        traceback.print_exc()
                times = time_many_ms([single] + [s for _, s, _ in steps], iters=10, warmup=3)
                ideal = times[0] / SPEED_CP
                for (kernel, step, resolved), ms in zip(steps, times[1:]):
                    host, gpu = host_and_gpu_ms(step)
                    piped = back_to_back_ms(step)
                    rec = dict(comm=comm, layout=layout, rank=rank, kernel=kernel, resolved=resolved,
                               efficiency=round(ideal / ms, 4), rank_ms=round(ms, 3), single_gpu_ms=round(times[0], 3),
                               back_to_back_efficiency=round(ideal / piped, 4), host_ms=round(host, 3),
                               gpu_ms=round(gpu, 3), gpu_efficiency=round(ideal / gpu, 4))  # fmt: skip
                    records.append(rec)
                    print(f"{comm}/{layout} rank {rank} {kernel}->{resolved}: {ideal / ms:.3f} ({ms:.2f} ms), "
                          f"b2b {ideal / piped:.3f}, host {host:.2f} / GPU {gpu:.2f} ms (GPU eff {ideal / gpu:.3f})",
                          flush=True)  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()

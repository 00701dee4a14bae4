"""Overlap evidence for comm="ring" (issue 18, item 3): one ring attention layer (Llama3-8B attention shape,
zigzag, causal GQA) compiled with Inductor; writes

- <out>/schedule.txt: the collective and attention lines of Inductor's generated `call` functions (forward and
  backward) in program order, with the step each shift belongs to: where each K/V (or dK/dV) shift is issued
  and where it is waited for, relative to the attention kernels that run in between;
- <out>/trace.json: a torch.profiler timeline (CPU ops and CUDA kernels) of a few fwd+bwd steps;
- <out>/summary.txt: the CPU-side op order of one step and the kernels' total times.

    python -m bench.probes.ring_trace --out bench/results/ring_trace              # one GPU, fake group
    torchrun --nproc-per-node=2 -m bench.probes.ring_trace --out bench/results/ring_trace_nccl   # real NCCL
    python -m bench.probes.ring_trace --device cpu --out /tmp/ring_trace          # smoke test, tiny shapes

Alone, the process is rank `--rank` of a fake process group: the collectives allocate their buffers but move
no data and launch no kernel, so the timeline shows the ordering (shift issued, blocks launched, wait), not
transfer time; the generated schedule is the evidence that each transfer is in flight while the previous
chunk's kernels run. Under torchrun the group is NCCL (gloo on CPU) and the timeline shows the NCCL kernels on
their own stream next to the attention kernels.
"""

from __future__ import annotations

import argparse
import collections
import os
import re

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

import cpcompile

EVENTS = ("all_to_all_single", "wait_tensor", "attend_blocks_backward", "attend_blocks", "merge_partial", "add_partial")
LINE = re.compile(r"(" + "|".join(EVENTS) + r")\.default\(")


def attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def schedule_lines(code: str) -> list[str]:
    """The generated lines that issue or wait a collective or run/merge attention, numbered (kernel sources are
    strings in that file and never call these ops)."""
    return [f"{i:5d}: {ln.strip()[:160]}" for i, ln in enumerate(code.splitlines(), 1) if LINE.search(ln)]


ISSUE = re.compile(r"(buf\d+) = torch\.ops\._c10d_functional\.all_to_all_single\.default\(")
WAIT = re.compile(r"_c10d_functional\.wait_tensor\.default\((buf\d+)\)")


def annotate(lines: list[str]) -> list[tuple[str, int, str]]:
    """(what, shifts in flight, line) per schedule line: ISSUE shift n / WAIT shift n (matched by buffer) / run."""
    shift_of, in_flight, out = {}, set(), []
    for ln in lines:
        if m := ISSUE.search(ln):
            shift_of[m.group(1)] = len(shift_of) + 1
            in_flight.add(m.group(1))
            out.append((f"ISSUE shift {shift_of[m.group(1)]}", len(in_flight), ln))
        elif (m := WAIT.search(ln)) and m.group(1) in shift_of:
            in_flight.discard(m.group(1))
            out.append((f"WAIT  shift {shift_of[m.group(1)]}", len(in_flight), ln))
        else:
            out.append(("run", len(in_flight), ln))
    return out


def blocks_without_overlap(code: str) -> list[str]:
    """Attention kernel lines (but the last) that run with no shift in flight: each is a step whose next chunk
    is not moving while it computes."""
    rows = annotate(schedule_lines(code))
    kernels = [(n, ln) for what, n, ln in rows if what == "run" and "attend_blocks" in ln]
    return [ln for n, ln in kernels[:-1] if n == 0]


def setup(args) -> tuple[int, int]:
    if "WORLD_SIZE" in os.environ:  # torchrun: a real group
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        if args.device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        return rank, world
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.cp)
    return args.rank, args.cp


def inputs(args):
    hq, hkv, d = (32, 8, 128) if args.device == "cuda" else (4, 2, 16)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    tokens = args.tokens_per_rank if args.device == "cuda" else 32
    mk = lambda h: torch.randn(1, tokens, h, d, device=args.device, dtype=dtype).transpose(1, 2)  # noqa: E731
    q, k, v = (mk(h).requires_grad_() for h in (hq, hkv, hkv))
    return q, k, v, mk(hq)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/ring_trace")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--cp", type=int, default=4, help="fake group size (ignored under torchrun)")
    p.add_argument("--rank", type=int, default=1, help="fake group rank (ignored under torchrun)")
    p.add_argument("--tokens-per-rank", type=int, default=16384)
    p.add_argument("--steps", type=int, default=3, help="profiled fwd+bwd steps")
    args = p.parse_args(argv)
    rank, world = setup(args)
    os.makedirs(args.out, exist_ok=True)
    q, k, v, dout = inputs(args)
    be = cpcompile.backend(strategy="zigzag", comm="ring", kernel="auto", inner="inductor")
    fn = torch.compile(attention, backend=be, fullgraph=True, dynamic=False)

    def step():
        fn(q, k, v).backward(dout)

    _, codes = run_and_get_code(step)
    if rank == 0 or "WORLD_SIZE" not in os.environ:
        write_schedule(os.path.join(args.out, "schedule.txt"), codes, rank, world, args)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    for _ in range(2):
        step()
    sync()
    acts = [torch.profiler.ProfilerActivity.CPU]
    acts += [torch.profiler.ProfilerActivity.CUDA] if args.device == "cuda" else []
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.steps):
            step()
        sync()
    suffix = "" if "WORLD_SIZE" not in os.environ else f".rank{rank}"
    prof.export_chrome_trace(os.path.join(args.out, f"trace{suffix}.json"))
    write_summary(os.path.join(args.out, f"summary{suffix}.txt"), prof, args)
    print(f"rank {rank}: wrote {args.out}/ (schedule.txt, trace{suffix}.json, summary{suffix}.txt)", flush=True)
    dist.destroy_process_group()


def write_schedule(path: str, codes: list[str], rank: int, world: int, args) -> None:
    group = "torchrun group" if "WORLD_SIZE" in os.environ else "fake process group (no data moves)"
    with open(path, "w") as f:
        f.write(f"comm='ring' zigzag causal GQA, rank {rank} of {world} ({group}), {args.device}, ")
        f.write(f"{args.tokens_per_rank} tokens a rank, torch {torch.__version__}\n")
        f.write("Inductor's generated call(): collectives and attention ops in program order.\n")
        f.write("A shift's bytes travel between its ISSUE and its WAIT; the lines in between run meanwhile.\n")
        for name, code in zip(("forward", "backward"), codes):
            f.write(f"\n=== {name} ===\n")
            for what, n, ln in annotate(schedule_lines(code)):
                f.write(f"{what:<14}| {ln}  [{n} shift(s) in flight]\n")
            bare = blocks_without_overlap(code)
            f.write(f"attention calls (but the last) with no shift in flight: {len(bare)}\n")
        for name, code in zip(("forward", "backward"), codes):
            f.write(f"\n=== {name}: full generated code ===\n{code}\n")


def write_summary(path: str, prof, args) -> None:
    cpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    events = sorted(cpu, key=lambda e: e.time_range.start)
    order = [e.name for e in events if any(n in e.name for n in EVENTS) and "::" in e.name]
    per_step = len(order) // max(args.steps, 1)
    kernels = collections.Counter()
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.key] += e.device_time_total
    with open(path, "w") as f:
        f.write("CPU op order of one fwd+bwd step (issue -> blocks -> wait):\n")
        f.write("\n".join(f"  {n}" for n in order[:per_step]) + "\n")
        if kernels:
            f.write("\nCUDA kernels, total us over the profiled steps:\n")
            for key, us in kernels.most_common(15):
                f.write(f"  {us:12.0f}  {key[:120]}\n")
        f.write("\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20) + "\n")


if __name__ == "__main__":
    main()

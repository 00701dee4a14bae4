"""Memory benchmark (issue 18): per-rank peak allocated memory of one training step (forward + backward) of an
N-layer Llama3-8B-shaped stack compiled with cpcompile, per comm, against the same stack on one GPU.

    python -m bench.memory --out bench/results/memory.json --quick          # ~300 s on one H200
    python -m bench.memory --out bench/results/memory.json --append --checkpoint --mlp --seqs 128K,256K --cps 8
    python -m bench.memory --out bench/results/memory.json --append --no-baseline --layers 1 --checkpoint --mlp \
        --seqs 1024K --cps 8                                               # one layer at 128K tokens a rank
    python -m bench.memory --device cpu --out /tmp/memory.json              # CPU smoke test, tiny shapes

One rank runs, as rank `--rank` of a fake process group (torch's `fake` backend): every collective allocates
its output buffer but moves no data, so the rank's allocations, and so its peak, are those of a real rank,
while one GPU never holds more than one rank. The single-GPU baseline is the same stack over the full sequence
compiled with the inner compiler alone. Per case: one step compiles, then the peak of a second step is read
(grads already allocated, so peak - static is activations + transients). `target_bytes` = static +
single-GPU activations / cp + the comm's allowance (`allowance`); records are rewritten after every case, so
an interrupted run keeps what it measured. `--budget-s` stops starting cases that would not finish in time
(recorded as skipped, like baselines that would not fit on the device).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import cpcompile
from bench import memory_stack as ms

COMMS = {  # name -> (comm, regather)
    "ring": ("ring", False),
    "all_gather+regather": ("all_gather", True),
    "all_gather": ("all_gather", False),
    "a2a": ("a2a", False),
}
S_ORDER = (128, 256, 64, 32)  # the most telling lengths (K tokens) first, so a budget cut drops the least


def allowance(name: str, seq: int, cp: int, shape: ms.Shape) -> tuple[int, str]:
    """(bytes, rule) a rank may hold beyond single-GPU activations / cp (issue 18's targets)."""
    chunk = seq // cp * ms.kv_bytes_per_token(shape)
    if name == "ring":
        return 2 * chunk, "2 K/V chunks (S/cp tokens each)"
    if name == "a2a":
        exchanged = seq // cp * 2 * 2 * (shape.hq + shape.hkv) * shape.head_dim
        return exchanged, "one layer's exchanged q/k/v/out"
    rule = "one layer's gathered K/V" + ("" if name.endswith("regather") else " (all layers' are kept: expected over)")
    return seq * ms.kv_bytes_per_token(shape), rule


@contextlib.contextmanager
def fake_group(rank: int, world: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(step, tokens: int, args) -> dict:
    """Compile (first step), then the static bytes before and the peak during a second step."""
    x = torch.randn(1, tokens, args.shape.hidden, device=args.device, dtype=args.dtype, requires_grad=True)
    dout = torch.randn_like(x)
    t0 = time.perf_counter()
    step(x, dout)
    _sync(args.device)
    first = time.perf_counter() - t0
    gc.collect()
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    static = torch.cuda.memory_allocated() if cuda else None
    t0 = time.perf_counter()
    step(x, dout)
    _sync(args.device)
    step_s = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if cuda else None
    reserved = torch.cuda.max_memory_reserved() if cuda else None
    return {
        "peak_bytes": peak,
        "static_bytes": static,
        "reserved_peak_bytes": reserved,
        "compile_s": first - step_s,
        "step_s": step_s,
    }


def _free(device: str) -> None:
    torch._dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def run_case(blocks, seq: int, cp: int, name: str | None, args) -> dict:
    """One measured step: the single-GPU stack (name None) or rank `args.rank` of cp under comm `name`."""
    _free(args.device)
    try:
        if name is None:
            return measure(ms.compiled_step(blocks, args.inner, args.checkpoint), seq, args)
        comm, regather = COMMS[name]
        with fake_group(args.rank, cp):
            be = cpcompile.backend(strategy=args.layout, comm=comm, inner=args.inner, regather=regather)
            return measure(ms.compiled_step(blocks, be, args.checkpoint), seq // cp, args)
    except torch.cuda.OutOfMemoryError as e:
        return {"skipped": f"out of memory: {str(e).splitlines()[0][:200]}"}
    finally:
        _free(args.device)


def single_fits(seq: int, args) -> tuple[bool, str]:
    """Whether the single-GPU baseline plausibly fits (estimate: weights, grads, saved activations, transients)."""
    if args.device != "cuda":
        return True, ""
    sh, n = args.shape, args.layers
    need = 2 * n * ms.param_bytes(sh, args.mlp) + seq * (
        n * ms.saved_bytes_per_token(sh, args.mlp, args.checkpoint) + ms.block_transient_per_token(sh, args.mlp)
    )
    have = 0.9 * torch.cuda.get_device_properties(0).total_memory
    return need <= have, f"single-GPU baseline estimated at {need / 2**30:.0f} GiB > {have / 2**30:.0f} GiB"


def cases(args) -> list[tuple[int, int]]:
    """(S, cp) pairs, the largest cp first and the most telling lengths first, so a budget cut drops the least."""
    order = {s: i for i, s in enumerate(S_ORDER)}
    seqs = sorted(args.seqs, key=lambda s: (order.get(s // 1024, len(order)), s))
    return [(s, cp) for cp in sorted(args.cps, reverse=True) for s in seqs]


class Clock:
    """Predicts a case's seconds from those seen: a compile, plus two steps whose attention scales as S^2/cp."""

    def __init__(self, budget_s: float) -> None:
        self.t0, self.budget, self.compile, self.per_unit = time.perf_counter(), budget_s, [], []

    def note(self, res: dict, seq: int, cp: int) -> None:
        if "compile_s" in res:
            self.compile.append(res["compile_s"])
            self.per_unit.append(res["step_s"] / (seq * seq / cp))

    def fits(self, seq: int, cp: int) -> bool:
        if not self.compile:
            return time.perf_counter() - self.t0 < self.budget
        guess = statistics.median(self.compile) + 2 * max(self.per_unit) * seq * seq / cp
        return time.perf_counter() - self.t0 + guess <= self.budget


def sweep(args) -> list[dict]:
    blocks = ms.build(args.shape, args.layers, args.mlp, args.device, args.dtype)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    common = {"layout": args.layout, "layers": args.layers, "mlp": args.mlp, "checkpoint": args.checkpoint}
    common |= {"rank": args.rank, "inner": args.inner, "device": device, "torch": torch.__version__}
    clock, records, singles = Clock(args.budget_s), _existing(args), {}
    for seq, cp in cases(args):
        if seq not in singles:
            fits, why = single_fits(seq, args)
            if args.no_baseline:
                singles[seq] = {"baseline": "not run (--no-baseline)"}
            elif not fits:
                singles[seq] = {"skipped": why}
            elif not clock.fits(seq, 1):
                singles[seq] = {"skipped": f"time budget ({args.budget_s:.0f} s)"}
            else:
                singles[seq] = run_case(blocks, seq, 1, None, args)
                clock.note(singles[seq], seq, 1)
            print(f"S={seq} single GPU: {singles[seq]}", flush=True)
        single = singles[seq]
        for name in args.comms:
            rec = {**common, "name": name, "comm": COMMS[name][0], "regather": COMMS[name][1], "S": seq, "cp": cp}
            if "skipped" in single:
                res = {"skipped": f"no single-GPU baseline: {single['skipped']}"}
            elif not clock.fits(seq, cp):
                res = {"skipped": f"time budget ({args.budget_s:.0f} s)"}
            else:
                res = run_case(blocks, seq, cp, name, args)
                clock.note(res, seq, cp)
            rec |= res
            rec |= targets(rec, single, args)  # after res: the targets read the measured peak
            records.append(rec)
            print(summary(rec), flush=True)
            write(args.out, records)
    return records


def targets(rec: dict, single: dict, args) -> dict:
    extra, rule = allowance(rec["name"], rec["S"], rec["cp"], args.shape)
    out = {"single_gpu_peak_bytes": single.get("peak_bytes"), "single_gpu_static_bytes": single.get("static_bytes")}
    out |= {"allowance_bytes": extra, "allowance_rule": rule, "target_bytes": None, "meets_target": None}
    if rec.get("peak_bytes") is None or single.get("peak_bytes") is None:
        return out
    single_act = single["peak_bytes"] - single["static_bytes"]
    out["target_bytes"] = rec["static_bytes"] + single_act // rec["cp"] + extra
    out["activation_bytes"] = rec["peak_bytes"] - rec["static_bytes"]
    out["activations_over_single_per_cp"] = out["activation_bytes"] / (single_act / rec["cp"])
    out["meets_target"] = rec["peak_bytes"] <= out["target_bytes"]
    return out


def summary(rec: dict) -> str:
    head = f"S={rec['S']} cp={rec['cp']} {rec['name']:<20}"
    if "skipped" in rec:
        return f"{head} skipped: {rec['skipped']}"
    if rec["peak_bytes"] is None:
        return f"{head} ran (no allocator stats on {rec['device']}), compile {rec['compile_s']:.1f} s"
    gib = lambda b: f"{b / 2**30:.2f}" if b is not None else "-"  # noqa: E731
    return (
        f"{head} peak {gib(rec['peak_bytes'])} GiB (static {gib(rec['static_bytes'])}), target "
        f"{gib(rec['target_bytes'])}, single GPU {gib(rec['single_gpu_peak_bytes'])}, meets={rec['meets_target']}, "
        f"compile {rec['compile_s']:.1f} s, step {rec['step_s']:.2f} s"
    )


def _existing(args) -> list[dict]:
    """The records already in --out when --append is given (a second sweep adds to the first)."""
    if not args.append or not os.path.exists(args.out):
        return []
    with open(args.out) as f:
        return json.load(f)


def write(path: str, records: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump(records, f, indent=1)


def _lengths(text: str) -> list[int]:
    return [int(t[:-1]) * 1024 if t.upper().endswith("K") else int(t) for t in text.split(",")]


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/memory.json")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: tiny shapes, no peak numbers")
    p.add_argument("--seqs", default="32K,64K,128K,256K", help="global sequence lengths (tokens, K = 1024)")
    p.add_argument("--cps", default="2,4,8")
    p.add_argument("--comms", default=",".join(COMMS), help=f"subset of {','.join(COMMS)}")
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "flat"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--mlp", action="store_true", help="blocks with the SwiGLU MLP (default: attention + projections)")
    p.add_argument("--checkpoint", action="store_true", help="per-block activation checkpointing")
    p.add_argument("--rank", type=int, default=0, help="the rank of the fake group that runs")
    p.add_argument("--inner", default="inductor", help="inner compiler (inductor, aot_eager)")
    p.add_argument("--budget-s", type=float, default=1e9, help="start no case predicted to end past this")
    p.add_argument("--append", action="store_true", help="add to the records already in --out")
    p.add_argument("--no-baseline", action="store_true", help="measure the cp ranks only (e.g. S=1M, cp=8)")
    p.add_argument("--quick", action="store_true", help="S 128K,256K at cp 8 then 4, within --budget-s 300")
    args = p.parse_args(argv)
    if args.quick:
        args.seqs, args.cps, args.budget_s = "128K,256K", "8,4", min(args.budget_s, 300.0)
    args.seqs, args.cps, args.comms = _lengths(args.seqs), _lengths(args.cps), args.comms.split(",")
    unknown = set(args.comms) - set(COMMS)
    if unknown:
        p.error(f"unknown comms {sorted(unknown)}; choose from {list(COMMS)}")
    args.shape = ms.LLAMA3_8B if args.device == "cuda" else ms.TINY
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    if args.device == "cpu" and args.seqs == _lengths("32K,64K,128K,256K"):
        args.seqs, args.cps, args.layers = [64], [2], min(args.layers, 2)
    return args


def main(argv=None) -> list[dict]:
    return sweep(parse(argv))


if __name__ == "__main__":
    main()

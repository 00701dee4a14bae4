"""What the cpcompile pass adds to a compile: TinyLlama (2 to 32 layers) compiled cold with the cpcompile
backend (inner Inductor) and with plain Inductor, in one process, on CPU (--device cuda: a GPU), as rank 0 of a
fake process group.

A compile is timed as the first forward + backward of a fresh model (Dynamo, the pass, aot_autograd, Inductor's
forward and backward codegen and C++ builds; the run itself is milliseconds), after `torch._dynamo.reset()`
with Inductor's caches off (TORCHINDUCTOR_FORCE_DISABLE_CACHES=1, set here before torch is imported). The clock
is CPU time (user + system of this process and of the C++ compiler runs, which compile_threads=1 makes reaped
subprocesses): the machine this was written for is shared, and wall time there mostly measures the other
tenants (wall seconds are recorded too). Both
backends compile the same model on the same local shard; they differ only in the attention nodes, which the
pass rewrites into CP regions. The two backends alternate within each repeat so that the shared machine's
noise hits both, one warm-up compile of each runs first (imports, DTensor's and Inductor's one-time set-up),
and every row reports the median over the repeats and the spread (min, max). The pass's own time (its steps
find, plan, agree_ranks, rewrite, guard) is timed inside the same compile.

    python -m bench.compile_time --out bench/results/compile_time.json [--layers 2 4 8 16 32] [--repeats 3]
        [--device cpu|cuda]
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # before torch reads its config
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # C++ builds as reaped subprocesses: their CPU time counts

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch._inductor import metrics  # noqa: E402

import cpcompile  # noqa: E402
from cpcompile import passes  # noqa: E402
from cpcompile.testing.model import TinyConfig, TinyLlama  # noqa: E402

WORLD, SEQ, BATCH = 2, 256, 2
"""Rank 0 of 2, a 256-token global sequence (128 local tokens), batch 2: compile time hardly depends on it."""


@contextlib.contextmanager
def fake_group(rank: int, world: int):
    """The default group as torch's fake backend (no peers, collectives do nothing) for the block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def timed_steps(spent: dict[str, float]):
    """Time every pass step (passes.PASSES) into `spent` while the block runs."""
    steps = passes.PASSES

    def timed(step):
        def run(gm, state):
            t0 = time.process_time()  # CPU time, like the compile's clock (the pass starts no subprocess)
            try:
                step(gm, state)
            finally:
                spent[step.__name__] = spent.get(step.__name__, 0.0) + time.process_time() - t0

        return run

    passes.PASSES = tuple(timed(s) for s in steps)
    try:
        yield
    finally:
        passes.PASSES = steps


DEVICE = "cpu"
"""Where the model runs (--device): "cpu" (fp32, C++ kernels) or "cuda" (bf16, Triton kernels)."""


def compile_once(layers: int, backend: str) -> dict:
    """One cold compile (first forward + backward) of a fresh TinyLlama: seconds, sites, the pass's steps."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    model = TinyLlama(TinyConfig(layers=layers)).to(DEVICE, dtype)
    local = SEQ // WORLD
    ids = torch.randint(0, model.cfg.vocab, (BATCH, local), device=DEVICE)
    pos = torch.arange(local, device=DEVICE).expand(BATCH, local)
    spent: dict[str, float] = {}
    be = cpcompile.backend(strategy="zigzag", inner="inductor") if backend == "cpcompile" else "inductor"
    metrics.reset()
    with timed_steps(spent):
        t0, c0 = time.perf_counter(), _cpu_s()
        torch.compile(model, backend=be, fullgraph=True)(ids, pos).float().sum().backward()
        wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
    sites = len(be.plans) if backend == "cpcompile" else 0
    return {"cpu_s": cpu, "wall_s": wall, "sites": sites, "steps": spent, "kernels": metrics.generated_kernel_count}


def _cpu_s() -> float:
    """CPU seconds of this process and its reaped children (the C++ compiler runs), user + system."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def measure(layers: int, repeats: int) -> dict:
    """Interleaved cold compiles of both backends; the row of medians (CPU seconds) and spreads."""
    runs: dict[str, list[dict]] = {"inductor": [], "cpcompile": []}
    for _ in range(repeats):
        for backend in runs:
            runs[backend].append(compile_once(layers, backend))
    ind, cpc = ([r["cpu_s"] for r in runs[b]] for b in runs)
    passes_s = [sum(r["steps"].values()) for r in runs["cpcompile"]]
    pairs = [c / i - 1 for c, i in zip(cpc, ind)]
    inductor_s, cpcompile_s, pass_s = (statistics.median(x) for x in (ind, cpc, passes_s))
    sites = runs["cpcompile"][0]["sites"]
    steps = [r["steps"] for r in runs["cpcompile"]]
    return {
        "layers": layers,
        "sites": sites,
        "inductor_s": inductor_s,
        "cpcompile_s": cpcompile_s,
        "overhead_frac": cpcompile_s / inductor_s - 1,
        "pass_s": pass_s,
        "pass_frac": pass_s / inductor_s,
        "pass_s_per_site": pass_s / sites if sites else None,
        "steps_s": {k: statistics.median(s[k] for s in steps) for k in steps[0]},
        "kernels": {b: runs[b][0]["kernels"] for b in runs},
        "inductor_wall_s": statistics.median(r["wall_s"] for r in runs["inductor"]),
        "cpcompile_wall_s": statistics.median(r["wall_s"] for r in runs["cpcompile"]),
        "inductor_runs_s": ind,
        "cpcompile_runs_s": cpc,
        "pass_runs_s": passes_s,
        "overhead_frac_runs": pairs,
        "spread": {"inductor_s": _spread(ind), "cpcompile_s": _spread(cpc), "overhead_frac": _spread(pairs)},
        "repeats": repeats,
        "clock": "cpu",
    }


def _machine() -> dict:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else None
    return {
        "device": DEVICE,
        "gpu": gpu,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "commit": commit,
        "world": WORLD,
        "strategy": "zigzag",
        "comm": "all_gather",
        "measured_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", nargs="*", type=int, default=[2, 4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the records here (JSON)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: bf16, Triton kernels")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    machine = _machine()
    print(f"torch {machine['torch']}, {machine['cpu']}, {machine['threads']} threads, caches off")
    records = []
    with fake_group(0, WORLD):
        for backend in ("inductor", "cpcompile"):  # warm-up: one-time set-up out of the first row
            compile_once(2, backend)
        print("layers sites  inductor s  cpcompile s  overhead   pass s  pass/inductor  (min..max overhead)")
        for layers in args.layers:
            rec = {**measure(layers, args.repeats), **machine}
            records.append(rec)
            lo, hi = rec["spread"]["overhead_frac"]["min"], rec["spread"]["overhead_frac"]["max"]
            print(
                f"{layers:6} {rec['sites']:5} {rec['inductor_s']:11.2f} {rec['cpcompile_s']:12.2f} "
                f"{rec['overhead_frac']:8.1%} {rec['pass_s']:8.3f} {rec['pass_frac']:14.2%}  ({lo:.1%}..{hi:.1%})",
                flush=True,
            )
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()

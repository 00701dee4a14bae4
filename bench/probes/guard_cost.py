"""What the token guard adds to compiling TinyLlama: its own time against the whole compile (CPU, one process).

Compiles TinyLlama (2 and 8 layers) with cpcompile as rank 0 of a fake 2-rank group (no peers needed), runs the
first forward and backward (Dynamo, the pass, aot_autograd and the inner compiler, backward compiled lazily), and
times the guard step separately. Inductor's caches are off, so every run compiles from scratch.

    python -m bench.probes.guard_cost                 # inductor and aot_eager, 2 and 8 layers, one compile each
    python -m bench.probes.guard_cost --inner aot_eager --layers 8 --repeats 3

Rows run in one process, so only the first row pays the one-time warm-up (imports, DTensor's strategy tables);
run one row per process to see that cost on every row.
"""

from __future__ import annotations

import argparse
import time

import torch

import cpcompile
from cpcompile import passes
from cpcompile.testing.model import TinyConfig, TinyLlama


def compile_once(inner: str, layers: int) -> tuple[float, float]:
    """(seconds of the first forward + backward, seconds spent in the guard step) for one fresh compile."""
    from tests.support.fake_pg import fake_group

    spent = [0.0]
    steps = list(passes.PASSES)
    guard = steps[-1]

    def timed(gm, state):
        t0 = time.perf_counter()
        try:
            guard(gm, state)
        finally:
            spent[0] += time.perf_counter() - t0

    passes.PASSES = (*steps[:-1], timed)
    try:
        with fake_group(0, 2):
            torch.manual_seed(0)
            model = TinyLlama(TinyConfig(layers=layers))
            ids, pos = torch.randint(0, 128, (2, 64)), torch.arange(64).expand(2, 64)
            be = cpcompile.backend(strategy="zigzag", inner=inner)
            t0 = time.perf_counter()
            torch.compile(model, backend=be, fullgraph=True)(ids, pos).sum().backward()
            total = time.perf_counter() - t0
    finally:
        passes.PASSES = tuple(steps)
    return total, spent[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner", nargs="*", default=["inductor", "aot_eager"])
    parser.add_argument("--layers", nargs="*", type=int, default=[2, 8])
    parser.add_argument("--repeats", type=int, default=1, help="compiles per row; the first is cold (a fresh process)")
    args = parser.parse_args()
    torch._inductor.config.force_disable_caches = True
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("inner      layers  run  compile s  guard s  guard %")
    for inner in args.inner:
        for layers in args.layers:
            for run in range(args.repeats):
                total, guard = compile_once(inner, layers)
                print(f"{inner:10} {layers:6} {run:4} {total:10.2f} {guard:8.3f} {100 * guard / total:7.1f}")


if __name__ == "__main__":
    main()

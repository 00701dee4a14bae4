"""Is the compiled layer's small-shard gap host time? One CP rank of the GPU check's layer (Llama3-8B attention,
bf16, fwd+bwd, S=32K, cp=8: 4K tokens a rank, fake process group) compiled twice, with torch.compile's default mode
and with mode="reduce-overhead" (Inductor's CUDA graphs: the step's launches replayed from one graph), each against
the single-GPU layer compiled the same way / cp, side by side in one run. Prints a row per (comm, layout): the two
efficiencies, and the CUDA-graph skips Inductor counted (a graph it did not capture runs as before). Every comm, dense
and packed; on the fake process group or on the stand-in link group (--group link: the collectives' sleeps and
stream waits captured too).

    python -m bench.probes.cudagraph_layer [--rows ring:zigzag,...] [--modes default,reduce-overhead]
        [--group fake|link] [--out f.json] [--trace]
"""

from __future__ import annotations

import argparse
import json
import traceback

import torch
import torch._inductor.config as inductor_config

import cpcompile
from bench.common import time_many_ms
from bench.gpu_layer import LLAMA3_8B, PACKED, build, cu_of, documents, layer_inputs
from bench.gpu_speed import DTYPE, SPEED_CP, SPEED_SEQ, fake_group
from cpcompile.testing.link_group import link_group
from cpcompile.testing.link_model import Topology

ROWS = (  # every comm, dense and packed; the rows furthest from the target first
    ("ring", "zigzag"),
    ("a2a", "zigzag"),
    ("ring", "thd_zigzag"),
    ("all_gather", "zigzag"),
    ("all_gather", "thd_balanced"),
    ("all_gather", "thd_zigzag"),
    ("a2a", "thd"),
    ("selective", "thd_balanced"),
)
MODES = ("default", "reduce-overhead")


def _step(fn, x, extra, mode, params):
    x = x.detach().requires_grad_()
    dout = torch.randn(x.shape, device="cuda", dtype=DTYPE)

    def run():
        # as a training loop's zero_grad(set_to_none=True): accumulating into a grad that CUDA graphs own reads
        # memory the next replay overwrote ("accessing tensor output of CUDAGraphs that has been overwritten")
        for t in (x, *params):
            t.grad = None
        if mode != "default":
            torch.compiler.cudagraph_mark_step_begin()
        fn(x, *extra).backward(dout)

    return run


def _skips() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["inductor"].get(k, 0) for k in ("cudagraph_skips",))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--rows", default=",".join(f"{c}:{lay}" for c, lay in ROWS), help="comm:layout,...")
    parser.add_argument("--modes", default=",".join(MODES), help="default and/or reduce-overhead")
    parser.add_argument("--group", default="fake", choices=("fake", "link"),
                        help="fake: collectives move nothing (compute only); link: the stand-in link group "
                        "(cpcompile/testing/link_group.py), each collective a sleep on a side stream")  # fmt: skip
    parser.add_argument("--trace", action="store_true", help="a failing row prints its traceback's last lines, and "
                        "CUDA graph trees record where each of their tensors was allocated")  # fmt: skip
    args = parser.parse_args()
    if args.trace:
        inductor_config.triton.cudagraph_trees_history_recording = True
    rows = [tuple(r.split(":")) for r in args.rows.split(",")]
    modes = args.modes.split(",")
    torch._logging.set_logs(perf_hints=True)  # Inductor's "skipping cudagraphs due to ..." lines
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 1024
    layer = build(LLAMA3_8B, DTYPE)
    params = list(layer.parameters())
    dense_x = torch.randn(1, SPEED_SEQ, LLAMA3_8B.hidden, device="cuda", dtype=DTYPE)
    cu = cu_of(documents(SPEED_SEQ, seed=3, unit=2 * SPEED_CP))
    longest = int((cu[1:] - cu[:-1]).max())
    single = {}
    for mode in modes:
        fn = torch.compile(layer, fullgraph=True, dynamic=False, mode=None if mode == "default" else mode)
        single[("dense", mode)] = _step(fn, dense_x, (), mode, params)
        single[("packed", mode)] = _step(fn, dense_x[0], (cu.cuda(), longest), mode, params)
    records = []
    group = fake_group(0, SPEED_CP) if args.group == "fake" else link_group(0, SPEED_CP, Topology(SPEED_CP))
    with group:
        for comm, layout in rows:
            kind = "packed" if layout in PACKED else "dense"
            x = dense_x[0] if kind == "packed" else dense_x
            local, model_cu, longest_local = layer_inputs(layout, x, cu)
            extra = () if model_cu is None else (model_cu, longest_local)
            steps, skips = {}, {}
            for mode in modes:
                be = cpcompile.backend(strategy=layout, comm=comm, kernel="auto", inner="inductor")
                try:
                    before = _skips()
                    fn = torch.compile(layer, backend=be, fullgraph=True, dynamic=False,
                                       mode=None if mode == "default" else mode)  # fmt: skip
                    steps[mode] = _step(fn, local, extra, mode, params)
                    for _ in range(3):
                        steps[mode]()
                    skips[mode] = _skips() - before
                except Exception as e:  # noqa: BLE001  (a row that fails prints why and the others go on)
                    steps.pop(mode, None)
                    print(f"{comm}/{layout} {mode}: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
                    if args.trace:
                        print("".join(traceback.format_exc().splitlines(True)[-60:]), flush=True)
            for mode, step in steps.items():
                ref_ms, rank_ms = time_many_ms([single[(kind, mode)], step], iters=10, warmup=3)
                eff = ref_ms / SPEED_CP / rank_ms
                records.append(dict(layout=layout, comm=comm, S=SPEED_SEQ, cp=SPEED_CP, rank=0, mode=mode,
                                    group=args.group,
                                    efficiency=round(eff, 4), rank_ms=round(rank_ms, 3), single_gpu_ms=round(ref_ms, 3),
                                    cudagraph_skips=skips[mode]))  # fmt: skip
                print(f"{comm}/{layout} {mode} ({args.group} group): {eff:.3f} "
                      f"({rank_ms:.2f} ms vs {ref_ms:.2f} / {SPEED_CP}), "
                      f"cudagraph skips {skips[mode]}", flush=True)  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()

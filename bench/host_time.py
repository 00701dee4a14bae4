"""Host time against GPU time of one CP rank's compiled layer step (the GPU check's layer, fake process group).

For each comm x layout case, rank 0 (and the last rank for thd), four numbers a step:
- host_ms: CPU time from the call to the return of backward, with the GPU held busy by a long sleep queued first,
  so nothing the host does waits on the GPU (a host sync inside the step would show here as the sleep's length);
- gpu_ms: the step's GPU time after that head start (CUDA events), i.e. the kernels back to back with no gaps
  left by the host: the GPU busy time;
- host_ratio = host_ms / gpu_ms: above 1 the host, not the GPU, sets the pace of a step;
- step_ms: one step at a time with a ~1 ms head start (bench.common.time_many_ms, the GPU check's speed rows), and
  pipelined_ms: steps back to back, timed over many (what a training loop sees when the host keeps up), each as an
  efficiency against the single-GPU layer / cp timed in the same process.

    python -m bench.host_time [--cases all_gather:zigzag,a2a:zigzag,ring:zigzag] [--ranks 0,7] [--out results.json]
    python -m bench.host_time --tree old=path --tree new=path   # the same cases for two cpcompile trees, A B A B
    python -m bench.host_time --seq 131072 --cases all_gather:zigzag,a2a:zigzag,ring:zigzag   # 16K tokens a rank

A tree is a directory holding a `cpcompile/` package; `bench/` is always this checkout's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

OPTIONS = {"deferred": ("deferred_merge", True), "regather": ("regather", True)}
"""A case's third field, comm:layout:option, names a backend option (e.g. ring:zigzag:deferred)."""

DEFAULT = "all_gather:zigzag,a2a:zigzag,ring:zigzag,all_gather:thd_zigzag,a2a:thd,ring:thd_zigzag"


def measure(cases: list[tuple[str, str]], ranks: tuple[int, ...] | None = None, seq: int | None = None) -> list[dict]:
    """One record a (case, rank): the numbers of the module docstring. `ranks`: these ranks for every case
    (default: rank 0, and the last rank too for thd); `seq`: the global sequence length (default: the GPU check's,
    SPEED_SEQ), split over SPEED_CP ranks."""
    from bench.common import back_to_back_ms, host_and_gpu_ms, time_many_ms
    from bench.gpu_layer import LLAMA3_8B, PACKED, build, cu_of, documents
    from bench.gpu_speed import DTYPE, SPEED_CP, SPEED_SEQ, _single, fake_group, rank_step, refused_by_design

    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 1024
    seq = seq or SPEED_SEQ
    layer = build(LLAMA3_8B, DTYPE)
    dense_x = torch.randn(1, seq, LLAMA3_8B.hidden, device="cuda", dtype=DTYPE)
    cu = cu_of(documents(seq, seed=3, unit=2 * SPEED_CP))
    longest = int((cu[1:] - cu[:-1]).max())
    single = {"dense": _single(layer, dense_x, None, 0), "packed": _single(layer, dense_x[0], cu, longest)}
    ref = {}
    for kind, fn in single.items():
        ref[kind] = (time_many_ms([fn], iters=7, warmup=2)[0], back_to_back_ms(fn))
    records = []
    for comm, layout, *opts in cases:
        options = {OPTIONS[o][0]: OPTIONS[o][1] for o in opts}
        if refused_by_design(comm, layout):
            continue
        kind = "packed" if layout in PACKED else "dense"
        x = dense_x[0] if kind == "packed" else dense_x
        for rank in ranks or ((0, SPEED_CP - 1) if layout == "thd" else (0,)):
            with fake_group(rank, SPEED_CP):
                try:
                    step, kernel = rank_step(layer, layout, comm, x, cu, rank, **options)
                except TypeError as e:  # an older tree without the option: its row is left out, said so
                    print(f"{comm}/{layout} {options}: not in this tree ({e})", flush=True)
                    continue
                for _ in range(3):
                    step()
                host, gpu = host_and_gpu_ms(step)
                one, ref_one = time_many_ms([step, single[kind]], iters=7, warmup=1)
                piped = back_to_back_ms(step)
            ideal_one, ideal_piped = ref_one / SPEED_CP, ref[kind][1] / SPEED_CP
            records.append(
                dict(comm=comm, layout=layout, options=sorted(opts), rank=rank, kernel=kernel, S=seq, cp=SPEED_CP,
                     host_ms=round(host, 3), gpu_ms=round(gpu, 3), host_ratio=round(host / gpu, 3),
                     step_ms=round(one, 3), step_efficiency=round(ideal_one / one, 4),
                     pipelined_ms=round(piped, 3), pipelined_efficiency=round(ideal_piped / piped, 4),
                     gpu_efficiency=round(ideal_one / gpu, 4), single_gpu_ms=round(ref_one, 3))
            )  # fmt: skip
            r = records[-1]
            name = ":".join([f"{comm}/{layout}", *opts])
            print(f"{name} rank {rank} ({kernel}): host {host:.2f} ms, GPU {gpu:.2f} ms, ratio "
                  f"{r['host_ratio']:.2f}; one step {r['step_efficiency']:.3f}, back to back "
                  f"{r['pipelined_efficiency']:.3f}, GPU-only {r['gpu_efficiency']:.3f}", flush=True)  # fmt: skip
    return records


def _run_tree(root: str, spec: str, ranks: str | None, seq: int | None) -> dict:
    env = dict(os.environ)
    here = os.path.abspath(os.getcwd())  # this checkout's bench/, after the tree so its cpcompile loses
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(root), here, env.get("PYTHONPATH", "")])
    command = [
        sys.executable,
        "-m",
        "bench.host_time",
        "--child",
        "--cases",
        spec,
        *(["--ranks", ranks] if ranks else []),
        *(["--seq", str(seq)] if seq else []),
    ]
    with tempfile.TemporaryDirectory() as cwd:  # `python -m` puts its cwd first on sys.path: not the checkout
        out = subprocess.run(
            command,
            env=env, cwd=cwd, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
    sys.stderr.write(out.stderr[-2000:] if out.returncode else "")
    for line in out.stdout.splitlines():
        if line.startswith("HOST-RESULT "):
            return json.loads(line[len("HOST-RESULT ") :])
        print(f"  {line}", flush=True)
    raise RuntimeError(f"tree {root}: no result (rc {out.returncode}):\n{out.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=DEFAULT, help="comm:layout[:option],... (option: deferred, regather)")
    ap.add_argument("--tree", action="append", default=[], help="label=root (a directory holding cpcompile/)")
    ap.add_argument("--reps", type=int, default=1, help="rounds of A B ... per tree")
    ap.add_argument("--out", help="write the records here (JSON)")
    ap.add_argument("--ranks", help="ranks to time in every case, e.g. 0,7 (default: 0, and the last for thd)")
    ap.add_argument("--seq", type=int, help="global sequence length (default: the GPU check's, 32768)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cases = [tuple(c.split(":")) for c in args.cases.split(",")]
    if args.child or not args.tree:
        import cpcompile

        ranks = tuple(int(r) for r in args.ranks.split(",")) if args.ranks else None
        records = measure(cases, ranks, args.seq)
        where = os.path.dirname(cpcompile.__file__)
        print("HOST-RESULT " + json.dumps({"cpcompile": where, "records": records}), flush=True)
        if args.out and not args.child:
            with open(args.out, "w") as f:
                json.dump({"torch": torch.__version__, "records": records}, f, indent=1)
        return 0
    results = []
    for rep in range(args.reps):
        for label, root in (t.split("=", 1) for t in args.tree):
            print(f"== {label} ({root}) round {rep + 1}", flush=True)
            got = _run_tree(root, args.cases, args.ranks, args.seq)
            results.append({"label": label, "round": rep + 1, **got})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "runs": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Is a change in the GPU check's speed rows the code or the machine? The compiled layer's rank-0 rows (bench.gpu_speed)
timed for two cpcompile trees in one device call, alternating A, B, A, B in fresh processes (so host drift hits both
alike), each row against the single-GPU layer timed in the same process.

    python -m bench.probes.ab_trees --tree old=path/to/old_root --tree new=. [--reps 2] [--out ab.json]

A tree is a directory holding a `cpcompile/` package; `bench/` is always this checkout's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CASES = (("all_gather", "zigzag"), ("a2a", "zigzag"), ("ring", "zigzag"), ("ring", "thd_zigzag"))


def _child(cases: list[tuple[str, str]]) -> None:
    import cpcompile
    from bench.gpu_speed import layer_speeds

    records: list[dict] = []
    layer_speeds(cases, records=records)
    print("AB-RESULT " + json.dumps({"cpcompile": os.path.dirname(cpcompile.__file__), "records": records}))


def _run_tree(root: str, cases: list[tuple[str, str]]) -> dict:
    env = dict(os.environ)
    here = os.path.abspath(os.getcwd())  # this checkout (bench/), after the tree so its cpcompile loses
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(root), here, env.get("PYTHONPATH", "")])
    spec = ",".join(f"{c}/{lay}" for c, lay in cases)
    with tempfile.TemporaryDirectory() as cwd:  # `python -m` puts its cwd first on sys.path: not the checkout
        out = subprocess.run(
            [sys.executable, "-m", "bench.probes.ab_trees", "--child", spec],
            env=env, cwd=cwd, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
    for line in out.stdout.splitlines():
        if line.startswith("AB-RESULT "):
            return json.loads(line[len("AB-RESULT ") :])
    raise RuntimeError(f"tree {root}: no result (rc {out.returncode}):\n{out.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", action="append", default=[], help="label=root (a directory holding cpcompile/)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--cases", default=",".join(f"{c}/{lay}" for c, lay in CASES))
    ap.add_argument("--out")
    ap.add_argument("--child")
    args = ap.parse_args(argv)
    if args.child:
        _child([tuple(c.split("/")) for c in args.child.split(",")])
        return 0
    trees = [t.split("=", 1) for t in args.tree]
    cases = [tuple(c.split("/")) for c in args.cases.split(",")]
    rows = []
    for rep in range(args.reps):
        for label, root in trees:
            t0 = time.perf_counter()
            res = _run_tree(root, cases)
            for r in res["records"]:
                rows.append(dict(tree=label, rep=rep, **r))
                print(f"{label:>5} rep {rep} {r['comm']:>10}/{r['layout']:<12} eff {r['efficiency']:.3f} "
                      f"rank {r['rank_ms']:.2f} ms single {r['single_gpu_ms']:.2f} ms", flush=True)  # fmt: skip
            print(f"{label} rep {rep}: {res['cpcompile']} ({time.perf_counter() - t0:.0f} s)", flush=True)
            if args.out:  # after every tree: a call cut short keeps what it measured
                with open(args.out, "w") as f:
                    json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

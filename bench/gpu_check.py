"""The project's GPU check: one command, one device call (< 8 minutes on one H200), run before any change to
cpcompile/ that can change what runs on a GPU lands.

    python -m bench.gpu_check [--commit SHA] [--skip-tests]

1. `tests/gpu` (pytest), each test a row;
2. the attention layer users compile (bench/gpu_layer.py: Llama3-8B projections + attention, bf16, Inductor,
   kernel="auto") for every comm x {zigzag, thd, thd_zigzag, thd_balanced}: one rank's fwd+bwd on a fake
   process group (collectives move no data: compute only) against single-GPU time / cp, and the combinations
   the comm refuses by design, which must raise one CPCompileError;
3. the same layer, small, on gloo ranks sharing the GPU (collectives through host memory): output and every
   gradient against one GPU, per rank;
4. an HF Llama with attn_implementation="cpcompile" on 2 gloo ranks: logits, loss and gradients against one GPU.

Rows pass or fail (efficiencies are reported, not judged). The log (bench/results/logs/gpu_check.txt, or $OUT)
holds the table, the torch / cuDNN versions, the commit of cpcompile/ it ran, and a last line
`N passed, N failed`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

import torch

from bench.gpu_speed import SPEED_CP, SPEED_SEQ, layer_speeds

CASES = [("all_gather", s) for s in ("zigzag", "thd", "thd_zigzag", "thd_balanced")]
CASES += [("a2a", s) for s in ("zigzag", "thd", "thd_zigzag", "thd_balanced")]
CASES += [("ring", s) for s in ("zigzag", "thd", "thd_zigzag", "thd_balanced")]
CASES += [("selective", s) for s in ("thd", "thd_balanced")]


def _commit(given: str | None) -> str:
    if given:
        return given
    try:
        return subprocess.run(
            ["git", "log", "-1", "--format=%H", "--", "cpcompile"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git here: pass --commit)"


def _pytest_rows(stdout: str, rc: int, stderr: str) -> list[tuple[str, bool, str]]:
    """One row per test from pytest's -rA summary (a run that ended otherwise: one failed row)."""
    rows = []
    for line in stdout.splitlines():
        m = re.match(r"^(PASSED|FAILED|ERROR|SKIPPED) (\S+)(?: - (.*))?", line)
        if m:
            status, test, why = m.groups()
            detail = status.lower() + (f": {why[:200]}" if why else "")
            rows.append((f"tests/gpu {test.split('::', 1)[-1]}", status == "PASSED", detail))
    if not rows or rc not in (0, 1):
        tail = " | ".join(stdout.strip().splitlines()[-3:] + stderr.strip().splitlines()[-3:])
        rows.append(("tests/gpu (pytest run)", False, f"rc={rc}: {tail[:300]}"))
    return rows


class Background:
    """A section run as its own process beside the others (each holds the GPU lightly: ranks sharing it)."""

    def __init__(self, name: str, cmd: list[str], out_path: str | None = None, report_dir: str | None = None) -> None:
        self.name, self.out_path, self.report_dir, self.start = name, out_path, report_dir, time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def rows(self, deadline: float) -> list[tuple[str, bool, str]]:
        try:
            stdout, stderr = self.proc.communicate(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            stdout, stderr = self.proc.communicate()
            return [(self.name, False, "not finished within the check's deadline")]
        print(
            f"[gpu_check] {self.name}: {time.perf_counter() - self.start:.0f} s, rc={self.proc.returncode}", flush=True
        )
        sys.stderr.write(stderr[-4000:])
        print(stdout[-20000:], flush=True)  # pytest's failure reports go to the check's stdout
        if self.report_dir:  # and whole, beside the log
            safe = re.sub(r"\W+", "_", self.name)
            with open(os.path.join(self.report_dir, f"gpu_check_{safe}.out"), "w") as f:
                f.write(stdout + "\n--- stderr ---\n" + stderr)
        if self.out_path is None:
            return _pytest_rows(stdout, self.proc.returncode, stderr)
        try:
            with open(self.out_path) as f:
                return [tuple(r) for r in json.load(f)]
        except (OSError, ValueError):
            return [(self.name, False, f"rc={self.proc.returncode}: {stderr.strip().splitlines()[-1:]}")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--commit",
        help="the commit of cpcompile/ being checked, computed where the tree was committed (default: git log -1 -- "
        "cpcompile here; the device machine's copy carries the working tree's files but a stale .git)",
    )
    p.add_argument("--skip-tests", action="store_true", help="leave out tests/gpu (while iterating)")
    p.add_argument("--deadline", type=float, default=520, help="seconds; unfinished sections fail")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "bench/results/logs"), "gpu_check.txt"))
    args = p.parse_args(argv)
    start = time.perf_counter()
    deadline = start + args.deadline
    pytest = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-n", "4", "tests/gpu"]
    report_dir = os.path.dirname(args.out) or "."
    os.makedirs(report_dir, exist_ok=True)
    workers = [] if args.skip_tests else [Background("tests/gpu", pytest, report_dir=report_dir)]
    parity_json = os.path.join(tempfile.mkdtemp(), "parity.json")
    parity = [sys.executable, "-m", "bench.gpu_parity", parity_json]
    workers.append(Background("parity", parity, parity_json, report_dir=report_dir))
    background_rows: list[tuple[str, bool, str]] = []

    def wait_for_workers() -> None:  # the speed rows time alone on the GPU
        for w in workers:
            background_rows.extend(w.rows(deadline))
        workers.clear()

    rows: list[tuple[str, bool, str]] = []
    records: list[dict] = []
    floor: dict = {}
    try:
        rows.extend(
            layer_speeds(CASES, before_timing=wait_for_workers, deadline=deadline, records=records, floor=floor)
        )
    except Exception as e:  # a crash is one failed row; the other sections still report
        rows.append(("layer speed", False, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"))
        traceback.print_exc()
    wait_for_workers()
    rows = background_rows + rows
    passed = sum(ok for _, ok, _ in rows)
    failed = len(rows) - passed
    width = max(len(r[0]) for r in rows)
    lines = [
        "cpcompile GPU check",
        f"commit (git log -1 -- cpcompile): {_commit(args.commit)}",
        f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name(0)}",
        f"layer speed: Llama3-8B attention layer, bf16, Inductor, kernel='auto', S={SPEED_SEQ}, cp={SPEED_CP}, "
        "one rank on a fake process group (compute only); efficiency = single-GPU time / cp / rank time, one step at "
        "a time (a ~1 ms head start) and back to back; host = CPU time to enqueue a step (fwd+bwd), GPU = its busy "
        "time, and their ratio (above 0.5: the host, not the GPU, nearly sets the pace)",
        *(
            f"host floor ({kind}): the layer compiled without cpcompile on one rank's {f['tokens']} tokens: host "
            f"{f['host_ms']:.2f} ms / GPU {f['gpu_ms']:.2f} ms a step"
            for kind, f in floor.items()
        ),
        f"wall time: {time.perf_counter() - start:.0f} s",
        "",
        *(f"{name:<{width}}  {'PASS' if ok else 'FAIL'}  {detail}" for name, ok, detail in rows),
        "",
        f"{passed} passed, {failed} failed",
    ]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    meta = dict(commit=_commit(args.commit), torch=torch.__version__, device=torch.cuda.get_device_name(0))
    meta["host_floor"] = floor  # gpu_speed.host_floor: the layer without CP on one rank's tokens
    with open(os.path.join(report_dir, "compiled_layer.json"), "w") as f:  # the speed rows as records
        json.dump({"meta": meta, "records": records}, f, indent=1)
    print("\n".join(lines))
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

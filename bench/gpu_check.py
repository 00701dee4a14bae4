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
import os
import re
import subprocess
import sys
import time
import traceback

import torch

from bench.gpu_parity import hf_parity, layer_parity
from bench.gpu_speed import SPEED_CP, SPEED_SEQ, layer_speeds

CASES = [("all_gather", s) for s in ("zigzag", "thd", "thd_zigzag", "thd_balanced")]
CASES += [("a2a", s) for s in ("zigzag", "thd", "thd_zigzag", "thd_balanced")]
CASES += [("ring", s) for s in ("zigzag", "thd", "thd_zigzag", "thd_balanced")]


def _commit(given: str | None) -> str:
    if given:
        return given
    try:
        return subprocess.run(
            ["git", "log", "-1", "--format=%H", "--", "cpcompile"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git here: pass --commit)"


def gpu_tests() -> list[tuple[str, bool, str]]:
    """Run tests/gpu; one row per test (its outcome line from pytest's -rA summary)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "tests/gpu"],
        capture_output=True,
        text=True,
    )
    rows = []
    for line in proc.stdout.splitlines():
        m = re.match(r"^(PASSED|FAILED|ERROR|SKIPPED) (\S+)(?: - (.*))?", line)
        if m:
            status, test, why = m.groups()
            rows.append(
                (
                    f"tests/gpu {test.split('::', 1)[-1]}",
                    status in ("PASSED",),
                    status.lower() + (f": {why}" if why else ""),
                )
            )
    if not rows or proc.returncode not in (0, 1):
        tail = " | ".join(proc.stdout.strip().splitlines()[-3:] + proc.stderr.strip().splitlines()[-3:])
        rows.append(("tests/gpu (pytest run)", False, f"rc={proc.returncode}: {tail[:300]}"))
    return rows


def _section(name: str, fn, rows: list) -> None:
    start = time.perf_counter()
    try:
        rows.extend(fn())
    except Exception as e:  # a section that crashes is one failed row, and the rest still run
        rows.append((name, False, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"))
        traceback.print_exc()
    print(f"[gpu_check] {name}: {time.perf_counter() - start:.0f} s", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--commit", help="the commit of cpcompile/ being checked (default: git log -1 -- cpcompile)")
    p.add_argument("--skip-tests", action="store_true", help="leave out tests/gpu (while iterating)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "bench/results/logs"), "gpu_check.txt"))
    args = p.parse_args(argv)
    start = time.perf_counter()
    rows: list[tuple[str, bool, str]] = []
    if not args.skip_tests:
        _section("tests/gpu", gpu_tests, rows)
    _section("layer speed", lambda: layer_speeds(CASES), rows)
    _section("layer parity", lambda: layer_parity(CASES), rows)
    _section("hf parity", hf_parity, rows)
    passed = sum(ok for _, ok, _ in rows)
    failed = len(rows) - passed
    width = max(len(r[0]) for r in rows)
    lines = [
        "cpcompile GPU check",
        f"commit (git log -1 -- cpcompile): {_commit(args.commit)}",
        f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name(0)}",
        f"layer speed: Llama3-8B attention layer, bf16, Inductor, kernel='auto', S={SPEED_SEQ}, cp={SPEED_CP}, "
        "one rank on a fake process group (compute only); efficiency = single-GPU time / cp / rank time",
        f"wall time: {time.perf_counter() - start:.0f} s",
        "",
        *(f"{name:<{width}}  {'PASS' if ok else 'FAIL'}  {detail}" for name, ok, detail in rows),
        "",
        f"{passed} passed, {failed} failed",
    ]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

"""The parity demos' command line: --help and usage errors never import torch (fast), progress is one line a step
in a log (no carriage-return bar), and a refusal anywhere in an exception chain becomes one line."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
from _demo import Progress, refusal  # noqa: E402

PROBE = """
import runpy, sys
sys.argv = [{script!r}, *{argv!r}]
try:
    runpy.run_path({script!r}, run_name="__main__")
except SystemExit:
    pass
print("torch imported:", "torch" in sys.modules)
"""


@pytest.mark.parametrize("script", ["train_cp.py", "train_torchtitan.py"])
@pytest.mark.parametrize("argv", [["--help"], ["--strategy", "nope"]])
def test_help_and_usage_errors_do_not_import_torch(script, argv):
    path = str(EXAMPLES / script)
    out = subprocess.run([sys.executable, "-c", PROBE.format(script=path, argv=argv)], capture_output=True, text=True,
                         timeout=60, cwd=EXAMPLES)  # fmt: skip
    assert "torch imported: False" in out.stdout, out.stdout + out.stderr


def test_progress_in_a_log_is_a_line_a_step():
    log = io.StringIO()  # not a terminal
    progress = Progress(3, started=0.0, stream=log)
    for step, loss in enumerate((3.0, 2.5, 2.0)):
        progress(step, loss)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert lines[0].startswith("step 1 done") and [line.split("  ")[0] for line in lines[1:]] == [
        "step 1/3", "step 2/3", "step 3/3"
    ]  # fmt: skip


def test_refusal_is_found_through_the_chain():
    from cpcompile import CPCompileError

    try:
        try:
            raise CPCompileError("cpcompile cannot rewrite x: rule. Fix: fix")
        except CPCompileError as inner:
            raise RuntimeError("backend failed") from inner  # as Dynamo wraps a backend's error
    except RuntimeError as e:
        found = refusal(e)
    assert found["refused"] == "cpcompile cannot rewrite x: rule. Fix: fix"
    assert refusal(ValueError("other")) is None

"""The examples' command line: --help and usage errors never import torch (fast) and describe the script, a
torchrun script started with plain python says to use torchrun, progress is one line a step in a log (no
carriage-return bar), and a refusal anywhere in an exception chain becomes one line."""

from __future__ import annotations

import io
import os
import re
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
except SystemExit as e:
    print("exit:", e.code)
print("torch imported:", "torch" in sys.modules)
"""
TORCHRUN = sorted(p.name for p in (EXAMPLES / "torchrun").glob("*.py"))
NOT_TORCHRUN = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}


def _probe(path: Path, argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE.format(script=str(path), argv=argv)], capture_output=True,
                          text=True, timeout=60, cwd=path.parent, env=NOT_TORCHRUN)  # fmt: skip


@pytest.mark.parametrize("script", ["train_cp.py", "train_torchtitan.py"])
@pytest.mark.parametrize("argv", [["--help"], ["--strategy", "nope"]])
def test_help_and_usage_errors_do_not_import_torch(script, argv):
    path = str(EXAMPLES / script)
    out = subprocess.run([sys.executable, "-c", PROBE.format(script=path, argv=argv)], capture_output=True, text=True,
                         timeout=60, cwd=EXAMPLES)  # fmt: skip
    assert "torch imported: False" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("script", TORCHRUN)
def test_torchrun_help_describes_the_script_without_importing_torch(script):
    """`--help` answers at once (no torch import: 3-6 s before) with the script's docstring and every option's help."""
    out = _probe(EXAMPLES / "torchrun" / script, ["--help"])
    assert "torch imported: False" in out.stdout, out.stdout + out.stderr
    assert "torchrun --standalone" in out.stdout and "--verbose" in out.stdout, out.stdout
    blocks = re.split(r"\n  (?=-)", out.stdout.split("options:")[1])[1:]  # one an option, its help wrapped or not
    undescribed = [b.split()[0] for b in blocks if len(b.split()) < 3]  # "--x X" or "--flag" without help
    assert len(blocks) > 2 and not undescribed, undescribed


@pytest.mark.parametrize("script", TORCHRUN)
def test_torchrun_script_under_plain_python_says_use_torchrun(script):
    """Plain `python examples/torchrun/x.py`: one line naming torchrun, not torch's "RANK expected" traceback."""
    out = _probe(EXAMPLES / "torchrun" / script, [])
    assert "torch imported: False" in out.stdout, out.stdout + out.stderr
    message = out.stdout.split("exit: ", 1)[1].splitlines()[0]
    assert message.startswith(f"{EXAMPLES / 'torchrun' / script} is one") and "torchrun --standalone" in message


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


ONE_LINE = """
import cpcompile
cpcompile.one_line_refusals()
try:
    raise cpcompile.CPCompileError("node 'out' at model.py:3: the rule. Fix: the fix")
except cpcompile.CPCompileError as inner:
    raise RuntimeError("backend='cpcompile' raised: ...") from inner  # as Dynamo wraps a backend's error
"""


@pytest.mark.parametrize("rank", ["0", "1"])
def test_one_line_refusals_prints_the_refusal_alone_on_rank_0(rank):
    out = subprocess.run([sys.executable, "-c", ONE_LINE], capture_output=True, text=True, timeout=120,
                         env={**NOT_TORCHRUN, "RANK": rank})  # fmt: skip
    assert out.returncode == 1
    expected = "error: node 'out' at model.py:3: the rule. Fix: the fix (--verbose: the whole traceback)\n"
    assert out.stderr == (expected if rank == "0" else ""), out.stderr


def test_one_line_refusals_keeps_other_tracebacks():
    script = "import cpcompile\ncpcompile.one_line_refusals()\nraise RuntimeError('backend=...')"  # no refusal
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" in out.stderr and "RuntimeError: backend=" in out.stderr

"""Every README example command, run N times in a row: a shutdown race (examples/torchrun/packed.py once printed
`done:`, then `terminate called without an active exception` and SIGABRT, in 1 run of 7) shows only over many
runs. Not part of the suite's main path: it runs only with CPCOMPILE_EXAMPLES_REPEAT=N set (docs/contributing.md,
"The examples, many times over"), e.g.

    CPCOMPILE_EXAMPLES_REPEAT=10 python -m pytest -q -p no:cacheprovider tests/examples/test_examples_repeat.py
"""

from __future__ import annotations

import importlib.util
import os
import signal

import pytest

from tests.examples.test_examples import NEEDS, gloo_alive_at_exit, readme_commands, run_example

REPEAT = int(os.environ.get("CPCOMPILE_EXAMPLES_REPEAT", "0"))

pytestmark = pytest.mark.skipif(
    REPEAT < 1, reason="runs only with CPCOMPILE_EXAMPLES_REPEAT=N (every example N times; docs/contributing.md)"
)


def _failure(proc) -> str | None:
    """Why one run did not end cleanly, or None."""
    if proc.returncode < 0:
        return f"killed by {signal.Signals(-proc.returncode).name}"
    if proc.returncode != 0:
        return f"exit status {proc.returncode}"
    if "terminate called" in proc.stderr or "Fatal Python error" in proc.stderr:
        return "a C++ terminate or a fatal Python error on stderr"
    if "done:" not in proc.stdout and "PARITY OK" not in proc.stdout:
        return "no `done:` line"
    if gloo_alive_at_exit(proc) and "fsdp2.py" not in " ".join(proc.args):  # torch's DTensor caches (test_examples)
        return "gloo threads alive at exit (the process group outlived destroy_process_group)"
    return None


@pytest.mark.parametrize("command", readme_commands())
def test_example_ends_cleanly_every_time(command, tmp_path):
    for module in [m for key, modules in NEEDS.items() if key in command for m in modules]:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module}")
    failures = []
    for run in range(1, REPEAT + 1):
        proc = run_example(command, tmp_path)
        why = _failure(proc)
        if why is not None:
            failures.append(f"run {run}: {why}\n{(proc.stdout + proc.stderr)[-1500:]}")
    assert not failures, f"{command}: {len(failures)} of {REPEAT} runs failed:\n" + "\n".join(failures)

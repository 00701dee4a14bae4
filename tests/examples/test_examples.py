"""The examples as the README gives them (its `torchrun ...` and `python examples/...` lines), at small sizes: a
broken example fails here. Each runs as its own processes (torchrun, or the demo's own ranks), gloo on CPU."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMALL = {
    "dense.py": ["--steps", "3", "--seq", "64"],
    "packed.py": ["--steps", "3", "--tokens", "128", "--max-documents", "8"],
    "hf.py": ["--steps", "3", "--seq", "64"],
    "hf_trainer.py": ["--steps", "3", "--seq", "64"],
    "fsdp2.py": ["--steps", "3", "--seq", "64", "--batch", "1"],
    "checkpoint.py": ["--steps", "2", "--seq", "64"],
    "train_cp.py": ["--seq", "64", "--layers", "1"],  # the default 20 steps: the reference must train that long
}
NEEDS = {"hf.py": ("transformers",), "hf_trainer.py": ("transformers", "accelerate"),
         "train_cp.py --model hf-llama": ("transformers",)}  # fmt: skip


def readme_commands() -> list[str]:
    """Every `torchrun ... examples/...` and `python examples/....py ...` line of the README's code blocks."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    lines = [line.split("#")[0].split("&&")[-1].strip() for block in blocks for line in block.splitlines()]
    found = [line for line in lines if re.match(r"(torchrun|python) .*examples/(torchrun/)?\w+\.py", line)]
    return list(dict.fromkeys(found))  # the quick start repeats one


def _argv(command: str, tmp_path: Path) -> list[str]:
    words = command.split()
    script = next(w for w in words if w.endswith(".py"))
    launcher = [sys.executable, "-m", "torch.distributed.run"] if words[0] == "torchrun" else [sys.executable]
    extra = SMALL[Path(script).name] + (["--dir", str(tmp_path / "ckpt")] if script.endswith("checkpoint.py") else [])
    return launcher + words[1:] + extra


def test_readme_names_every_example():
    named = {Path(c.split(".py")[0] + ".py").name for c in readme_commands()}
    on_disk = {p.name for p in (ROOT / "examples" / "torchrun").glob("*.py")}
    assert on_disk <= named, f"examples the README does not show: {sorted(on_disk - named)}"


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_runs(command, tmp_path):
    for key, modules in NEEDS.items():
        for module in modules:
            if key in command and importlib.util.find_spec(module) is None:
                pytest.skip(f"needs {module}")
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(_argv(command, tmp_path), cwd=ROOT, env=env, capture_output=True, text=True, timeout=420)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{command} failed (rc {proc.returncode}):\n{out[-4000:]}"
    assert "done:" in proc.stdout or "PARITY OK" in proc.stdout, out[-4000:]
    losses = re.search(r"done: .*loss ([\d.]+) -> ([\d.]+)", proc.stdout)
    if losses:  # the torchrun examples train: the loss goes down
        assert float(losses[2]) < float(losses[1]), proc.stdout

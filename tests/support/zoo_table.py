"""README's table of the Hugging Face models cpcompile trains with parity, generated from the HF zoo's own data
(tests/support/hf_zoo.py: the models, their configs, what tests/parity/test_hf_zoo.py runs each under, and the
kernel those runs expect), so it cannot claim what the tests do not run. `python -m tests.support.zoo_table` prints
it; tests/unit/test_zoo_table.py checks that README.md holds exactly this text between its markers."""

from __future__ import annotations

from tests.support.hf_zoo import MODELS, RUNS, _config, features

BEGIN, END = "<!-- zoo table: python -m tests.support.zoo_table -->", "<!-- end zoo table -->"


def _kernel(name: str) -> str:
    """The kernel test_hf_zoo expects the planner to pick on CPU (softcapped scores: the CPU reference)."""
    return "cpu_ref" if "softcapped scores" in features(name) else "cpu_flash"


def table() -> str:
    """The markdown table, one row per zoo model."""
    rows = [
        "| model (HF class) | attention | trained with parity under (strategy / comm / ranks) | kernel (CPU) |",
        "| --- | --- | --- | --- |",
    ]
    for name in MODELS:
        cls, _ = _config(name)
        runs = ", ".join(f"{s} / {c} / {w}" for s, c, w in RUNS[name])
        rows.append(f"| {name} (`{cls.__name__}`) | {', '.join(features(name))} | {runs} | {_kernel(name)} |")
    return "\n".join(rows)


def block() -> str:
    """The table between README's markers."""
    return f"{BEGIN}\n{table()}\n{END}"


if __name__ == "__main__":
    print(block())

"""README's model table is the one generated from the HF zoo's data (tests/support/zoo_table.py): regenerate it with
`python -m tests.support.zoo_table` when the zoo changes."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tests.support.zoo_table import BEGIN, END, block  # noqa: E402


def test_readme_holds_the_generated_zoo_table():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    start, end = readme.index(BEGIN), readme.index(END) + len(END)
    assert readme[start:end] == block(), "README's zoo table is stale: python -m tests.support.zoo_table"

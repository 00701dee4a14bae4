"""attn_implementation="cpcompile" is registered in HF's attention and mask interfaces whichever of cpcompile and
transformers is imported first, and `import cpcompile` alone never imports transformers (integrations/__init__.py).
Fresh interpreters: the order of imports is what is tested."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("transformers")

REGISTERED = (
    "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS\n"
    "from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS\n"
    "from cpcompile.integrations.hf import cpcompile_attention, cpcompile_mask\n"
    "assert ALL_ATTENTION_FUNCTIONS['cpcompile'] is cpcompile_attention\n"
    "assert ALL_MASK_ATTENTION_FUNCTIONS['cpcompile'] is cpcompile_mask\n"
)


def _run(code: str) -> None:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_cpcompile_first_registers_when_transformers_loads():
    _run(
        "import sys, cpcompile\n"
        "assert 'transformers' not in sys.modules, 'import cpcompile imported transformers'\n"
        "import transformers\n" + REGISTERED
    )


def test_transformers_first_registers_at_import_cpcompile():
    _run("import transformers.modeling_utils, cpcompile\n" + REGISTERED)

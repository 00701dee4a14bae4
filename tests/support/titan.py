"""torchtitan for the tests: the test extra installs it (with triton) on Linux with Python >= 3.11, where a
failed import is an error, not a skip; elsewhere the torchtitan tests are skipped (torchtitan needs Python 3.11,
and its import needs triton, which has Linux wheels only)."""

from __future__ import annotations

import sys

import pytest

LAYERS = 2
"""Layers of torchtitan's Llama3 debugmodel the tests keep (of its 6), for CPU time."""


def require_torchtitan() -> None:
    """Import torchtitan's Llama3, or skip the module where the test extra does not install it."""
    if sys.version_info < (3, 11) or not sys.platform.startswith("linux"):
        pytest.skip("the test extra installs torchtitan on Linux with Python >= 3.11 only", allow_module_level=True)
    import torch

    if torch.__version__ < "2.12":  # torchtitan 0.3.0 imports torch.distributed.fsdp.DataParallelMeshDims (2.12+)
        pytest.skip(f"torchtitan 0.3.0 needs torch >= 2.12 (this is {torch.__version__})", allow_module_level=True)
    import torchtitan.models.llama3  # noqa: F401  (needs triton importable, even on CPU)

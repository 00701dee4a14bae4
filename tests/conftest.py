"""Markers of the suite, applied by folder.

Markers (pytest runs with --strict-markers, so only these exist):
- multirank: the test spawns gloo ranks (cpcompile.testing.distributed.run_ranks); slow. Every test in
  tests/parity/ and tests/examples/ has it; a multi-rank test in another folder carries @pytest.mark.multirank
  itself.
- gpu: the test needs CUDA (skipped where it is absent). Every test in tests/gpu/ has it.

pytest -m "not multirank" runs the fast tests only (unit, graphs, errors); pytest -m gpu the CUDA ones.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Multi-rank tests share spawned ranks per (world, backend, threads) for the whole session instead of spawning
# their own (cpcompile/testing/distributed.py: each run starts from a reset state; a failure respawns them).
os.environ.setdefault("CPCOMPILE_TEST_SHARED_RANKS", "1")

MARKERS = {
    "multirank": "spawns gloo ranks (run_ranks); every test in tests/parity/",
    "gpu": "needs a CUDA GPU; every test in tests/gpu/",
}
FOLDER_MARKERS = {"parity": "multirank", "examples": "multirank", "gpu": "gpu"}
TESTS = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: Dynamo marks a length dynamic once a second length of the same code was
    compiled in this process, so without a reset a test's outcome would depend on the tests run before it."""
    import torch

    torch._dynamo.reset()
    yield


@pytest.fixture
def no_comm(monkeypatch):
    """Fail the test if cpcompile issues an all-gather or reduce-scatter: errors must come before communication."""
    import cpcompile.comm.collectives as collectives

    def boom(*args, **kwargs):
        raise AssertionError("a collective ran before the error was raised")

    for name in ("_all_gather", "_reduce_scatter"):
        monkeypatch.setattr(collectives, name, boom)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from cpcompile.testing.distributed import close_shared_pools

    close_shared_pools()


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(item.path).resolve()
        if path.is_relative_to(TESTS):
            folder = path.relative_to(TESTS).parts[0]
            if folder in FOLDER_MARKERS:
                item.add_marker(FOLDER_MARKERS[folder])

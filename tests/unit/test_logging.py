"""The "cpcompile" logger: one INFO line per rewritten site naming the user's source line, the layout, comm,
kernel and blocks; the graph after the pass at DEBUG; TORCH_LOGS="+cpcompile" turns it on."""

from __future__ import annotations

import inspect
import logging
import os
import subprocess
import sys

import torch

import cpcompile
from cpcompile.testing import model as model_module
from cpcompile.testing.model import TinyConfig, TinyLlama
from tests.support.fake_pg import fake_group


def _compile_tiny(layers: int = 2):
    model = TinyLlama(TinyConfig(layers=layers))
    ids, pos = torch.randint(0, 128, (1, 8)), torch.arange(8)[None]
    with fake_group(rank=1, world=2):
        be = cpcompile.backend(strategy="zigzag", inner="eager")
        torch.compile(model, backend=be, fullgraph=True)(ids, pos)
    return be


def test_one_info_line_per_site_with_the_source_line(caplog):
    with caplog.at_level(logging.INFO, logger="cpcompile"):
        be = _compile_tiny()
    lines = [r.getMessage() for r in caplog.records if r.name == "cpcompile" and r.levelno == logging.INFO]
    assert len(lines) == len(be.plans) == 2, lines
    sdpa_line = next(
        i
        for i, ln in enumerate(inspect.getsource(model_module).splitlines(), 1)
        if "scaled_dot_product_attention(" in ln
    )
    for line in lines:
        assert f"{model_module.__file__}:{sdpa_line} in forward" in line, line  # the model's line, not a wrapper's
        assert "layout=zigzag comm=all_gather kernel=cpu_flash causal=True blocks=" in line and "(rank 1 of 2)" in line


def test_graph_at_debug(caplog):
    with caplog.at_level(logging.DEBUG, logger="cpcompile"):
        _compile_tiny(layers=1)
    debug = [r.getMessage() for r in caplog.records if r.name == "cpcompile" and r.levelno == logging.DEBUG]
    assert any("graph after the cpcompile pass" in m and "all_gather_attention" in m for m in debug), debug


def test_torch_logs_turns_it_on():
    script = (
        "import torch, cpcompile\n"
        "from cpcompile.testing.model import TinyConfig, TinyLlama\n"
        "from tests.support.fake_pg import fake_group\n"
        "m = TinyLlama(TinyConfig(layers=1))\n"
        "with fake_group(0, 2):\n"
        "    torch.compile(m, backend=cpcompile.backend(strategy='flat', inner='eager'), fullgraph=True)"
        "(torch.randint(0, 128, (1, 8)), torch.arange(8)[None])\n"
    )
    env = {**os.environ, "TORCH_LOGS": "+cpcompile"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rewrote attention node" in proc.stderr and "graph after the cpcompile pass" in proc.stderr, proc.stderr[
        -3000:
    ]


def test_plans_and_graphs_count_a_recompile():
    """A recompile (here: a new length, compiled as its own static graph) plans the model's sites again: plans lists
    them twice and graphs says 2, which is how the examples word it (hf.py --packing recompiled once for HF's
    longest document and said "4 attention calls rewritten" for 2 layers)."""
    model = TinyLlama(TinyConfig(layers=2))
    with fake_group(rank=0, world=2):
        be = cpcompile.backend(strategy="zigzag", inner="eager")
        compiled = torch.compile(model, backend=be, fullgraph=True, dynamic=False)
        for length in (8, 16):
            compiled(torch.randint(0, 128, (1, length)), torch.arange(length)[None])
    assert (len(be.plans), be.graphs) == (4, 2)

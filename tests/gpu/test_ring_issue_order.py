"""On CUDA, Inductor's code for a ring region issues each K/V shift before the step's attention kernels
(tests/support/ring_order.py): the overlap the ring is for. One rank of 4 on a fake process group (compute only),
the zigzag layout, bf16, kernel="auto" (cuDNN), torch.compile's default Inductor."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import cpcompile
from cpcompile.testing.model import TinyConfig, TinyLlama
from tests.support.fake_pg import fake_group
from tests.support.ring_order import launch_events, shifts_overlap_kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_ring_forward_issues_each_shift_before_its_step():
    """zigzag: every step has blocks to overlap (flat's causal rank 1 of 4 has none for its last shift)."""
    cfg = TinyConfig(layers=1, dim=256, heads=4, kv_heads=2, hidden=256)
    torch.manual_seed(0)
    model = TinyLlama(cfg).to("cuda", torch.bfloat16)
    ids = torch.randint(0, cfg.vocab, (1, 512), device="cuda")
    pos = torch.arange(512, device="cuda")[None]
    with fake_group(rank=1, world=4):
        be = cpcompile.backend(strategy="zigzag", comm="ring")
        compiled = torch.compile(model, backend=be, fullgraph=True)
        _, codes = run_and_get_code(lambda: compiled(ids, pos).sum().backward())
    events = launch_events(codes[0])
    assert events.count("shift") == 3, events
    problem = shifts_overlap_kernels(events)
    assert problem is None, problem

"""thd_balanced's refusals: one CPCompileError before any collective, naming the rule and the fix.

A plain cu_seqlens given to the model (the offsets, not shard_batch's plan), a plan made for another cp, a
comm without a thd_balanced region (ring refuses it by its registry entry; any other comm by the layout's list).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn.attention.varlen import varlen_attn

import cpcompile
from cpcompile import CPCompileError
from cpcompile.comms import registry
from cpcompile.layouts.thd_balanced import make_plan
from tests.support.errors import cp_error
from tests.support.fake_pg import fake_group

CU = torch.tensor([0, 3, 16], dtype=torch.int32)


def _causal(q, k, v, cu):
    return varlen_attn(q, k, v, cu, cu, 16, 16, window_size=(-1, 0))


def _qkv(t=8, h=2, d=4):
    return torch.randn(t, h, d), torch.randn(t, h, d), torch.randn(t, h, d)


def _compile(cu, **backend_kw):
    be = cpcompile.backend(strategy="thd_balanced", inner="eager", **backend_kw)
    with pytest.raises(Exception) as info:
        torch.compile(_causal, backend=be, fullgraph=True)(*_qkv(), cu)
    return cp_error(info)


def test_plain_offsets_are_refused_at_compile_time(no_comm):
    with fake_group(0, 2):
        err = _compile(CU)
    assert "3 entries are not a plan's for cp=2" in str(err) and "shard_batch" in str(err)
    assert "test_thd_balanced_errors.py" in str(err), "the error names the user's source line"


def test_ring_is_refused_with_this_layout(no_comm):
    with fake_group(0, 2):
        err = _compile(make_plan(CU, 2), comm="ring")
    assert "comm='ring' has no ring steps for the packed layout 'thd_balanced'" in str(err)
    assert "Fix: use strategy in" in str(err)


def test_a_comm_the_layout_does_not_know_is_refused(monkeypatch, no_comm):
    """A new comm whose capabilities do not take the layout, and say nothing of it, is refused with the comms
    that take it (comms/registry.packed_layout_problem)."""
    gather = registry.COMMS["all_gather"]
    caps = dataclasses.replace(gather.capabilities, packed_layouts=("thd", "thd_zigzag"))
    other = dataclasses.replace(gather, name="other", capabilities=caps)
    monkeypatch.setitem(registry.COMMS, "other", other)
    with fake_group(0, 2):
        err = _compile(make_plan(CU, 2), comm="other")
    assert "strategy='thd_balanced' has no 'other' region yet" in str(err)
    assert "Fix: use comm in ['all_gather', 'a2a', 'selective']" in str(err)


def test_plan_for_another_cp_is_refused_by_shard():
    plan = make_plan(CU, 4)
    with fake_group(0, 2):
        with pytest.raises(CPCompileError, match="a thd_balanced plan for cp=4 .*, used at cp=2"):
            cpcompile.shard(torch.zeros(16), strategy="thd_balanced", seq_dim=0, cu_seqlens=plan)


def test_odd_total_is_the_only_length_rule():
    with fake_group(0, 2):
        with pytest.raises(CPCompileError, match="multiple of 2, got 15"):
            cpcompile.shard(
                torch.zeros(15),
                strategy="thd_balanced",
                seq_dim=0,
                cu_seqlens=CU - torch.tensor([0, 0, 1], dtype=torch.int32),
            )
        local = cpcompile.shard(torch.arange(16), strategy="thd_balanced", seq_dim=0, cu_seqlens=CU)
    assert local.numel() == 8, "documents of any length (3 and 13 here) at cp=2"

"""comm="selective"'s refusals: one CPCompileError at compile time, before any collective, naming rule and fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn

import cpcompile
from cpcompile import CPCompileError
from cpcompile.layouts.thd_balanced import make_plan
from tests.support.errors import cp_error
from tests.support.fake_pg import fake_group

CU = torch.tensor([0, 3, 16], dtype=torch.int32)


def _varlen(window):
    def fn(q, k, v, cu):
        return varlen_attn(q, k, v, cu, cu, 16, 16, window_size=window)

    return fn


def _qkv(shape=(8, 2, 4)):
    return torch.randn(shape), torch.randn(shape), torch.randn(shape)


def _compile(fn, *args, strategy):
    be = cpcompile.backend(strategy=strategy, comm="selective", inner="eager")
    with pytest.raises(Exception) as info:
        torch.compile(fn, backend=be, fullgraph=True)(*args)
    return cp_error(info)


def test_thd_zigzag_is_refused(no_comm):
    with fake_group(0, 2):
        err = _compile(_varlen((-1, 0)), *_qkv(), torch.tensor([0, 8, 16], dtype=torch.int32), strategy="thd_zigzag")
    assert "under strategy='thd_zigzag' every rank holds a piece of every document" in str(err)
    assert "Fix: use strategy='thd_balanced' or 'thd' with comm='selective', or comm='all_gather'" in str(err)


def test_two_sided_windows_are_refused(no_comm):
    with fake_group(0, 2):
        err = _compile(_varlen((2, 2)), *_qkv(), make_plan(CU, 2), strategy="thd_balanced")
    assert "not supported by the selective THD region" in str(err) and "use comm='a2a'" in str(err)


def test_dense_attention_is_refused(no_comm):
    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    with fake_group(0, 2):
        err = _compile(sdpa, *_qkv((1, 2, 8, 4)), strategy="zigzag")
    assert "one dense sequence is read whole by every rank" in str(err)
    assert "Fix: use comm='all_gather', 'a2a' or 'ring'" in str(err)


def test_regather_is_refused():
    with pytest.raises(CPCompileError, match="regather=True with comm='selective'"):
        cpcompile.backend(strategy="thd_balanced", comm="selective", regather=True)

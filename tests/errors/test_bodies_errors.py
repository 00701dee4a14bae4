"""Attention in a higher-order-op body the pass cannot rewrite is refused, not passed through."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cpcompile
from tests.support.fake_pg import fake_group


def _attn(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class _UserFunction(torch.autograd.Function):
    """Attention inside a user's autograd.Function: its backward is the user's, not the region's."""

    @staticmethod
    def forward(ctx, q):
        return _attn(q, q, q)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _user_function_model(q):
    return _UserFunction.apply(q) + 1


def test_attention_inside_other_bodies_is_refused():
    """A body the pass cannot rewrite (a user autograd.Function, whose backward is its own) is refused with
    one CPCompileError naming the higher-order op, not passed through."""
    q = torch.randn(1, 2, 8, 8, requires_grad=True)
    with fake_group(0, 2):
        be = cpcompile.backend(strategy="flat", inner="eager")
        with pytest.raises(Exception) as excinfo:
            torch.compile(_user_function_model, backend=be, fullgraph=True)(q)
    err = excinfo.value
    while err is not None and not isinstance(err, cpcompile.CPCompileError):
        err = err.__cause__ or err.__context__
    assert err is not None, excinfo.value
    assert "torch.ops.higher_order.autograd_function_apply" in str(err) and "Fix: move the attention" in str(err)

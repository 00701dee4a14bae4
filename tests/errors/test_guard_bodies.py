"""Every higher-order-op body that find rewrites (graph/bodies.py: ONCE and BRANCHES, the one table both read)
is looked into by the token guard: attention inside is rewritten and passes, and token mixing beside it inside the
same body is refused naming that op and its line, not the higher-order op around it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._higher_order_ops.hints_wrap import hints_wrapper
from torch._higher_order_ops.wrap import (
    wrap,
    wrap_activation_checkpoint,
    wrap_with_autocast,
    wrap_with_set_grad_enabled,
)
from torch.utils.checkpoint import checkpoint

import cpcompile
from cpcompile.graph.bodies import BRANCHES, ONCE
from tests.support.errors import cp_error
from tests.support.fake_pg import fake_group

B, L, D = 2, 8, 8  # the sequence dim is 1 of (B, L, D)


def attend(x):
    q = x.view(x.shape[0], x.shape[1], 2, -1).transpose(1, 2)
    return F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(x.shape)


def attend_then_cumsum(x):
    return attend(x).cumsum(dim=1)


def attend_token_wise(x):
    return F.gelu(attend(x)) * 2


@torch.compiler.nested_compile_region
def region_mixing(x):
    return attend_then_cumsum(x)


@torch.compiler.nested_compile_region
def region_clean(x):
    return attend_token_wise(x)


def _subgraph(body):
    """A nested_compile_region called twice (Dynamo inlines a region called once: torch 2.13)."""
    return region_mixing if body is attend_then_cumsum else region_clean


CALLS = {
    "tag_activation_checkpoint": lambda body: lambda x, flag: checkpoint(body, x, use_reentrant=False),
    "wrap_activation_checkpoint": lambda body: lambda x, flag: wrap_activation_checkpoint(body, x),
    "wrap": lambda body: lambda x, flag: wrap(body, x),
    "wrap_with_autocast": lambda body: lambda x, flag: wrap_with_autocast("cpu", torch.bfloat16, True, None, body, x),
    "wrap_with_set_grad_enabled": lambda body: lambda x, flag: wrap_with_set_grad_enabled(False, body, x),
    "invoke_subgraph": lambda body: lambda x, flag: _subgraph(body)(x) + _subgraph(body)(2 * x),
    "hints_wrapper": lambda body: lambda x, flag: hints_wrapper(body, (x,), {}, hints={"cp": True}),
    "cond": lambda body: lambda x, flag: torch.cond(flag.sum() > 0, body, attend_token_wise, (x,)),
}
"""A model calling `body` through each higher-order op (the predicate of cond does not depend on the tokens)."""


def _compile(fn):
    with fake_group(0, 2):
        be = cpcompile.backend(strategy="zigzag", inner="eager")
        torch._dynamo.reset()
        torch.compile(fn, backend=be, fullgraph=True)(torch.randn(B, L, D), torch.ones(1))
    return be


def test_every_body_kind_is_covered():
    assert set(CALLS) == set(ONCE) | set(BRANCHES)


@pytest.mark.parametrize("hop", sorted(CALLS))
def test_token_mixing_inside_a_body_is_refused(no_comm, hop):
    with pytest.raises(Exception) as excinfo:
        _compile(CALLS[hop](attend_then_cumsum))
    msg = str(cp_error(excinfo))
    assert f"node 'cumsum' at {__file__}" in msg and "in attend_then_cumsum" in msg, msg
    assert "aten.cumsum" in msg and "mixes tokens along the sequence dim" in msg, msg


@pytest.mark.parametrize("hop", sorted(CALLS))
def test_attention_inside_a_body_is_rewritten_and_passes(hop):
    be = _compile(CALLS[hop](attend_token_wise))
    assert {p.site.body.enclosing[-1] for p in be.plans} == {hop}, [p.site.body for p in be.plans]

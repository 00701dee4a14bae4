"""hf_token_mixers declares transformers' torch fallback, not the hub-kernel wrapper around it: with
flash-linear-attention installed, transformers 5.24's decorated `torch_chunk_gated_delta_rule` calls fla's
`chunk_gated_delta_rule(q, k, v, ...)`, and a declared call, which passes arguments by name (query=, key=, value=),
failed with "missing 3 required positional arguments" (seen on the H200 with fla-core 0.6.0 in the path)."""

from __future__ import annotations

import functools
import sys
import types

import torch
from torch import nn

import cpcompile
from cpcompile.mixers.hf import torch_fallback


def _kernel_package_rule(q, k, v, g, beta):  # a kernel package's signature: other argument names
    raise AssertionError("the kernel package's function ran instead of the torch fallback")


def torch_chunk_gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False):
    return query * g[..., None] + key * beta[..., None] + value, None


def _hub_wrapped(torch_function):  # what use_kernel_func_from_hub_with_fallback builds when the package imports
    @functools.wraps(torch_function)
    def wrapped(*args, **kwargs):
        return _kernel_package_rule(*args, **kwargs)

    return wrapped


def test_the_torch_fallback_is_declared_and_runs(monkeypatch):
    modeling = types.ModuleType("fake_hf_modeling_gdn")
    modeling.torch_chunk_gated_delta_rule = _hub_wrapped(torch_chunk_gated_delta_rule)
    monkeypatch.setitem(sys.modules, modeling.__name__, modeling)
    layer = type("Layer", (nn.Module,), {"__module__": modeling.__name__})()
    model = nn.Sequential(layer)
    assert torch_fallback(modeling.torch_chunk_gated_delta_rule) is torch_chunk_gated_delta_rule
    names = cpcompile.hf_token_mixers(model)
    assert names == [f"{modeling.__name__}.torch_chunk_gated_delta_rule"]
    q, k, v = (torch.randn(1, 8, 2, 4) for _ in range(3))
    g, beta = torch.randn(1, 8, 2), torch.randn(1, 8, 2)
    out, _ = modeling.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta)  # no CP group: the original code
    torch.testing.assert_close(out, q * g[..., None] + k * beta[..., None] + v)

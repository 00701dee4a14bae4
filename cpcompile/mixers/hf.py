"""Hugging Face hybrids: the token mixers of transformers' modeling files declared by name.

transformers 5.24's linear-attention and SSM layers call module-level torch fallbacks; the ones below are
head-local (channel-local), so `hf_token_mixers(model)` replaces them in the modeling modules of the model's
layers by their declared versions (process-wide, like any declaration; without CP they compute the same).
`comm="state"` declares those that can pass state (the causal conv: a halo of kernel - 1 tokens; the gated delta
rule: its chunk transition) with comm="state" and the others (Mamba's scans) with comm="a2a". The torch
fallback is declared even where transformers would call a kernel package instead (`torch_fallback`).
Packed documents: these fallbacks take `cu_seqlens` in **kwargs and ignore it (their documents mix even in one
process), so they are not declared with `documents=` and a packed call is refused (plan_state.py).
A model built with attn_implementation="cpcompile" declares its modeling modules' mixers itself
(`hf_default_mixers`, called by integrations/hf_models.py: comm="a2a" where not declared yet); `restore_hf_mixers`
puts transformers' own functions back.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import torch.nn as nn

from .declare import COMMS, StateArgs, token_mixer

HF_MIXERS: dict[str, dict] = {
    # (B, C, L) -> (B, C, L), depthwise over channels; weight (C, K), bias (C,)
    "causal_conv1d_fn": dict(heads_dim=1, seq_dim=2, weight_dims={"weight": 0, "bias": 0}),
    # q/k (B, L, Hk, Dk), v (B, L, Hv, Dv), g/beta (B, L, Hv) -> ((B, L, Hv, Dv), state or None)
    "torch_chunk_gated_delta_rule": dict(heads_dim=2, seq_dim=1),
    # Mamba2's SSD: x (B, L, H, P), dt (B, L, H), B/C (B, L, G, N) -> (B, L, H, P); A, D, dt_bias (H,)
    "mamba2_chunk_scan": dict(heads_dim=2, seq_dim=1, weight_dims={"A": 0, "D": 0, "dt_bias": 0}),
    # Mamba1's selective scan (Jamba): u/dt/z (B, D, L) -> (B, D, L); A (D, N), D, delta_bias (D,); B/C (B, N, L)
    # carry no channel dim: every channel reads them, so every rank gets all their tokens
    "mamba_selective_scan": dict(
        heads_dim=1, seq_dim=2, weight_dims={"A": 0, "D": 0, "delta_bias": 0}, shared_inputs=("B", "C")
    ),
}
"""Module-level function name -> its declaration (token_mixer's keywords)."""

HF_STATE: dict[str, dict] = {
    "causal_conv1d_fn": dict(context=lambda w: w["weight"].shape[-1] - 1),  # weight (C, K): K - 1 earlier tokens
    "torch_chunk_gated_delta_rule": dict(state=StateArgs()),  # (query, key, value, ..., initial_state, ...)
}
"""The functions that can pass state (comm="state"): the keywords that say how."""

_DONE: dict[tuple[str, str], tuple[object, object, str]] = {}
"""(module, function) -> (the declared function, the original, its comm)."""
_WRAPPED: dict[tuple[str, str], object] = {}
"""(module, function) -> the module's attribute before its first declaration (the hub-kernel wrapper, if any)."""


def torch_fallback(fn: Callable) -> Callable:
    """The torch function under transformers' hub-kernel decorator (`use_kernel_func_from_hub_with_fallback`,
    functools.wraps): with the kernel package installed (flash-linear-attention, causal-conv1d) the decorated name
    calls the package's function, whose arguments are named differently (q/k/v, not query/key/value) and whose
    conventions the declaration does not describe; a declared call passes its arguments by name, so it would fail.
    cpcompile declares and runs the torch fallback, the same math."""
    return inspect.unwrap(fn)


def hf_token_mixers(model: nn.Module, comm: str = "a2a") -> list[str]:
    """Declare the known token mixers of every modeling module `model`'s layers come from; returns the
    `module.function` names declared (already declared ones included). `comm`: "a2a" (head-parallel, every
    layout), "state" (state passing where the function can, strategy "flat" or "zigzag"; Mamba's scans stay "a2a") or
    "auto"
    (where the function can pass state: per call, the comm that moves fewer bytes)."""
    if comm not in COMMS:
        raise ValueError(f"hf_token_mixers: comm={comm!r}; use one of {list(COMMS)}")
    return _declare(model, comm)


def hf_default_mixers(model: nn.Module) -> list[str]:
    """hf_token_mixers(model)'s declarations (comm="a2a") for the known token mixers of `model`'s modeling modules
    that are not declared yet; those declared already keep their comm (a user's hf_token_mixers(model,
    comm="state") before another model is built stays). What attn_implementation="cpcompile" does when a model is
    built (integrations/hf_models.py). Returns the `module.function` names declared, as hf_token_mixers does."""
    return _declare(model, None)


def _declare(model: nn.Module, comm: str | None) -> list[str]:
    """Declare with `comm` (None: "a2a" where not declared yet, else as it is)."""
    names = []
    for module_name in sorted({type(m).__module__ for m in model.modules()}):
        modeling = sys.modules.get(module_name)
        for fn_name, kwargs in HF_MIXERS.items():
            fn = getattr(modeling, fn_name, None)
            if fn is None:
                continue
            key = (module_name, fn_name)
            declared, original, done = _DONE.get(key, (None, torch_fallback(fn), None))
            names.append(f"{module_name}.{fn_name}")
            if comm is None and declared is fn:
                continue
            mode = comm if comm not in (None, "a2a") and fn_name in HF_STATE else "a2a"
            if declared is not fn or done != mode:
                if key not in _DONE:  # the first declaration: what restore_hf_mixers puts back
                    _WRAPPED[key] = fn
                extra = dict(comm=mode, **HF_STATE[fn_name]) if mode != "a2a" else {}
                declared = token_mixer(original, **kwargs, **extra)
                setattr(modeling, fn_name, declared)
                _DONE[key] = (declared, original, mode)
    return names


def restore_hf_mixers(model: nn.Module | type) -> list[str]:
    """Undo the declarations of the modeling modules of `model` (a model, or a model class: its own module): each
    declared function is transformers' own again (the hub-kernel wrapper included), e.g. for a model outside CP in
    the same process that should call a kernel package; returns the `module.function` names restored. A model built
    afterwards with attn_implementation="cpcompile" declares them again."""
    modules = {model.__module__} if isinstance(model, type) else {type(m).__module__ for m in model.modules()}
    names = []
    for module_name in sorted(modules):
        modeling = sys.modules.get(module_name)
        for fn_name in HF_MIXERS:
            declared, original, _ = _DONE.get((module_name, fn_name), (None, None, None))
            if declared is None or getattr(modeling, fn_name, None) is not declared:
                continue
            setattr(modeling, fn_name, _WRAPPED.pop((module_name, fn_name), original))
            del _DONE[(module_name, fn_name)]
            names.append(f"{module_name}.{fn_name}")
    return names

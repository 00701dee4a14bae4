"""Hugging Face hybrids: the token mixers of transformers' modeling files declared by name.

transformers 5.24's linear-attention and SSM layers call module-level torch fallbacks; the ones below are
head-local (channel-local), so `hf_token_mixers(model)` replaces them in the modeling modules of the model's
layers by their declared versions (process-wide, like any declaration; without CP they compute the same).
`comm="state"` declares those that can pass state (the causal conv: a halo of kernel - 1 tokens; the gated delta
rule: its chunk transition) with comm="state" and the others (Mamba's scans) with comm="a2a". The torch
fallback is declared even where transformers would call a kernel package instead (`torch_fallback`).
Packed documents: these fallbacks take `cu_seqlens` in **kwargs and ignore it (their documents mix even in one
process), so they are not declared with `documents=` and a packed call is refused (plan_state.py).
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
    names = []
    for module_name in sorted({type(m).__module__ for m in model.modules()}):
        modeling = sys.modules.get(module_name)
        for fn_name, kwargs in HF_MIXERS.items():
            fn = getattr(modeling, fn_name, None)
            if fn is None:
                continue
            key = (module_name, fn_name)
            declared, original, done = _DONE.get(key, (None, torch_fallback(fn), None))
            mode = comm if comm != "a2a" and fn_name in HF_STATE else "a2a"
            if declared is not fn or done != mode:
                extra = dict(comm=mode, **HF_STATE[fn_name]) if mode != "a2a" else {}
                declared = token_mixer(original, **kwargs, **extra)
                setattr(modeling, fn_name, declared)
                _DONE[key] = (declared, original, mode)
            names.append(f"{module_name}.{fn_name}")
    return names

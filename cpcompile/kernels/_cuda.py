"""Shared checks for the CUDA providers (device, dtype, head dim, optional packages)."""

from __future__ import annotations

import importlib.util

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)


def cuda_half_reason(device: torch.device, dtype: torch.dtype, what: str) -> str | None:
    """None when `device`/`dtype` are CUDA fp16/bf16 and CUDA is usable, else why `what` cannot run."""
    if device.type != "cuda":
        return f"{what} runs on CUDA tensors only, these are on {device}"
    if not torch.cuda.is_available():
        return "CUDA is not available in this process"
    if dtype not in HALF_DTYPES:
        return f"{what} takes float16/bfloat16 q/k/v, not {dtype}"
    return None


def head_dim_reason(head_dim: int, what: str, v_head_dim: int | None = None, distinct_v: bool = False) -> str | None:
    """The head-dim rule of the fused CUDA kernels (cuDNN, FlashAttention-2): multiples of 8, at most 256; v's
    head dim may differ from q/k's (MLA, e.g. 192/128) only for kernels that take that (`distinct_v`)."""
    v = head_dim if v_head_dim is None else v_head_dim
    if v != head_dim and not distinct_v:
        return (
            f"{what} takes one head dim for q, k and v, not q/k {head_dim} with v {v} "
            "(different v head dims run on the cuDNN kernels)"
        )
    for d in (head_dim, v):
        if d % 8 != 0 or d > 256:
            return f"{what} needs a head dim that is a multiple of 8 and at most 256, not {d}"
    return None


def missing_package(module: str, pip_name: str, install: str | None = None) -> str | None:
    """None when `module` can be found (not imported), else a reason that names what to install."""
    if importlib.util.find_spec(module) is None:
        return f"the optional package {pip_name!r} is not installed ({install or 'pip install ' + pip_name})"
    return None


def squeeze_lse(lse: torch.Tensor, rank: int) -> torch.Tensor:
    """Kernels return LSE as (B, H, S) or (B, H, S, 1); the executor uses (B, H, S)."""
    return lse.squeeze(-1) if lse.dim() == rank + 1 else lse

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


def head_dim_reason(head_dim: int, what: str) -> str | None:
    """The head-dim rule of the fused CUDA kernels (cuDNN, FlashAttention-2): a multiple of 8, at most 256."""
    if head_dim % 8 != 0 or head_dim > 256:
        return f"{what} needs a head dim that is a multiple of 8 and at most 256, not {head_dim}"
    return None


def missing_package(module: str, pip_name: str) -> str | None:
    """None when `module` can be imported, else a reason that names the pip package to install."""
    if importlib.util.find_spec(module) is None:
        return f"the optional package {pip_name!r} is not installed (pip install {pip_name})"
    return None


def squeeze_lse(lse: torch.Tensor, rank: int) -> torch.Tensor:
    """Kernels return LSE as (B, H, S) or (B, H, S, 1); the executor uses (B, H, S)."""
    return lse.squeeze(-1) if lse.dim() == rank + 1 else lse

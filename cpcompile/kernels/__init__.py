"""Attention kernel providers behind one interface (see base.AttentionKernel); one provider a module."""

from __future__ import annotations

import torch

from ..errors import CPCompileError
from .base import AttentionKernel
from .cpu_flash import CPUFlashKernel

PROVIDERS: dict[str, AttentionKernel] = {"cpu_flash": CPUFlashKernel()}
KERNEL_NAMES = ("auto", *PROVIDERS)


def resolve_kernel(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The provider name to use for `name` ("auto" or a provider) on this device/dtype, or a clear error."""
    if name == "auto":
        candidates = [p for p in PROVIDERS if PROVIDERS[p].supports(device, dtype) is None]
        if not candidates:
            raise CPCompileError(
                f"no attention kernel provider supports {device.type} tensors of {dtype}. "
                f"Fix: use one of the providers {sorted(PROVIDERS)} on a device and dtype they support."
            )
        return candidates[0]
    if name not in PROVIDERS:
        raise CPCompileError(f"unknown kernel {name!r}. Fix: use one of {list(KERNEL_NAMES)}.")
    reason = PROVIDERS[name].supports(device, dtype)
    if reason is not None:
        raise CPCompileError(f"kernel {name!r} cannot run here: {reason}. Fix: use kernel='auto'.")
    return name


def get_kernel(name: str) -> AttentionKernel:
    return PROVIDERS[name]


__all__ = ["KERNEL_NAMES", "PROVIDERS", "AttentionKernel", "get_kernel", "resolve_kernel"]

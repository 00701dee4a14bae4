"""Attention kernel providers behind one interface (see base.AttentionKernel); one provider a module."""

from __future__ import annotations

import torch

from ..errors import CPCompileError
from .base import AttentionKernel
from .cpu_flash import CPUFlashKernel
from .cudnn import CuDNNKernel
from .flash import FlashKernel
from .flash_attn import FlashAttnPackageKernel
from .te import TransformerEngineKernel

PROVIDERS: dict[str, AttentionKernel] = {
    "cudnn": CuDNNKernel(),
    "flash": FlashKernel(),
    "cpu_flash": CPUFlashKernel(),
    "flash_attn": FlashAttnPackageKernel(),
    "te": TransformerEngineKernel(),
}
KERNEL_NAMES = ("auto", *PROVIDERS)
AUTO_ORDER = ("cudnn", "flash", "cpu_flash")
"""What kernel="auto" tries, fastest first: cuDNN on CUDA (flash when cuDNN cannot take the dtype or head
dim), the CPU flash kernel on CPU. Optional-package providers are only used when named."""


def unsupported_reason(name: str, device: torch.device, dtype: torch.dtype, head_dim: int | None) -> str | None:
    """None when provider `name` can run blocks of this device, dtype and head dim, else why not."""
    provider = PROVIDERS[name]
    reason = provider.supports(device, dtype)
    if reason is None and head_dim is not None and hasattr(provider, "supports_head_dim"):
        reason = provider.supports_head_dim(head_dim)
    return reason


def resolve_kernel(name: str, device: torch.device, dtype: torch.dtype, head_dim: int | None = None) -> str:
    """The provider name to use for `name` ("auto" or a provider) on this device/dtype, or a clear error."""
    if name == "auto":
        reasons = {p: unsupported_reason(p, device, dtype, head_dim) for p in AUTO_ORDER}
        candidates = [p for p, r in reasons.items() if r is None]
        if not candidates:
            why = "; ".join(f"{p}: {r}" for p, r in reasons.items())
            raise CPCompileError(
                f"no attention kernel provider supports {device.type} tensors of {dtype} ({why}). "
                f"Fix: use one of the providers {sorted(PROVIDERS)} on a device and dtype they support."
            )
        return candidates[0]
    if name not in PROVIDERS:
        raise CPCompileError(f"unknown kernel {name!r}. Fix: use one of {list(KERNEL_NAMES)}.")
    reason = unsupported_reason(name, device, dtype, head_dim)
    if reason is not None:
        raise CPCompileError(f"kernel {name!r} cannot run here: {reason}. Fix: use kernel='auto'.")
    return name


def get_kernel(name: str) -> AttentionKernel:
    return PROVIDERS[name]


__all__ = ["AUTO_ORDER", "KERNEL_NAMES", "PROVIDERS", "AttentionKernel", "get_kernel", "resolve_kernel"]

"""Attention kernel providers behind one interface (see base.AttentionKernel); one provider a module."""

from __future__ import annotations

import torch

from ..errors import CPCompileError
from .base import AttentionKernel, VarlenAttentionKernel
from .cpu_flash import CPUFlashKernel
from .cpu_varlen_ref import CPUVarlenReference

PROVIDERS: dict[str, AttentionKernel] = {"cpu_flash": CPUFlashKernel()}
VARLEN_PROVIDERS: dict[str, VarlenAttentionKernel] = {"cpu_varlen_ref": CPUVarlenReference()}
"""Providers for varlen (packed-document) blocks; `kernel=` names either kind, each site takes its own kind."""
KERNEL_NAMES = ("auto", *PROVIDERS, *VARLEN_PROVIDERS)


def resolve_kernel(name: str, device: torch.device, dtype: torch.dtype, varlen: bool = False) -> str:
    """The provider name to use for `name` ("auto" or a provider) on this device/dtype, or a clear error.

    varlen=True picks among the varlen providers (for varlen_attn sites), else among the dense ones.
    """
    providers = VARLEN_PROVIDERS if varlen else PROVIDERS
    kind = "varlen " if varlen else ""
    if name == "auto":
        candidates = [p for p in providers if providers[p].supports(device, dtype) is None]
        if not candidates:
            raise CPCompileError(
                f"no {kind}attention kernel provider supports {device.type} tensors of {dtype}. "
                f"Fix: use one of the providers {sorted(providers)} on a device and dtype they support."
            )
        return candidates[0]
    if name not in providers:
        raise CPCompileError(
            f"unknown {kind}kernel {name!r}. Fix: use 'auto' or one of the {kind}providers {sorted(providers)}."
        )
    reason = providers[name].supports(device, dtype)
    if reason is not None:
        raise CPCompileError(f"kernel {name!r} cannot run here: {reason}. Fix: use kernel='auto'.")
    return name


def get_kernel(name: str) -> AttentionKernel:
    return PROVIDERS[name]


def get_varlen_kernel(name: str) -> VarlenAttentionKernel:
    return VARLEN_PROVIDERS[name]


__all__ = [
    "KERNEL_NAMES",
    "PROVIDERS",
    "VARLEN_PROVIDERS",
    "AttentionKernel",
    "VarlenAttentionKernel",
    "get_kernel",
    "get_varlen_kernel",
    "resolve_kernel",
]

"""Attention kernel providers behind one interface (see base.AttentionKernel); one provider a module.

Dense providers run the blocks of SDPA sites; varlen providers (base.VarlenAttentionKernel) run the blocks
of varlen_attn sites (packed documents). `kernel=` names either kind; each site resolves among its own kind.
"""

from __future__ import annotations

import torch

from ..errors import CPCompileError
from .base import AttentionKernel, VarlenAttentionKernel
from .cpu_flash import CPUFlashKernel
from .cpu_ref import CPUReferenceKernel
from .cpu_varlen_ref import CPUVarlenReference
from .cudnn import CuDNNKernel
from .cudnn_varlen import CuDNNVarlenKernel
from .flash import FlashKernel
from .flash_attn import FlashAttnPackageKernel
from .flash_varlen import FlashVarlenKernel
from .flex_softcap import FlexSoftcapKernel
from .te import TransformerEngineKernel

PROVIDERS: dict[str, AttentionKernel] = {
    "cudnn": CuDNNKernel(),
    "flash": FlashKernel(),
    "cpu_flash": CPUFlashKernel(),
    "cpu_ref": CPUReferenceKernel(),
    "flex_softcap": FlexSoftcapKernel(),
    "flash_attn": FlashAttnPackageKernel(),
    "te": TransformerEngineKernel(),
}
VARLEN_PROVIDERS: dict[str, VarlenAttentionKernel] = {
    "cudnn_varlen": CuDNNVarlenKernel(),
    "flash_varlen": FlashVarlenKernel(),
    "cpu_varlen_ref": CPUVarlenReference(),
}
KERNEL_NAMES = ("auto", *PROVIDERS, *VARLEN_PROVIDERS)
AUTO_ORDER = ("cudnn", "flash", "flex_softcap", "cpu_flash", "cpu_ref")
"""What kernel="auto" tries for dense blocks, fastest first: cuDNN on CUDA (flash when cuDNN cannot take the
dtype, head dim or a sliding window, FlexAttention for softcapped scores), the CPU flash kernel on CPU (the CPU
reference for softcapped scores).
Optional-package providers are only used when named."""
FEATURES = {"window": "sliding windows", "softcap": "softcapped scores"}
"""Optional dense-block features (kernels/base.py): name -> what a refusal calls it."""
VARLEN_AUTO_ORDER = ("flash_varlen", "cudnn_varlen", "cpu_varlen_ref")
"""The varlen providers kernel="auto" weighs (cost/choose.py), in the order that breaks a tie: aten's FA2 varlen
first, then cuDNN THD (when cudnn-frontend's torch ops import), the CPU reference on CPU. cuDNN's kernels are
faster on the GPU, but each call costs more host time (0.77 ms a forward + backward beyond FA2's on kernels/
cudnn_graph's ops, 1.42 ms on the frontend's op: docs/benchmarks.md, "cudnn_varlen vs flash_varlen in the
compiled packed layer"), so where the model cannot tell them apart FA2 wins; cuDNN takes the sites where its GPU
time wins by more than its host time and the tie (a2a's whole-sequence call, long shards)."""


def unsupported_reason(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int | None,
    varlen: bool = False,
    v_head_dim: int | None = None,
    features: tuple[str, ...] = (),
) -> str | None:
    """None when provider `name` can run blocks of this device, dtype and head dims, else why not. `features`:
    optional block features the site needs (FEATURES: "window", "softcap")."""
    provider = (VARLEN_PROVIDERS if varlen else PROVIDERS)[name]
    reason = provider.supports(device, dtype)
    if reason is None and head_dim is not None:
        reason = provider.supports_head_dim(head_dim, v_head_dim)
    for feature in features if reason is None else ():
        if not getattr(provider, f"supports_{feature}", False):
            return f"it takes no {FEATURES[feature]}"
    return reason


def supported_kernels(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int | None = None,
    *,
    varlen: bool = False,
    v_head_dim: int | None = None,
    features: tuple[str, ...] = (),
) -> list[str]:
    """The providers kernel="auto" may pick here, in AUTO_ORDER / VARLEN_AUTO_ORDER, that take the block
    `features` (the cost model chooses among them where there are several, cost/choose.py; resolve_kernel("auto")
    takes the first). A `last_resort` provider (cpu_ref, flex_softcap) is offered only when nothing else runs the
    site."""
    order = VARLEN_AUTO_ORDER if varlen else AUTO_ORDER
    providers = VARLEN_PROVIDERS if varlen else PROVIDERS
    found = [p for p in order if unsupported_reason(p, device, dtype, head_dim, varlen, v_head_dim, features) is None]
    preferred = [p for p in found if not getattr(providers[p], "last_resort", False)]
    return preferred or found


def resolve_kernel(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int | None = None,
    *,
    varlen: bool = False,
    v_head_dim: int | None = None,
    features: tuple[str, ...] = (),
) -> str:
    """The provider name to use for `name` ("auto" or a provider) on this device/dtype, or a clear error.

    varlen=True picks among the varlen providers (for varlen_attn sites), else among the dense ones.
    `v_head_dim` (None: `head_dim`) is v's head dim, which MLA models make differ from q/k's. `features`: the
    optional block features the site needs ("window", "softcap"), which only some providers take.
    """
    providers = VARLEN_PROVIDERS if varlen else PROVIDERS
    kind = "varlen " if varlen else ""
    if name == "auto":
        order = VARLEN_AUTO_ORDER if varlen else AUTO_ORDER
        reasons = {p: unsupported_reason(p, device, dtype, head_dim, varlen, v_head_dim, features) for p in order}
        candidates = [p for p, r in reasons.items() if r is None]
        if not candidates:
            why = "; ".join(f"{p}: {r}" for p, r in reasons.items())
            needs = "".join(f" with {FEATURES[f]}" for f in features)
            raise CPCompileError(
                f"no {kind}attention kernel provider supports {device.type} tensors of {dtype}{needs} ({why}). "
                f"Fix: use one of the {kind}providers {sorted(providers)} on a device and dtype they support."
            )
        return candidates[0]
    if name not in providers:
        raise CPCompileError(
            f"unknown {kind}kernel {name!r}. Fix: use 'auto' or one of the {kind}providers {sorted(providers)}."
        )
    reason = unsupported_reason(name, device, dtype, head_dim, varlen, v_head_dim, features)
    if reason is not None:
        raise CPCompileError(f"kernel {name!r} cannot run here: {reason}. Fix: use kernel='auto'.")
    return name


def get_kernel(name: str) -> AttentionKernel:
    return PROVIDERS[name]


def get_varlen_kernel(name: str) -> VarlenAttentionKernel:
    return VARLEN_PROVIDERS[name]


__all__ = [
    "AUTO_ORDER",
    "KERNEL_NAMES",
    "PROVIDERS",
    "VARLEN_PROVIDERS",
    "AttentionKernel",
    "VarlenAttentionKernel",
    "get_kernel",
    "get_varlen_kernel",
    "resolve_kernel",
    "supported_kernels",
]

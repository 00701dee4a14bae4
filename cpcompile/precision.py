"""The one precision rule: partial attention results and gradients are combined in at least fp32.

A CP rank produces partial outputs (one per block) and partial gradients (one per block, and one per rank for
gathered K/V). Merging outputs by log-sum-exp, summing dq pieces, and reducing dK/dV across ranks in the input
dtype would add one bf16 rounding per partial on top of the kernel's; in fp32 (fp64 for fp64 inputs) the CP
result rounds once, at the end, like the single-device one (ring-flash-attn does the same).
"""

from __future__ import annotations

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial results of `dtype` inputs are merged, summed and reduced across ranks in."""
    return torch.promote_types(dtype, torch.float32)

"""The sequence-dim argument of the sharding helpers: checked, never wrapped silently."""

from __future__ import annotations

import torch

from ..errors import CPCompileError


def checked_dim(x: torch.Tensor, dim: int, helper: str, name: str = "seq_dim") -> int:
    """`dim` as a non-negative index of `x`, or a CPCompileError when `x` has no such dim (a dim modulo the
    rank would shard the wrong dim: half the batch, or the hidden dim)."""
    if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise CPCompileError(
            f"{helper}: {name}={dim!r} is out of range for a tensor of shape {tuple(x.shape)} ({x.dim()} dims). "
            f"Fix: pass the index of the sequence dim ({name}=1 for (batch, seq, ...), 0 for packed (tokens, ...))."
        )
    return dim % x.dim()

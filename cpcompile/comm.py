"""Differentiable collectives on the sequence dim, written with functional collectives so they trace."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

# torch 2.13 renamed the functional collectives (`*_single`); torch 2.11 only has the older names.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def grad_reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    """Gradients of gathered tensors are summed across ranks in at least fp32.

    Summing cp partial dK/dV in bf16 adds one rounding per rank on top of the kernel's; in fp32 the CP
    gradient stays as accurate as the single-device one (ring-flash-attn does the same).
    """
    return torch.promote_types(dtype, torch.float32)


class _GatherSeqFirst(torch.autograd.Function):
    """all-gather along dim 0 in the input dtype; backward reduce-scatters (sums) in grad_reduce_dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str) -> torch.Tensor:
        ctx.group_name, ctx.dtype = group_name, x.dtype
        return funcol.wait_tensor(_all_gather(x, 0, group_name))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        summed = _reduce_scatter(grad.contiguous().to(grad_reduce_dtype(ctx.dtype)), "sum", 0, ctx.group_name)
        return funcol.wait_tensor(summed).to(ctx.dtype), None


def gather_seq_first(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """All-gather `x` (tokens on dim 0) rank-major along dim 0; backward reduce-scatters the gradient.

    Tokens on dim 0 make every run of consecutive ranks' tokens one contiguous slice of the result.
    """
    return _GatherSeqFirst.apply(x.contiguous(), group_name)


def gather_kv(k: torch.Tensor, v: torch.Tensor, group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather K and V (.., S, D) along S in one collective when their shapes match.

    Returns views shaped like the inputs with S multiplied by the group size, whose storage is token-major,
    so any key range that spans consecutive ranks is a strided view with no copy.
    """
    if k.shape == v.shape and k.dtype == v.dtype:
        kv = torch.stack((k.movedim(-2, 0), v.movedim(-2, 0)), dim=1)  # (S, 2, ..., D)
        gathered = gather_seq_first(kv, group_name)
        return gathered[:, 0].movedim(0, -2), gathered[:, 1].movedim(0, -2)
    return (
        gather_seq_first(k.movedim(-2, 0), group_name).movedim(0, -2),
        gather_seq_first(v.movedim(-2, 0), group_name).movedim(0, -2),
    )

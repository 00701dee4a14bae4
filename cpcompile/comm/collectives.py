"""Collectives on dim 0 over functional collectives, so they trace; the regions own their autograd."""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from .route import hop, on_host

# torch 2.13 renamed the functional collectives (`*_single`); torch 2.11 only has the older names.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def _waited(t: torch.Tensor) -> torch.Tensor:
    """Eager funcol returns an AsyncCollectiveTensor; traced funcol already inserted its wait."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _run(complete, x: torch.Tensor) -> torch.Tensor:
    """`complete(x)`, or through the host (comm/route.py)."""
    return hop(complete, x) if on_host() else complete(x)


def all_gather_dim0(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Plain (non-differentiable) all-gather along dim 0, rank-major (regions own their autograd)."""
    return _run(lambda t: _waited(_all_gather(t, 0, group_name)), x.contiguous())


def reduce_scatter_dim0(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Plain reduce-scatter (sum) along dim 0: this rank's slice of the sum over ranks."""
    return _run(lambda t: _waited(_reduce_scatter(t, "sum", 0, group_name)), x.contiguous())


def slots_tokens_first(x: torch.Tensor, slots: int) -> torch.Tensor:
    """(B, H, slots*C, D) -> (C, slots, B, H, D): tokens outermost, the slot of a token next."""
    b, h, s, d = x.shape
    return x.view(b, h, slots, s // slots, d).permute(3, 2, 0, 1, 4)


class _ExchangeFirst(torch.autograd.Function):
    """all-to-all along dim 0 with equal splits; an equal-split all-to-all is its own inverse, so backward
    sends the gradient the same way back. Written as a Function (like the regions' gather + attend Functions) so
    the traced graph is the same on torch 2.11 and 2.13, whatever autograd funcol registers there."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str) -> torch.Tensor:
        ctx.group_name = group_name
        return _run(lambda t: _waited(funcol.all_to_all_single(t, None, None, group_name)), x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _run(lambda t: _waited(funcol.all_to_all_single(t, None, None, ctx.group_name)), grad.contiguous()), None


def exchange_first(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """All-to-all of `x` (cp, ...): block j goes to rank j, and block j of the result came from rank j.

    Differentiable; gradients are not summed (each element has exactly one owner), so they travel in x's dtype.
    """
    return _ExchangeFirst.apply(x.contiguous(), group_name)


def exchange_uneven(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group_name: str) -> torch.Tensor:
    """Plain all-to-all along dim 0 with static splits: rows [sum(in_splits[:j]), sum(in_splits[:j+1])) go to rank
    j, and the result holds out_splits[j] rows from rank j there. The regions own their autograd."""
    return _run(lambda t: _waited(funcol.all_to_all_single(t, out_splits, in_splits, group_name)), x.contiguous())


def exchange_slots(x: torch.Tensor, splits: list[int], group_name: str) -> torch.Tensor:
    """`exchange_uneven` with the same `splits` sent and received. Symmetric, so the way back (the gradient's) is
    the same call."""
    return exchange_uneven(x, splits, splits, group_name)

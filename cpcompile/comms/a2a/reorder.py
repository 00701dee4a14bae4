"""Token permutations whose inverse is known: a gather each way.

`x.index_select(0, index)` differentiates into an index_add of the gradient into zeros: a scatter with atomic
adds, which on bf16 ran at ~90 us a call on the H100 (four a step for a2a/thd_balanced's reorder, 0.37 ms of
its 4.8 ms: bench/results/logs/profile_layer_thd_balanced_h100.txt). When `index` is a permutation, its
gradient is a gather through the inverse permutation: no atomics, no zero fill, the same kernel as forward.
"""

from __future__ import annotations

import torch


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.dim = dim
        return x.index_select(dim, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(ctx.dim, inverse), None, None, None


def permute_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """x.index_select(dim, index) for a PERMUTATION `index` of x's `dim` whose inverse is `inverse`
    (inverse[index[i]] = i), with a gather, not a scatter-add, as its backward. Exact only for a permutation:
    the callers' index is one by construction (a plan the run-time guard checked tiles [0, T))."""
    return _PermuteRows.apply(x, index, inverse, dim)

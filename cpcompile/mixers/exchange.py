"""The sequence<->heads all-to-all of a mixer region, for any tensors: tokens on one dim, heads on another.

`to_heads`: this rank's tokens of every head -> every token (in GLOBAL order) of this rank's heads/cp heads.
`to_tokens`: the way back. The tensors of one dtype travel in ONE equal-split all-to-all (packed side by side
per token, as the attention a2a packs q/k/v: comms/a2a/head_parallel.exchange_side_by_side, differentiable,
routed like every collective). The received buffer is rank-major: rank p's local chunks in local order (flat:
already global order; zigzag: chunks p and 2cp-1-p), so a layout with several chunks a rank reorders it into
global order with one copy before the mixer runs and back after, since a scan must see its tokens in order.
`MixerHeads` is this exchange as comms/a2a/head_parallel.head_parallel takes it (mixers/region.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..comm.collectives import all_gather_dim0, reduce_scatter_dim0
from ..comms.a2a.head_parallel import exchange_side_by_side
from ..layouts import ChunkLayout


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous copy of the gradient. The views between the mixer and the
    all-to-all are traced at the gradients' traced strides; a gradient that arrives at run time with other
    strides (the user's code decides them: seen under flat, where no reorder copy sits in between) would break a
    view that the trace took for free. A fresh contiguous gradient has the same strides traced and run."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.clone(memory_format=torch.contiguous_format)


def dense_grad(x: torch.Tensor) -> torch.Tensor:
    """x (contiguous), whose gradient is handed on as a contiguous copy (see _DenseGrad): around a state-passing
    region's token inputs and outputs, where the gradients cross between the mixer's code and the caller's."""
    return _DenseGrad.apply(x.contiguous())


def _front(x: torch.Tensor, heads_dim: int, seq_dim: int) -> tuple[torch.Tensor, list[int]]:
    """x permuted to (heads, seq, rest...) and the permutation (to undo it)."""
    heads_dim, seq_dim = heads_dim % x.dim(), seq_dim % x.dim()
    perm = [heads_dim, seq_dim, *(d for d in range(x.dim()) if d not in (heads_dim, seq_dim))]
    return x.permute(perm), perm


def _back(x: torch.Tensor, perm: list[int]) -> torch.Tensor:
    inverse = [0] * len(perm)
    for i, d in enumerate(perm):
        inverse[d] = i
    return x.permute(inverse)


def _reorder(x: torch.Tensor, order: list[int] | None, dim: int = 1) -> torch.Tensor:
    """x with n*C along `dim` (default: (h, n*C, ...)), chunk i of the result = chunk order[i] of x: one copy
    (None: x as it is)."""
    if order is None:
        return x
    chunks = x.unflatten(dim, (len(order), -1))
    return torch.cat([chunks.select(dim, i) for i in order], dim=dim)


def _orders(layout: ChunkLayout, world: int) -> tuple[list[int], list[int]] | None:
    """(for each global chunk its rank-major index, for each rank-major chunk its global id); None: the same."""
    order = layout.unshard_chunk_order(world)
    if order == sorted(order):
        return None
    gathered = [0] * len(order)
    for g, j in enumerate(order):
        gathered[j] = g
    return order, gathered


def _exchange(blocks: list[torch.Tensor], group_name: str) -> list[torch.Tensor]:
    """One all-to-all per dtype of (world, n, h, rest...) blocks (block j to rank j); the received blocks."""
    flat = [b.flatten(2) for b in blocks]  # (world, n, h*rest)
    return [part.view(b.shape) for part, b in zip(exchange_side_by_side(flat, group_name), blocks)]


def to_heads(
    xs: list[torch.Tensor], heads_dim: int, seq_dim: int, layout: ChunkLayout, group_name: str, world: int
) -> list[torch.Tensor]:
    """This rank's L tokens of H heads -> all world*L tokens, in global order, of heads [rank*H/world, ...)."""
    fronts = [_front(x, heads_dim, seq_dim) for x in xs]
    # block j: rank j's heads of this rank's tokens, token-major (world, n, h/world, rest)
    blocks = [f.unflatten(0, (world, -1)).transpose(1, 2) for f, _ in fronts]
    orders = _orders(layout, world)
    out = []
    for got, (_, perm) in zip(_exchange(blocks, group_name), fronts):  # block j: rank j's tokens, my heads
        seq = got.permute(2, 0, 1, *range(3, got.dim())).flatten(1, 2)  # (h/world, world*n, rest): rank-major
        whole = _back(seq if orders is None else _reorder(seq, orders[0]), perm)
        out.append(_DenseGrad.apply(whole.contiguous()))  # the mixer may .view() its inputs, as it could before
    return out


def to_tokens(
    ys: list[torch.Tensor], heads_dim: int, seq_dim: int, layout: ChunkLayout, group_name: str, world: int
) -> list[torch.Tensor]:
    """The inverse of to_heads: every token of this rank's heads -> this rank's tokens of every head."""
    fronts = [_front(y, heads_dim, seq_dim) for y in ys]
    orders = _orders(layout, world)
    blocks = []
    for f, _ in fronts:
        f = f if orders is None else _reorder(f, orders[1])  # global order -> rank-major
        blocks.append(f.unflatten(1, (world, -1)).permute(1, 2, 0, *range(3, f.dim() + 1)))  # (world, n, h, rest)
    out = []
    for got, (_, perm) in zip(_exchange(blocks, group_name), fronts):  # block j: my tokens, rank j's heads
        mine = _back(got.transpose(1, 2).flatten(0, 1), perm)  # (H, n, rest) in the caller's dims
        out.append(_DenseGrad.apply(mine.contiguous()))  # callers .view() a mixer's outputs (FalconH1 does)
    return out


@dataclass(frozen=True)
class MixerHeads:
    """A mixer region's exchange (comms/a2a/head_parallel.HeadExchange): token tensors with heads on `heads_dim`
    and tokens on `seq_dim`, every token of this rank's heads in global order (to_heads / to_tokens)."""

    heads_dim: int
    seq_dim: int
    layout: ChunkLayout
    group_name: str
    world: int

    def to_heads(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return to_heads(list(inputs), self.heads_dim, self.seq_dim, self.layout, self.group_name, self.world)

    def to_tokens(self, outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return to_tokens(list(outputs), self.heads_dim, self.seq_dim, self.layout, self.group_name, self.world)


class _GatherTokens(torch.autograd.Function):
    """All of a shared input's tokens, in global order, on every rank; backward sums the ranks' gradients and
    hands each rank its own tokens' (a reduce-scatter), since every rank's heads read every token."""

    @staticmethod
    def forward(ctx, x, seq_dim, layout, group_name, world):
        ctx.args = (seq_dim, layout, group_name, world)
        orders = _orders(layout, world)
        rank_major = all_gather_dim0(x.movedim(seq_dim, 0), group_name)
        return _reorder(rank_major, None if orders is None else orders[0], dim=0).movedim(0, seq_dim).contiguous()

    @staticmethod
    def backward(ctx, grad):
        seq_dim, layout, group_name, world = ctx.args
        orders = _orders(layout, world)
        rank_major = _reorder(grad.movedim(seq_dim, 0), None if orders is None else orders[1], dim=0)
        return reduce_scatter_dim0(rank_major, group_name).movedim(0, seq_dim).contiguous(), None, None, None, None


def gather_tokens(x: torch.Tensor, seq_dim: int, layout: ChunkLayout, group_name: str, world: int) -> torch.Tensor:
    """This rank's L tokens of a shared (headless) input -> all world*L tokens in global order, every rank."""
    return _GatherTokens.apply(x, seq_dim % x.dim(), layout, group_name, world)

"""The collectives of state passing, each differentiable with its own backward (the regions own their autograd).

`from_previous`: the previous rank's tensor (zeros on rank 0): a send to rank + 1 (comm.pending's shift, an
all-to-all with one non-empty split); its backward sends the gradient to rank - 1. A conv's halo.
`shifted`: rank - offset's tensor (every rank sends to rank + offset): the halo sends of a layout whose ranks own
several chunks (mixers/chain.py); its backward sends the gradient back by -offset. No rank is special: a rank
that reads nothing of it still sends and receives (its result tied to the output with `attach`).
`gather_states`: every rank's tensor (a small chunk transition), rank-major; backward: the sum over ranks of
each slot's gradient lands on its owner (a reduce-scatter), since every later rank reads a rank's transition.
"""

from __future__ import annotations

import torch

from ..comm.collectives import all_gather_dim0, reduce_scatter_dim0
from ..comm.pending import in_backward, start_shift, wait


def _shift(x: torch.Tensor, group_name: str, rank: int, world: int, offset: int) -> torch.Tensor:
    return wait(start_shift(x, group_name, rank, world, offset)).view(x.shape)


class _FromPrevious(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_name, rank, world):
        ctx.args = (group_name, rank, world)
        got = _shift(x, group_name, rank, world, 1)
        return torch.zeros_like(got) if rank == 0 else got  # rank 0 reads the zero padding before the sequence

    @staticmethod
    def backward(ctx, grad):
        group_name, rank, world = ctx.args
        grad = torch.zeros_like(grad) if rank == 0 else grad.contiguous()
        return _shift(grad, group_name, rank, world, -1), None, None, None


def from_previous(x: torch.Tensor, group_name: str, rank: int, world: int) -> torch.Tensor:
    """Rank - 1's `x` (the same shape on every rank); zeros on rank 0."""
    return _FromPrevious.apply(x.contiguous(), group_name, rank, world)


class _Shifted(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, anchor, group_name, rank, world, offset):
        ctx.args = (group_name, rank, world, offset)
        return _shift(x, group_name, rank, world, offset)

    @staticmethod
    def backward(ctx, grad):
        group_name, rank, world, offset = ctx.args
        return _shift(grad.contiguous(), group_name, rank, world, -offset), None, None, None, None, None


def shifted(x: torch.Tensor, anchor: torch.Tensor, group_name: str, rank: int, world: int, offset: int) -> torch.Tensor:
    """Rank - offset's `x` (the same shape on every rank), sent while this rank's goes to rank + offset. `anchor`
    (the token input the tails come from) is not read: it gives the shift a backward on every rank whenever the
    tokens need a gradient, also where `x` is all zero padding (a rank with nothing to send), so every rank joins
    the backward's reverse shift."""
    return _Shifted.apply(x.contiguous(), anchor, group_name, rank, world, offset)


class _GatherStates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_name, world):
        ctx.args = (group_name, world)
        return all_gather_dim0(x.unsqueeze(0), group_name)

    @staticmethod
    def backward(ctx, grad):
        group_name, _ = ctx.args
        return reduce_scatter_dim0(grad.contiguous(), group_name).squeeze(0), None, None


def gather_states(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    """(world, *x.shape): every rank's `x`, rank-major."""
    return _GatherStates.apply(x.contiguous(), group_name, world)


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, unread):
        ctx.unread = (unread.shape, unread.dtype, unread.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.unread
        # tied to the backward: a zero built from nothing would be moved into the forward with its collective
        return grad, in_backward(torch.zeros(shape, dtype=dtype, device=device), grad)


def attach(out: torch.Tensor, unread: torch.Tensor) -> torch.Tensor:
    """`out`, with `unread` (a collective's result this rank does not read: rank 0's gathered states, a shift's
    tails that no chunk of this rank follows) given a zero
    gradient, so that the collective's backward runs on this rank as on the others (every rank must join it)."""
    return _Attach.apply(out, unread)

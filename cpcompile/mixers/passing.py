"""The collectives of state passing, each differentiable with its own backward (the regions own their autograd).

Every rank must issue the same collectives in the same order, forward and backward. Under Inductor the order is
only what the data imposes (its peak-memory pass reorders independent nodes, and the ranks' graphs differ: rank 0
reads no earlier state), and identical nodes are merged (CSE), so:
- no collective's input is a constant on some rank (a constant sent by two layers is ONE node there: a rank with
  nothing to send pads with a real tensor, and zero gradients are cut from one buffer, see `attach`);
- a region's collectives are chained (`after`: each one's input waits for the previous one's result, forward and
  backward), and its output depends on every result, read or not (`attach`), so the next region's collectives
  follow them on every rank; backward, each region's collectives wait for the gradient of its output.

`shifts`: per tensor and offset, rank - offset's tensor (every rank sends to rank + offset): the halo sends
(mixers/chain.py); backward sends each gradient back by -offset. No rank is special: a rank that reads nothing of
a result still sends and receives (the result tied to the output with `attach`).
`gather_states`: every rank's tensor (a small chunk transition), rank-major; backward: the sum over ranks of
each slot's gradient lands on its owner (a reduce-scatter), since every later rank reads a rank's transition.
"""

from __future__ import annotations

import torch

from ..comm.collectives import all_gather_dim0, reduce_scatter_dim0
from ..comm.pending import in_backward, start_shift, wait


@torch.library.custom_op("cpcompile::mixer_after", mutates_args=())
def after(x: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """A copy of `x`, computed once `token` exists (`token` is not read): a data dependency that orders a
    collective after another one on every rank, whatever Inductor's scheduler would otherwise choose."""
    return x.clone()


@after.register_fake
def _after_fake(x, token):
    return torch.empty_like(x)


def _shift(x: torch.Tensor, group_name: str, rank: int, world: int, offset: int) -> torch.Tensor:
    return wait(start_shift(x, group_name, rank, world, offset)).view(x.shape)


def _chained_shifts(xs, offsets, group_name: str, rank: int, world: int) -> list[torch.Tensor]:
    """Each x of `xs` shifted by its offset, in order, each send waiting for the previous result."""
    got: list[torch.Tensor] = []
    for x, offset in zip(xs, offsets):
        x = x.contiguous() if not got else after(x.contiguous(), got[-1])
        got.append(_shift(x, group_name, rank, world, offset))
    return got


class _Shifts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, offsets, group_name, rank, world, *xs):
        ctx.args = (offsets, group_name, rank, world)
        return tuple(_chained_shifts(xs, offsets, group_name, rank, world))

    @staticmethod
    def backward(ctx, *grads):
        offsets, group_name, rank, world = ctx.args
        back = _chained_shifts(grads, [-o for o in offsets], group_name, rank, world)
        return None, None, None, None, *back


def shifts(xs: list[torch.Tensor], offsets: list[int], group_name: str, rank: int, world: int) -> list[torch.Tensor]:
    """Rank - offset's x for each x of `xs` (the same shape on every rank) and its offset, sent while this rank's
    goes to rank + offset: one chain of shifts, the same on every rank (`xs` carry padding, never a constant)."""
    return list(_Shifts.apply(list(offsets), group_name, rank, world, *xs))


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
    def forward(ctx, out, *unread):
        ctx.unread = [(u.shape, u.numel(), u.dtype) for u in unread]
        ctx.like = (torch.promote_types(unread[0].dtype, torch.float32), unread[0].device)
        return after(out, unread[-1])

    @staticmethod
    def backward(ctx, grad):
        dtype, device = ctx.like
        total = sum(n for _, n, _ in ctx.unread)
        # tied to the backward: a zero built from nothing would be moved into the forward with its collective.
        # ONE buffer cut into a piece per tensor: separate zeros of one shape would be one node to CSE, and their
        # reverse collectives (identical inputs) one collective, on this rank only
        zeros = in_backward(torch.zeros(total, dtype=dtype, device=device), grad).split([n for _, n, _ in ctx.unread])
        return grad, *(z.view(shape).to(kind) for z, (shape, _, kind) in zip(zeros, ctx.unread))


def attach(out: torch.Tensor, unread: list[torch.Tensor]) -> torch.Tensor:
    """A copy of `out` computed after the last of `unread` (collectives' results this rank does not read: rank 0's
    gathered states, a shift's tails that no chunk of this rank follows; a region's collectives are chained, so the
    last follows every earlier one), each given a zero gradient, so that each collective's backward runs on this
    rank as on the others and the next collectives follow these (every rank must join them in one order)."""
    if not unread:
        return out
    return _Attach.apply(out, *unread)

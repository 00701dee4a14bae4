"""The sequence<->heads all-to-all of a mixer region, for any tensor: its tokens on one dim, heads on another.

`to_heads`: this rank's tokens of every head -> every token (in GLOBAL order) of this rank's heads/cp heads.
`to_tokens`: the way back. One equal-split all-to-all each (comm.collectives.exchange_first, differentiable;
through comm/route.py like every collective). The received buffer is rank-major: rank p's local chunks in local
order (flat: already global order; zigzag: chunks p and 2cp-1-p), so a chunk layout with several chunks a rank
reorders it into global order with one copy before the mixer runs and back after, as a scan must see its tokens
in order.
"""

from __future__ import annotations

import torch

from ..comm.collectives import exchange_first
from ..layouts import ChunkLayout


def _front(x: torch.Tensor, heads_dim: int, seq_dim: int) -> tuple[torch.Tensor, list[int]]:
    """x permuted to (heads, seq, rest...) and the permutation (to undo it)."""
    rest = [d for d in range(x.dim()) if d not in (heads_dim, seq_dim)]
    perm = [heads_dim, seq_dim, *rest]
    return x.permute(perm), perm


def _back(x: torch.Tensor, perm: list[int]) -> torch.Tensor:
    inverse = [0] * len(perm)
    for i, d in enumerate(perm):
        inverse[d] = i
    return x.permute(inverse)


def _global_order(layout: ChunkLayout, world: int) -> list[int] | None:
    """For each global chunk, its index in the rank-major buffer (None: the buffer is in global order)."""
    order = layout.unshard_chunk_order(world)
    return None if order == sorted(order) else order


def _reorder(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    """(h, n*C, ...) with chunk i of the result = chunk order[i] of x: one copy."""
    chunks = x.unflatten(1, (len(order), -1))
    return torch.cat([chunks[:, i] for i in order], dim=1)


def to_heads(
    x: torch.Tensor, heads_dim: int, seq_dim: int, layout: ChunkLayout, group_name: str, world: int
) -> torch.Tensor:
    """This rank's L tokens of H heads -> all world*L tokens, in global order, of heads [rank*H/world, ...)."""
    front, perm = _front(x, heads_dim % x.dim(), seq_dim % x.dim())
    h = front.shape[0]
    blocks = front.unflatten(0, (world, h // world))  # block j: rank j's heads, this rank's tokens
    got = exchange_first(blocks, group_name)  # block j: rank j's tokens, this rank's heads
    seq = got.transpose(0, 1).flatten(1, 2)  # (h/world, world*n, rest): rank-major tokens
    order = _global_order(layout, world)
    if order is not None:
        seq = _reorder(seq, order)
    return _back(seq, perm)


def to_tokens(
    y: torch.Tensor, heads_dim: int, seq_dim: int, layout: ChunkLayout, group_name: str, world: int
) -> torch.Tensor:
    """The inverse of to_heads: every token of this rank's heads -> this rank's tokens of every head."""
    front, perm = _front(y, heads_dim % y.dim(), seq_dim % y.dim())
    order = _global_order(layout, world)
    if order is not None:  # global order -> rank-major: rank-major chunk j is global chunk gathered[j]
        inverse = [0] * len(order)
        for g, j in enumerate(order):
            inverse[j] = g
        front = _reorder(front, inverse)
    s = front.shape[1]
    blocks = front.unflatten(1, (world, s // world)).transpose(0, 1)  # block j: rank j's tokens, my heads
    got = exchange_first(blocks, group_name)  # block j: my tokens, rank j's heads
    return _back(got.flatten(0, 1), perm)

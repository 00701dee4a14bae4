"""The relayout region: a token tensor moved from one chunk layout to another (zigzag -> flat before a run of
token mixers, flat -> zigzag after it) in ONE all-to-all, forward and backward.

A relayout is a permutation of the sequence's chunks: every chunk of the source layout has one owner under the
destination layout. Both layouts are refined to chunks of a common size (`fine` chunks: zigzag's halves of a flat
chunk), each rank sends each of its fine chunks to the rank that owns it under the destination (its own ones too,
inside the same all-to-all), in the order the receiver holds them, and puts what it receives in place. The
backward is the inverse permutation: the gradient goes back by the relayout the other way. Nothing is added or
rounded, so it is exact in every dtype. `relayout_routes` is the index math (pure, the same on every rank);
relayout_plan.py decides where relayouts go.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..comm.collectives import exchange_uneven
from ..layouts import ChunkLayout, get_layout
from .passing import after


@dataclass(frozen=True)
class RelayoutRoutes:
    """One rank's part of a relayout, in fine chunks (`fine` of them a rank): per peer rank the local fine chunks
    sent to it (source slots, in the receiver's order), and per peer the destination slots its chunks fill."""

    fine: int
    sends: tuple[tuple[int, ...], ...]
    recvs: tuple[tuple[int, ...], ...]


def _fine_owners(layout: ChunkLayout, cp: int, fine: int) -> dict[int, tuple[int, int]]:
    """Each fine chunk id -> (its owner under `layout`, its local fine slot there)."""
    per = fine // layout.chunks_per_rank
    owners = {}
    for p in range(cp):
        slot = 0
        for c in layout.rank_chunks(p, cp):
            for f in range(c * per, (c + 1) * per):
                owners[f] = (p, slot)
                slot += 1
    return owners


def relayout_routes(src: ChunkLayout, dst: ChunkLayout, cp: int, rank: int) -> RelayoutRoutes:
    """Rank `rank`'s sends and receives moving a tensor from `src` to `dst` on `cp` ranks."""
    fine = math.lcm(src.chunks_per_rank, dst.chunks_per_rank)
    before, after = _fine_owners(src, cp, fine), _fine_owners(dst, cp, fine)
    sends: list[list[tuple[int, int]]] = [[] for _ in range(cp)]
    recvs: list[list[int]] = [[] for _ in range(cp)]
    for f in sorted(before):
        (p, s), (q, d) = before[f], after[f]
        if p == rank:
            sends[q].append((d, s))
        if q == rank:
            recvs[p].append(d)
    return RelayoutRoutes(
        fine, tuple(tuple(s for _, s in sorted(pairs)) for pairs in sends), tuple(tuple(sorted(r)) for r in recvs)
    )


def received_tokens(src: ChunkLayout, dst: ChunkLayout, cp: int, local_len: int) -> int:
    """The most tokens one rank receives from OTHER ranks in one relayout (its own chunks do not cross the wire)."""
    fine = math.lcm(src.chunks_per_rank, dst.chunks_per_rank)
    worst = 0
    for p in range(cp):
        routes = relayout_routes(src, dst, cp, p)
        worst = max(worst, sum(len(r) for q, r in enumerate(routes.recvs) if q != p))
    return worst * local_len // fine


def _pick(chunks: torch.Tensor, order: list[int]) -> torch.Tensor:
    """chunks (n, ...) in `order` along dim 0: one copy (none when in order)."""
    if order == list(range(chunks.shape[0])):
        return chunks
    return torch.stack([chunks[i] for i in order])


def _move(x: torch.Tensor, seq_dim: int, src: str, dst: str, group_name: str, rank: int, world: int) -> torch.Tensor:
    """x's tokens (on `seq_dim`) from layout `src` to layout `dst`: one all-to-all with static uneven splits."""
    routes = relayout_routes(get_layout(src), get_layout(dst), world, rank)
    rows = x.movedim(seq_dim, 0)
    chunks = rows.unflatten(0, (routes.fine, -1))
    size = chunks.shape[1]
    order = [s for peer in routes.sends for s in peer]
    send = _pick(chunks, order)
    got = exchange_uneven(
        send.flatten(0, 1),
        [len(r) * size for r in routes.recvs],
        [len(s) * size for s in routes.sends],
        group_name,
    ).unflatten(0, (routes.fine, size))
    arrived = [d for peer in routes.recvs for d in peer]  # the destination slot of each received chunk
    place = [arrived.index(d) for d in range(routes.fine)]
    got = _pick(got, place)
    return got.flatten(0, 1).movedim(0, seq_dim).contiguous()


def _moves(xs, seq_dims, src: str, dst: str, group_name: str, rank: int, world: int) -> list[torch.Tensor]:
    """Each x moved, ONE chain of all-to-alls: each send waits for the previous result, and every result but the
    last is handed on after the last (passing.after), so every rank issues them in one order and the collectives
    that read any of them follow all of them, under any scheduler (passing.py says why)."""
    got: list[torch.Tensor] = []
    for x, dim in zip(xs, seq_dims):
        x = x if not got else after(x.contiguous(), got[-1])
        got.append(_move(x, dim, src, dst, group_name, rank, world))
    return [after(t, got[-1]) for t in got[:-1]] + got[-1:]


class _Relayout(torch.autograd.Function):
    """The permutations forward, their inverses on the gradients (of the floating-point tensors), one chain each
    way."""

    @staticmethod
    def forward(ctx, seq_dims, src, dst, group_name, rank, world, *xs):
        ctx.args = (seq_dims, src, dst, group_name, rank, world)
        ctx.floating = [x.is_floating_point() or x.is_complex() for x in xs]
        return tuple(_moves(xs, seq_dims, src, dst, group_name, rank, world))

    @staticmethod
    def backward(ctx, *grads):
        seq_dims, src, dst, group_name, rank, world = ctx.args
        picked = [i for i, f in enumerate(ctx.floating) if f]
        back = _moves(
            [grads[i].contiguous() for i in picked], [seq_dims[i] for i in picked], dst, src, group_name, rank, world
        )
        out: list[torch.Tensor | None] = [None] * len(grads)
        for i, g in zip(picked, back):
            out[i] = g
        return None, None, None, None, None, None, *out


def relayout(
    *xs: torch.Tensor, seq_dims: tuple[int, ...], src: str, dst: str, group_name: str, rank: int, world: int
) -> tuple[torch.Tensor, ...]:
    """The relayout region: each x of `xs`, this rank's tokens under layout `src` on its dim of `seq_dims`, as
    this rank's tokens under layout `dst` (a graph node; differentiable: each gradient goes back by the inverse
    relayout)."""
    dims = tuple(d % x.dim() for x, d in zip(xs, seq_dims))
    return _Relayout.apply(dims, src, dst, group_name, rank, world, *xs)

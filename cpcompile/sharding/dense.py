"""Sharding for the chunk layouts (flat, zigzag): cut a global sequence into this rank's chunks, and back."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..comm.collectives import all_gather_dim0
from ..errors import CPCompileError
from ..layouts import ChunkLayout, get_layout
from ..mesh import CPGroup
from .dims import checked_dim


def check_length(seq_len: int, layout: ChunkLayout, cp: int, what: str) -> None:
    """A CPCompileError with the padding fix when `seq_len` does not split into the layout's equal chunks."""
    need = layout.required_multiple(cp)
    if seq_len % need:
        pad = -seq_len % need
        raise CPCompileError(
            f"{what} has {seq_len} tokens; layout {layout.name!r} with cp={cp} needs a multiple of {need}. "
            f"Fix: pad {pad} more tokens (cpcompile.pad_to_multiple(x, {need}, dim=...), with labels padded "
            "by an ignored index) before sharding."
        )


def pad_to_multiple(x: torch.Tensor, multiple: int, dim: int, value: float = 0) -> torch.Tensor:
    """Pad `x` at the end of `dim` with `value` up to the next multiple of `multiple` (no-op when it fits).

    Use it before shard() for lengths a layout cannot take; pad labels with the loss's ignore index.
    """
    if not isinstance(multiple, int) or multiple < 1:
        raise CPCompileError(f"pad_to_multiple needs an integer multiple >= 1, got {multiple!r}.")
    dim = checked_dim(x, dim, "pad_to_multiple", "dim")
    extra = -x.shape[dim] % multiple
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - dim - 1) + [0, extra]
    return F.pad(x, pad, value=value)


def shard_chunks(x: torch.Tensor, strategy: str, seq_dim: int, cp: CPGroup) -> torch.Tensor:
    """This rank's chunks of `x` along `seq_dim` (normalised), in the layout's local order (a new tensor)."""
    layout = get_layout(strategy)
    check_length(x.shape[seq_dim], layout, cp.size, f"tensor of shape {tuple(x.shape)} (seq_dim={seq_dim})")
    chunk = x.shape[seq_dim] // layout.num_chunks(cp.size)
    pieces = [x.narrow(seq_dim, c * chunk, chunk) for c in layout.rank_chunks(cp.rank, cp.size)]
    return torch.cat(pieces, dim=seq_dim) if len(pieces) > 1 else pieces[0].clone()


class _Unshard(torch.autograd.Function):
    """All-gather in forward; backward keeps this rank's slice of the (replicated) gradient.

    Downstream of unshard every rank holds the same full tensor, so its gradient is the same on every rank
    (as for DTensor Shard -> Replicate): summing it across ranks would count it cp times.
    """

    @staticmethod
    def forward(ctx, x, seq_dim, layout_name, group_name, rank, world):
        layout = get_layout(layout_name)
        ctx.seq_dim, ctx.layout, ctx.rank, ctx.world = seq_dim, layout_name, rank, world
        gathered = all_gather_dim0(x.movedim(seq_dim, 0).contiguous(), group_name)
        chunk = x.shape[seq_dim] // layout.chunks_per_rank
        order = layout.unshard_chunk_order(world)
        if order != sorted(order):
            pieces = gathered.unflatten(0, (len(order), chunk))
            gathered = pieces[torch.tensor(order, device=x.device)].flatten(0, 1)
        return gathered.movedim(0, seq_dim)

    @staticmethod
    def backward(ctx, grad):
        layout = get_layout(ctx.layout)
        seq_dim = ctx.seq_dim
        chunk = grad.shape[seq_dim] // layout.num_chunks(ctx.world)
        mine = [grad.narrow(seq_dim, c * chunk, chunk) for c in layout.rank_chunks(ctx.rank, ctx.world)]
        return torch.cat(mine, dim=seq_dim), None, None, None, None, None


def unshard_chunks(x_local: torch.Tensor, strategy: str, seq_dim: int, cp: CPGroup) -> torch.Tensor:
    """The full sequence in global order on every rank from each rank's chunks (differentiable)."""
    layout = get_layout(strategy)
    if x_local.shape[seq_dim] % layout.chunks_per_rank:
        raise CPCompileError(
            f"unshard got {x_local.shape[seq_dim]} local tokens; layout {layout.name!r} holds "
            f"{layout.chunks_per_rank} equal chunks per rank. Fix: pass the output of cpcompile.shard."
        )
    return _Unshard.apply(x_local, seq_dim, layout.name, cp.name, cp.rank, cp.size)

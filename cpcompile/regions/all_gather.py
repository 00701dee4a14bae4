"""The all-gather CP region: gather K/V per local slot, then run the layout's blocks on the block executor."""

from __future__ import annotations

import torch

from .. import executor  # noqa: F401  (registers torch.ops.cpcompile.*)
from ..comm import gather_kv
from ..layouts import get_layout


def all_gather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: str,
    causal: bool,
    scale: float,
    kernel: str,
    group_name: str,
    rank: int,
    world: int,
) -> torch.Tensor:
    """Causal or full attention of this rank's q over the whole sequence's K/V, in the given layout.

    K/V of all local slots (one per chunk a rank owns) travel in one all-gather, and each slot's gathered
    tokens form one strided buffer, so a block's key range is always a slice of one buffer: no reorder
    copy. Causal squares read the local K/V, so they do not wait for the gather.
    """
    lay = get_layout(layout)
    chunk = q.shape[-2] // lay.chunks_per_rank
    gathered_k, gathered_v = gather_kv(k, v, lay.chunks_per_rank, group_name)
    ks, vs = [k, *gathered_k], [v, *gathered_v]
    blocks = [i for b in lay.blocks(world, rank, chunk, causal) for i in b.as_ints()]
    out, _lse = torch.ops.cpcompile.attend_blocks(q, ks, vs, blocks, scale, kernel)
    return out

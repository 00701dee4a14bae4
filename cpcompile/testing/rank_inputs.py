"""A rank's executor inputs built by index from full-sequence tensors, for tests and probes that call the
block executor directly (no process group): what the shard and the all-gather would deliver."""

from __future__ import annotations

import torch

from ..executor.blocks import encode_dense
from ..layouts import get_layout


def rank_inputs(layout: str, cp: int, rank: int, q, k, v, dout, causal: bool = True):
    """(shard index, q, [local K, gathered K per slot], [same for V], dout, encoded blocks) of rank `rank`;
    tensors are (B, H, S, D) with the sequence on dim 2."""
    lay, seq = get_layout(layout), q.shape[-2]
    chunk = seq // lay.num_chunks(cp)
    idx = lay.shard_index(seq, cp, rank)
    ks, vs = [k[:, :, idx]], [v[:, :, idx]]
    for slot in range(lay.chunks_per_rank):
        g = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in lay.source_chunks(slot, cp)])
        ks.append(k[:, :, g])
        vs.append(v[:, :, g])
    blocks = encode_dense(lay.blocks(cp, rank, chunk, causal))
    return idx, q[:, :, idx], ks, vs, dout[:, :, idx], blocks

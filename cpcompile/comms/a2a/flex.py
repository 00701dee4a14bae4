"""comm="a2a"'s flex_attention region: heads for sequence (heads.py), ONE flex_attention call over the exchanged
buffer at global positions and global head indices (regions/flex_call.py), the output sent back.
"""

from __future__ import annotations

import torch

from ...layouts import get_layout
from ...layouts.flex import Positions, rank_major_chunks
from ...layouts.heads import HeadSplit
from ...regions.flex_call import flex_call
from .head_parallel import head_parallel
from .heads import DenseHeads, replicate_kv


def a2a_flex_attention(
    q, k, v, score_mod, mask_mod, tables, extras, score_buffers, mask_buffers, *, layout, scale, kernel_options,
    block_size, masked, group_name, rank, world,
):  # fmt: skip
    """Heads for sequence (head_parallel over one flex call, through heads.DenseHeads): Hq/cp heads of every
    token, one flex_attention call over the exchanged buffer (rank-major local orders: global order for flat), the
    output sent back. Only the output is exact for
    this rank's tokens; the planner refuses graphs that read lse / max_scores."""
    lay = get_layout(layout)
    split = HeadSplit(q.shape[1], k.shape[1], world)
    k, v = replicate_kv(k, v, split)
    chunk = q.shape[-2] // lay.chunks_per_rank
    exchange = DenseHeads(split, group_name, q.shape[1], (tuple(range(lay.chunks_per_rank)),), chunk)
    pos = Positions(tuple(rank_major_chunks(lay, world)), chunk)
    heads = (rank * split.q_per_rank, split.q_per_rank)
    plan = (scale, kernel_options, tuple(block_size), masked, heads)

    def attend(qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor) -> list[torch.Tensor]:
        out, _, _ = flex_call(
            qb, kb, vb, score_mod, mask_mod, tables, extras, score_buffers, mask_buffers, pos, pos, plan=plan
        )
        return [out]

    out = head_parallel(attend, (q, k, v), exchange)
    unread = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device=q.device)  # never read (planner)
    return out, unread, unread

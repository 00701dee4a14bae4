"""comm="a2a"'s flex_attention region: heads for sequence (heads.py), ONE flex_attention call over the exchanged
buffer at global positions and global head indices (regions/flex_call.py), the output sent back.
"""

from __future__ import annotations

import torch

from ...layouts import get_layout
from ...layouts.flex import Positions, rank_major_chunks
from ...layouts.heads import HeadSplit
from ...regions.flex_call import flex_call
from .heads import heads_to_bshd, replicate_kv, send_heads, send_tokens_back, tokens_to_bhsd


def a2a_flex_attention(
    q, k, v, score_mod, mask_mod, tables, extras, score_buffers, mask_buffers, *, layout, scale, kernel_options,
    block_size, masked, group_name, rank, world,
):  # fmt: skip
    """Heads for sequence (comm/heads.py): Hq/cp heads of every token, one flex_attention call over the exchanged
    buffer (rank-major local orders: global order for flat), the output sent back. Only the output is exact for
    this rank's tokens; the planner refuses graphs that read lse / max_scores."""
    lay = get_layout(layout)
    split = HeadSplit(q.shape[1], k.shape[1], world)
    k, v = replicate_kv(k, v, split)
    qb, kb, vb = send_heads(q, k, v, split, group_name)
    qb, kb, vb = (tokens_to_bhsd(t, n) for t, n in zip((qb, kb, vb), (split.q_per_rank, *(split.kv_per_rank,) * 2)))
    pos = Positions(tuple(rank_major_chunks(lay, world)), q.shape[-2] // lay.chunks_per_rank)
    heads = (rank * split.q_per_rank, split.q_per_rank)
    plan = (scale, kernel_options, tuple(block_size), masked, heads)
    out, _, _ = flex_call(
        qb, kb, vb, score_mod, mask_mod, tables, extras, score_buffers, mask_buffers, pos, pos, plan=plan
    )
    back = send_tokens_back(out.permute(2, 0, 1, 3), world, group_name)
    out = heads_to_bshd(back, q.shape[1]).transpose(1, 2)
    unread = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device=q.device)  # never read (planner)
    return out, unread, unread

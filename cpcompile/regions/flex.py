"""The flex_attention CP regions: gather (all_gather) or exchange (a2a) K/V, then ONE flex_attention call.

FlexAttention applies any mask as a block table plus a mask_mod, so a permuted key buffer costs nothing: the
rank's q buffer attends the key buffer in the order the collective delivered it (rank-major local orders, no
reorder copy), with
- the user's mask_mod and score_mod called at the GLOBAL positions of the buffers' tokens (and global head
  index under a2a), so a mask written for one GPU stays right (layouts.flex.Positions);
- the BlockMask's tensors derived from the global mask's on device: the q buffer's rows, kv blocks renumbered
  into the key buffer's order, and the q tables flex's backward reads (layouts.flex.derive_tables). kv blocks
  the rank's rows never list are never computed.
The call is the flex_attention higher-order op itself, so aot_autograd records flex's own forward and backward
(with the final logsumexp: one call over all keys needs no merge) and Inductor compiles them with its flex
kernels, fusing the mods in; the collectives around it carry their own autograd.
"""

from __future__ import annotations

import torch

from ..comm.collectives import all_gather_dim0, reduce_scatter_dim0
from ..comm.heads import heads_to_bshd, replicate_kv, send_heads, send_tokens_back, tokens_to_bhsd
from ..executor.packed_kv import pack_kv, unpack_kv
from ..layouts import get_layout
from ..layouts.flex import Positions, derive_tables, rank_major_chunks
from ..layouts.heads import HeadSplit
from ..precision import acc_dtype


def _wrap(mod, q: Positions, kv: Positions, head_offset: int, score: bool):
    """The user's mod at global positions; the lookup tables (when a buffer is not one run) come first among the
    mod's buffers: (tables..., user buffers...)."""
    n_tables = (q.offset is None) + (kv.offset is None)

    def call(*args):
        lead, rest = (args[:5], args[5:]) if score else (args[:4], args[4:])
        tables, user = list(rest[:n_tables]), rest[n_tables:]
        qt = tables.pop(0) if q.offset is None else None
        kt = tables.pop(0) if kv.offset is None else None
        *head, b, h, qi, ki = lead
        h = h + head_offset if head_offset else h
        return mod(*head, b, h, q.apply(qi, qt), kv.apply(ki, kt), *user)

    return call


def _flex(q, k, v, score_mod, mask_mod, tables, extras, score_buffers, mask_buffers, qpos, kvpos, *, plan):
    """One flex_attention call of q against the key buffer at global positions; (out, lse, max_scores)."""
    scale, kernel_options, block_size, masked, heads = plan
    if masked:
        tables = derive_tables(tuple(tables), qpos, kvpos, block_size, heads)
    pos_tables = tuple(p.table(q.device) for p in (qpos, kvpos) if p.offset is None)
    head_offset = heads[0] if heads is not None else 0
    mask = (q.shape[-2], k.shape[-2], *tables, *extras, *block_size, _wrap(mask_mod, qpos, kvpos, head_offset, False))
    return torch.ops.higher_order.flex_attention(
        q,
        k,
        v,
        _wrap(score_mod, qpos, kvpos, head_offset, True),
        mask,
        scale,
        dict(kernel_options),
        (*pos_tables, *score_buffers),
        (*pos_tables, *mask_buffers),
    )


class _GatherKV(torch.autograd.Function):
    """All-gather of the packed K/V send buffer; backward reduce-scatters its gradient in fp32 (precision.py)."""

    @staticmethod
    def forward(ctx, packed: torch.Tensor, group_name: str) -> torch.Tensor:
        ctx.group_name = group_name
        return all_gather_dim0(packed, group_name)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        summed = reduce_scatter_dim0(grad.to(acc_dtype(grad.dtype)), ctx.group_name)
        return summed.to(grad.dtype), None


def all_gather_flex_attention(
    q, k, v, score_mod, mask_mod, tables, extras, score_buffers, mask_buffers, *, layout, scale, kernel_options,
    block_size, masked, group_name, rank, world,
):  # fmt: skip
    """This rank's q (B, Hq, L, D) against every rank's K/V (one all-gather, tokens outermost so the key buffer
    is a strided view of it: rank-major local orders), one flex_attention call; (out, lse, max) for its tokens."""
    lay = get_layout(layout)
    chunk = q.shape[-2] // lay.chunks_per_rank
    qpos = Positions(tuple(lay.rank_chunks(rank, world)), chunk)
    kvpos = Positions(tuple(rank_major_chunks(lay, world)), chunk)
    send = pack_kv(k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3), dim=1)  # (L, 2, B, H, D) or (L, B, H, D + Dv)
    gathered = _GatherKV.apply(send, group_name)
    kb, vb = unpack_kv(gathered, 1, k.shape[-1])
    kb, vb = kb.permute(1, 2, 0, 3), vb.permute(1, 2, 0, 3)  # (B, H, world * L, D): views
    plan = (scale, kernel_options, tuple(block_size), masked, None)
    return _flex(q, kb, vb, score_mod, mask_mod, tables, extras, score_buffers, mask_buffers, qpos, kvpos, plan=plan)


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
    out, _, _ = _flex(qb, kb, vb, score_mod, mask_mod, tables, extras, score_buffers, mask_buffers, pos, pos, plan=plan)
    back = send_tokens_back(out.permute(2, 0, 1, 3), world, group_name)
    out = heads_to_bshd(back, q.shape[1]).transpose(1, 2)
    unread = torch.full(q.shape[:3], float("nan"), dtype=torch.float32, device=q.device)  # never read (planner)
    return out, unread, unread

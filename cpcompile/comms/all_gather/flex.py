"""comm="all_gather"'s flex_attention region: gather K/V (tokens outermost, so the key buffer is a strided view of
the received buffer in rank-major local orders), then ONE flex_attention call of this rank's q against every key at
global positions (regions/flex_call.py); the gather's backward reduce-scatters the K/V gradient in fp32.
"""

from __future__ import annotations

import torch

from ...comm.collectives import all_gather_dim0, reduce_scatter_dim0
from ...executor.packed_kv import pack_kv, unpack_kv
from ...layouts import get_layout
from ...layouts.flex import Positions, rank_major_chunks
from ...precision import acc_dtype
from ...regions.flex_call import flex_call


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
    return flex_call(
        q, kb, vb, score_mod, mask_mod, tables, extras, score_buffers, mask_buffers, qpos, kvpos, plan=plan
    )

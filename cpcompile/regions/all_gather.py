"""The all-gather CP region: gather K/V of every local slot in one collective, run the layout's blocks."""

from __future__ import annotations

import torch

from .. import executor  # noqa: F401  (registers torch.ops.cpcompile.*)
from ..comm.collectives import all_gather_dim0, reduce_scatter_dim0, slots_tokens_first
from ..executor.blocks import encode_dense
from ..executor.packed_kv import pack_kv, unpack_kv
from ..layouts import Block, get_layout


def _pack(k: torch.Tensor, v: torch.Tensor, slots: int) -> torch.Tensor:
    """(B, H, slots*C, D) K and V -> the send buffer (C, slots, 2, B, H, D): tokens outermost (MLA: (C, slots,
    B, H, D + Dv), executor.packed_kv).

    Stacking the two permuted views in place lets Inductor write the buffer from the kernel that computes
    K and V (RoPE), with no intermediate.
    """
    return pack_kv(slots_tokens_first(k, slots), slots_tokens_first(v, slots), dim=2)


def _unpack(packed: torch.Tensor, qk_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of _pack: (C, slots, 2, B, H, D) -> K and V (B, H, slots*C, D)."""
    if packed.dim() == 6:
        c, slots, _, b, h, d = packed.shape
        kv = packed.permute(2, 3, 4, 1, 0, 5).reshape(2, b, h, slots * c, d)
        return kv[0], kv[1]
    c, slots, b, h, _ = packed.shape  # K and V side by side (MLA)
    k, v = unpack_kv(packed, 2, qk_dim)
    return tuple(t.permute(2, 3, 1, 0, 4).reshape(b, h, slots * c, t.shape[-1]) for t in (k, v))


class _PackedAllGatherAttention(torch.autograd.Function):
    """Gather packed K/V, attend; backward: executor gradients in fp32, straight into the reduce-scatter.

    The executor's backward writes the gradient of the gathered buffer in its packed layout and in fp32,
    so the reduce-scatter needs no pack kernel and sums the ranks' partial dK/dV without rounding them to
    the input dtype first.
    """

    @staticmethod
    def forward(ctx, q, k, v, blocks, scale, kernel, slots, group_name):
        gathered = all_gather_dim0(_pack(k, v, slots), group_name)
        out, lse = torch.ops.cpcompile.attend_blocks(q, [k], [v], blocks, scale, kernel, gathered)
        ctx.save_for_backward(q, k, v, gathered, out, lse)
        ctx.args = (blocks, scale, kernel, group_name)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, gathered, out, lse = ctx.saved_tensors
        blocks, scale, kernel, group_name = ctx.args
        dq, (dk,), (dv,), dgathered = torch.ops.cpcompile.attend_blocks_backward(
            dout, q, [k], [v], out, lse, blocks, scale, kernel, gathered
        )
        dk_gathered, dv_gathered = _unpack(reduce_scatter_dim0(dgathered, group_name), k.shape[-1])
        return dq, (dk + dk_gathered).to(k.dtype), (dv + dv_gathered).to(v.dtype), None, None, None, None, None


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
    slots = get_layout(layout).chunks_per_rank
    blocks = encode_dense(rank_blocks(layout, causal, rank, world, q.shape[-2]))
    return _PackedAllGatherAttention.apply(q, k, v, blocks, scale, kernel, slots, group_name)


def rank_blocks(layout: str, causal: bool, rank: int, world: int, local_len: int) -> list[Block]:
    """The blocks this rank runs over its local and gathered K/V (`local_len` tokens a rank)."""
    lay = get_layout(layout)
    return lay.blocks(world, rank, local_len // lay.chunks_per_rank, causal)


def wire_bytes(
    tokens: int,
    batch: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    v_head_dim: int,
    world: int,
    elt: int,
    acc_elt: int,
    lse: bool = False,
) -> tuple[int, int]:
    """Bytes one rank sends per forward and per backward (dense and packed regions alike): its K/V of `tokens`
    local tokens to the world - 1 others (the all-gather), then the other ranks' shares of the gathered K/V
    gradient in the accumulation dtype (`acc_elt` bytes; the reduce-scatter). The lse never travels."""
    del q_heads, lse
    kv = (world - 1) * tokens * batch * kv_heads * (head_dim + v_head_dim)
    return kv * elt, kv * acc_elt

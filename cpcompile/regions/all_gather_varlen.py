"""The all-gather CP region for packed documents (varlen_attn under the thd / thd_zigzag layouts).

One all-gather of K/V, then one varlen kernel call a rank (layouts.thd): nothing to merge. thd reads the
gathered buffer as it is; thd_zigzag first copies it into its key buffer (each document's front-chunk keys,
then its back-chunk keys) and folds that buffer's gradient back in fp32 before the reduce-scatter.
"""

from __future__ import annotations

import torch

from ..comm import all_gather_dim0 as _gather
from ..comm import grad_reduce_dtype
from ..comm import reduce_scatter_dim0 as _reduce
from ..layouts.thd import NO_WINDOW, get_packed_layout
from ..varlen_executor import encode_blocks  # (importing it registers torch.ops.cpcompile.attend_varlen_blocks)


def attend_gathered(q, gathered, key_index, ranges, spec, scale, kernel):
    """(out, lse, keys) of the rank's blocks over the gathered (T, 2, Hkv, D) K/V, read through `key_index`
    (None: as gathered). No communication: the single-GPU benchmark times this and `attend_gathered_backward`."""
    keys = gathered if key_index is None else gathered.index_select(0, key_index)
    out, lse = torch.ops.cpcompile.attend_varlen_blocks(
        q, [keys[:, 0]], [keys[:, 1]], list(ranges), spec, scale, kernel
    )
    return out, lse, keys


def attend_gathered_backward(dout, q, keys, out, lse, key_index, total, ranges, spec, scale, kernel):
    """(dq, d(gathered) in the reduce dtype): the kernels' gradient of the key buffer, folded back onto the
    gathered buffer's `total` tokens (a key the buffer holds twice gets both parts, summed in fp32)."""
    dq, (dk,), (dv,) = torch.ops.cpcompile.attend_varlen_blocks_backward(
        dout.contiguous(), q, [keys[:, 0]], [keys[:, 1]], out, lse, list(ranges), spec, scale, kernel
    )
    acc = grad_reduce_dtype(keys.dtype)
    dkeys = torch.stack((dk, dv), dim=1).to(acc)
    if key_index is not None:
        dkeys = dkeys.new_zeros((total, *dkeys.shape[1:])).index_add_(0, key_index, dkeys)
    return dq, dkeys


class _GatherAttend(torch.autograd.Function):
    """All-gather packed K/V (tokens on dim 0, K and V in one collective), run the rank's block; backward keeps
    the K/V gradient in fp32 from the kernel through the reduce-scatter and rounds once."""

    @staticmethod
    def forward(ctx, q, k, v, key_index, spec, scale, kernel, group_name, *ranges):
        if k.shape != v.shape or k.dtype != v.dtype:
            raise NotImplementedError("the planner refuses K and V of different shapes or dtypes")
        gathered = _gather(torch.stack((k, v), dim=1), group_name)  # (T, 2, Hkv, D)
        out, lse, keys = attend_gathered(q, gathered, key_index, ranges, spec, scale, kernel)
        ctx.save_for_backward(q, keys, out, lse, key_index, *ranges)
        ctx.spec, ctx.scale, ctx.kernel, ctx.group_name = spec, scale, kernel, group_name
        ctx.total, ctx.reorder = gathered.shape[0], key_index is not None
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, keys, out, lse, key_index, *ranges = ctx.saved_tensors
        key_index = key_index if ctx.reorder else None
        dq, dkeys = attend_gathered_backward(
            dout, q, keys, out, lse, key_index, ctx.total, ranges, ctx.spec, ctx.scale, ctx.kernel
        )
        dkv = _reduce(dkeys, ctx.group_name).to(keys.dtype)  # (L, 2, Hkv, D): this rank's K/V gradient
        return (dq.to(q.dtype), dkv[:, 0], dkv[:, 1], None, None, None, None, None, *([None] * len(ranges)))


def all_gather_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    layout: str,
    causal: bool,
    scale: float,
    kernel: str,
    group_name: str,
    rank: int,
    world: int,
    max_doc: int | None = None,
    window: tuple[int, int] = NO_WINDOW,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """varlen_attn of this rank's packed q over every rank's K/V, same document only (causal when asked,
    within a (left, 0) sliding window when given).

    cu_seqlens are the GLOBAL document offsets. The layout turns them into the block's ranges and the key
    buffer's index with device ops of static shape (no host sync, no recompiles when documents change).
    `max_doc` (the call's max_q/max_k: the longest document, the same contract as single-device varlen_attn)
    tightens the block's static length bounds, which size the kernel's grid. Returns what
    torch_attn._varlen_attn returns: (out, lse (Hq, T_local) fp32, rng_state), so the node's users are unchanged.
    """
    lay = get_packed_layout(layout)
    lay.device_check(cu_seqlens, world)
    local = q.shape[0]
    blocks = lay.blocks(cu_seqlens, local, world, rank, causal, max_doc, tuple(window))
    key_index = lay.key_index(cu_seqlens, local, world, rank, causal)
    spec = encode_blocks(blocks)
    out, lse = _GatherAttend.apply(q, k, v, key_index, spec, scale, kernel, group_name, *[b.ranges for b in blocks])
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    return out, lse.to(torch.float32), rng_state

"""The all-gather CP region: gather K/V of every local slot in one collective, run the layout's blocks."""

from __future__ import annotations

import dataclasses

import torch

from ... import executor
from ...comm.collectives import slots_tokens_first
from ...comm.pending import in_backward, start_all_gather, start_reduce_scatter, wait
from ...comm.wire import WireShape
from ...executor.blocks import encode_dense, encode_windows
from ...executor.packed_kv import pack_kv, unpack_kv
from ...executor.sinks import fold_sinks, sinks_grad
from ...layouts import LOCAL_SOURCE, Block, get_layout
from ...precision import acc_dtype
from ...regions.partials import add_part, merge_step


def pack_slots(k: torch.Tensor, v: torch.Tensor, slots: int) -> torch.Tensor:
    """(B, H, slots*C, D) K and V -> the send buffer (C, slots, 2, B, H, D): tokens outermost (MLA: (C, slots,
    B, H, D + Dv), executor.packed_kv).

    Stacking the two permuted views in place lets Inductor write the buffer from the kernel that computes
    K and V (RoPE), with no intermediate.
    """
    return pack_kv(slots_tokens_first(k, slots), slots_tokens_first(v, slots), dim=2)


def unpack_slots(packed: torch.Tensor, qk_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of pack_slots: (C, slots, 2, B, H, D) -> K and V (B, H, slots*C, D)."""
    if packed.dim() == 6:
        c, slots, _, b, h, d = packed.shape
        kv = packed.permute(2, 3, 4, 1, 0, 5).reshape(2, b, h, slots * c, d)
        return kv[0], kv[1]
    c, slots, b, h, _ = packed.shape  # K and V side by side (MLA)
    k, v = unpack_kv(packed, 2, qk_dim)
    return tuple(t.permute(2, 3, 1, 0, 4).reshape(b, h, slots * c, t.shape[-1]) for t in (k, v))


def split_blocks(blocks: list[Block]) -> tuple[list[Block], list[Block]]:
    """(the blocks on the local K/V, the blocks on the gathered slots renumbered from source 0): the first run
    while the gather is in flight."""
    local = [b for b in blocks if b.source == LOCAL_SOURCE]
    gathered = [dataclasses.replace(b, source=b.source - 1) for b in blocks if b.source != LOCAL_SOURCE]
    return local, gathered


def executor_extra(blocks: list[Block], softcap: float) -> dict:
    """attend_blocks' optional keywords: the blocks' windows and the softcap, only when used (graphs without
    them stay as they were)."""
    windows = encode_windows(blocks)
    extra = {} if windows is None else {"windows": windows}
    if softcap:
        extra["softcap"] = float(softcap)
    return extra


class _PackedAllGatherAttention(torch.autograd.Function):
    """Gather packed K/V, attend; backward: executor gradients in fp32, straight into the reduce-scatter.

    The local blocks (causal squares) run between issuing the gather and waiting for it, and in backward
    between issuing the reduce-scatter and waiting for it (with `regather`: between issuing the second
    gather and waiting for it), so the collectives overlap them. The executor's backward writes the gradient
    of the gathered buffer in its packed layout and in fp32, so the reduce-scatter needs no pack kernel and
    sums the ranks' partial dK/dV without rounding them to the input dtype first. `regather` saves only the
    local K/V for backward and gathers them again there: one layer's gathered K/V is then alive at a time
    instead of every layer's.
    """

    @staticmethod
    def forward(ctx, q, k, v, sinks, local, remote, scale, kernel, slots, group_name, world, regather, extras):
        x_local, x_remote = extras  # executor_extra of each block list
        pending = start_all_gather(pack_slots(k, v, slots), group_name, world)
        acc = lse = None
        if local:
            acc, lse = executor.attend(q, [k], [v], local, scale, kernel, None, True, **x_local)
            if sinks is not None and remote:  # in fp32 before the merge: merge and sink fold then round once
                acc, lse = merge_step(None, None, acc, lse)
        gathered = wait(pending)
        if remote:
            o, l = executor.attend(q, [], [], remote, scale, kernel, gathered, True, **x_remote)
            acc, lse = merge_step(acc, lse, o, l)
        if sinks is not None:
            acc, lse = fold_sinks(acc, lse, sinks)
        out = acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks, *([] if regather else [gathered]))
        ctx.args = (local, remote, scale, kernel, slots, group_name, world, regather, extras)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks, *kept = ctx.saved_tensors
        local, remote, scale, kernel, slots, group_name, world, regather, (x_local, x_remote) = ctx.args
        dout = dout.contiguous()

        def local_part():
            if not local:
                return None, None, None
            dq_l, (dk_l,), (dv_l,), _ = executor.attend_backward(
                dout, q, [k], [v], out, lse, local, scale, kernel, None, True, **x_local
            )
            return dq_l, dk_l, dv_l

        if regather:  # the local squares' backward runs while the K/V are gathered again
            packed = in_backward(pack_slots(k, v, slots), dout)  # stays in backward (comm/pending.py)
            pending = start_all_gather(packed, group_name, world)
            dq, dk, dv = local_part()
            gathered = wait(pending)
        else:
            (gathered,) = kept
        dq_g = None
        if remote:
            dq_g, _, _, dgathered = executor.attend_backward(
                dout, q, [], [], out, lse, remote, scale, kernel, gathered, True, **x_remote
            )
        else:  # this rank reads no gathered K/V, but the other ranks' gradients still come home through it; tied
            # to dout, or the partitioner would run this rank's reduce-scatter in the forward (comm/pending.py)
            dgathered = in_backward(gathered.new_zeros(gathered.shape, dtype=acc_dtype(q.dtype)), dout)
        reduced = start_reduce_scatter(dgathered, group_name, world)
        if not regather:  # the local squares' backward runs while the reduce-scatter is in flight
            dq, dk, dv = local_part()
        dk_g, dv_g = unpack_slots(wait(reduced), k.shape[-1])
        dq = add_part(dq, dq_g)
        dsinks = None if sinks is None else sinks_grad(dout, out, lse, sinks)
        dk, dv = add_part(dk, dk_g).to(k.dtype), add_part(dv, dv_g).to(v.dtype)
        return dq.to(q.dtype), dk, dv, dsinks, *([None] * 9)


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
    regather: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal or full attention of this rank's q over the whole sequence's K/V, in the given layout.

    K/V of all local slots (one per chunk a rank owns) travel in one all-gather, and each slot's gathered
    tokens form one strided buffer, so a block's key range is always a slice of one buffer: no reorder
    copy. Causal squares read the local K/V, so they do not wait for the gather. `regather`: keep only the
    local K/V for backward and gather them again there. A sliding `window` (left, right) over global positions
    skips the blocks outside it (layouts/window.py); `softcap` caps the scores; `sinks` (Hq,) adds one logit a
    head to every row's denominator (executor/sinks.py).
    """
    slots = get_layout(layout).chunks_per_rank
    local, remote = split_blocks(rank_blocks(layout, causal, rank, world, q.shape[-2], window))
    extras = (executor_extra(local, softcap), executor_extra(remote, softcap))
    blocks = (encode_dense(local), encode_dense(remote))
    args = (*blocks, scale, kernel, slots, group_name, world, regather, extras)
    return _PackedAllGatherAttention.apply(q, k, v, sinks, *args)


def rank_blocks(
    layout: str, causal: bool, rank: int, world: int, local_len: int, window: tuple[int, int] | None = None
) -> list[Block]:
    """The blocks this rank runs over its local and gathered K/V (`local_len` tokens a rank)."""
    lay = get_layout(layout)
    return lay.blocks(world, rank, local_len // lay.chunks_per_rank, causal, window)


def wire_bytes(shape: WireShape) -> tuple[int, int]:
    """Bytes one rank sends per forward and per backward (dense and packed regions alike): its K/V of `tokens`
    local tokens to the world - 1 others (the all-gather), then the other ranks' shares of the gathered K/V
    gradient in the accumulation dtype (`acc_elt` bytes; the reduce-scatter). The lse never travels."""
    s = shape
    kv = (s.world - 1) * s.tokens * s.batch * s.kv_heads * (s.head_dim + s.v_head_dim)
    return kv * s.elt, kv * s.acc_elt

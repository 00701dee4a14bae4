"""The selective-exchange CP region for packed documents (varlen_attn under thd_balanced / thd, comm="selective").

Like the all-gather region (comms/all_gather/varlen.py) a rank runs ONE varlen block over the layout's key
buffer (thd_balanced's; thd's in global order, so its blocks are all_gather's), but the K/V it holds are its own
tokens plus, from each peer, only the tokens its queries read (the other pieces of the documents it holds a
piece of), in C static slots a peer: one all-to-all with splits [C, .., 0 (itself), .., C] (comms/selective/schedule.py:
the slots, C, the device check that they suffice). Backward sends back only those tokens' K/V gradients, in
fp32, through the same all-to-all, and each rank adds what it gets to its own tokens' gradient (a gather per
peer, fp32, rounded once).
"""

from __future__ import annotations

import torch

from ... import executor  # noqa: F401  (registers torch.ops.cpcompile.*)
from ...comm.collectives import exchange_slots
from ...comm.wire import WireShape
from ...executor.packed_kv import pack_kv, unpack_kv
from ...layouts.block import NO_WINDOW
from ...layouts.thd import get_packed_layout
from ..all_gather.varlen import attend_gathered, attend_gathered_backward, gathered_blocks
from .schedule import capacity, global_key_buffer, held_len, select, select_thd

TOO_SMALL = (
    "cpcompile: comm='selective' this batch's plan needs more than C=min(T/cp, max_q) tokens from one rank; "
    "pass a larger max_q/max_k (up to T/cp always fits) or use comm='all_gather'"
)
"""The device assert's message (under 255 characters, as CUDA needs)."""


def _splits(world: int, rank: int, cap: int) -> list[int]:
    return [0 if p == rank else cap for p in range(world)]


def returned_grad(dheld: torch.Tensor, back: torch.Tensor, returned: torch.Tensor, local: int) -> torch.Tensor:
    """The rank's own K/V gradient (acc dtype): its part of the held buffer's plus, per peer, the slots that
    peer returned for its tokens (`back`: -1 where the peer read none), summed in fp32."""
    grad = dheld[:local]
    shape = (-1, *(1,) * (grad.dim() - 1))
    for peer in range(back.shape[0]):
        idx = back[peer]
        grad = grad + torch.where((idx >= 0).view(shape), returned[idx.clamp(min=0)], 0)
    return grad


class _SelectAttend(torch.autograd.Function):
    """Send each peer the K/V it reads, run the rank's block over its own and the received K/V; backward sends
    the received K/V's gradient back in fp32 and sums it into the owners' gradient, rounding once."""

    @staticmethod
    def forward(ctx, q, k, v, send_index, key_index, key_fold, back, spec, scale, kernel, group_name, splits, *tensors):
        packed = pack_kv(k, v, 1)  # (L, 2, Hkv, D); MLA: (L, Hkv, D + Dv)
        received = exchange_slots(packed.index_select(0, send_index), splits, group_name)
        held = torch.cat((packed, received))
        out, lse, keys = attend_gathered(q, held, key_index, tensors, spec, scale, kernel)
        ctx.save_for_backward(q, keys, out, lse, key_fold, back, *tensors)
        ctx.spec, ctx.scale, ctx.kernel, ctx.group_name, ctx.splits = spec, scale, kernel, group_name, splits
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, keys, out, lse, key_fold, back, *tensors = ctx.saved_tensors
        args = (tensors, ctx.spec, ctx.scale, ctx.kernel)
        dq, dheld = attend_gathered_backward(dout, q, keys, out, lse, key_fold, *args)
        local = q.shape[0]
        returned = exchange_slots(dheld[local:], ctx.splits, ctx.group_name)  # fp32: what my tokens got
        dkv = returned_grad(dheld, back, returned, local).to(keys.dtype)
        return (dq.to(q.dtype), *unpack_kv(dkv, 1, q.shape[-1]), *([None] * (10 + len(tensors))))


def selective_varlen_attention(
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
    """varlen_attn of this rank's packed q over the K/V its documents hold (causal when asked, within a (left, 0)
    sliding window when given), receiving from each peer only what it reads. `cu_seqlens` is thd_balanced's
    plan; the slots, key buffer and block come from it with device ops of static shape (no host sync, no
    recompile when documents change). Returns (out, lse (Hq, T_local) fp32, rng_state) like
    torch_attn._varlen_attn."""
    lay, local = get_packed_layout(layout), q.shape[0]
    cap = capacity(local, max_doc)
    held = held_len(local, world, cap)
    # thd's key buffer is in global order, so all_gather's slice of the keys the rank can reach applies (`read`;
    # None under thd_balanced): the kernel's backward then zero-fills and reduces (GQA) dK/dV over that slice
    blocks, read = lay.kernel_blocks(cu_seqlens, local, world, rank, causal, max_doc, tuple(window))
    if lay.carries_plan:  # thd_balanced
        sel = select(cu_seqlens, local, world, rank, causal, cap)
        if cap < local:  # C = T/cp always fits: a peer holds no more
            torch._assert_async(sel.fits, TOO_SMALL)
        key_index, key_fold = lay.held_key_buffer(cu_seqlens, local, world, rank, causal, sel.held_position, held)
    else:  # thd: one document a peer, which max_doc bounds (checked with the offsets): always fits
        sel = select_thd(cu_seqlens, local, world, rank, causal, cap)
        key_index, key_fold = global_key_buffer(sel, held, read)
    assert read is None or not lay.carries_plan, f"layout {layout!r}: a key slice of a key buffer it copies"
    spec, tensors = gathered_blocks(blocks, local, key_index.shape[0], kernel)
    args = (sel.send_index, key_index, key_fold, sel.back, spec, scale, kernel, group_name, _splits(world, rank, cap))
    out, lse = _SelectAttend.apply(q, k, v, *args, *tensors)
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    return out, lse.to(torch.float32), rng_state


def wire_bytes(shape: WireShape) -> tuple[int, int]:
    """Bytes one rank sends per forward and per backward: C = min(L, max_doc) K/V token slots to each of the
    world - 1 others (the static capacity travels whatever the batch needs), then as many fp32 gradient slots
    back (`acc_elt`). The lse never travels."""
    s = shape
    kv = (s.world - 1) * capacity(s.tokens, s.max_doc) * s.batch * s.kv_heads * (s.head_dim + s.v_head_dim)
    return kv * s.elt, kv * s.acc_elt

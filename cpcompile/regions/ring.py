"""The ring CP region (comm="ring"): K/V chunks travel around the ring, each step's blocks computed while the
next chunk is in flight; no rank ever holds more than two K/V chunks, and only its own K/V is saved.

Forward, step s of cp: issue the shift of the held K/V to rank + 1 (one all-to-all with one non-empty split,
comm/pending.py), run this step's blocks (layouts/ring.py) on the held K/V, merge them into the running output
by LSE in fp32, then wait for the next chunk. Backward circulates K/V again and, with them, the gradient of the
held K/V: each rank adds its part (fp32, straight from the executor in the packed layout) to the gradient that
arrived with the chunk and sends it on, so after cp shifts every K/V gradient is home, summed in fp32, rounded
once. GQA travels as the kv heads (the executor reads each group's q heads against them).
"""

from __future__ import annotations

import torch

from .. import executor  # noqa: F401  (registers torch.ops.cpcompile.*)
from ..comm.pending import in_backward, start_shift, wait
from ..executor.blocks import encode_dense
from ..layouts import Block, get_layout
from ..layouts.ring import ring_blocks
from .all_gather import pack_slots, unpack_slots
from .partials import add_part, merge_step


class _RingAttention(torch.autograd.Function):
    """Ring forward and backward over one packed K/V buffer (L, 1, 2, B, Hkv, D) (MLA: K and V side by side)."""

    @staticmethod
    def forward(ctx, q, k, v, steps, scale, kernel, group_name, rank, world):
        held = pack_slots(k, v, 1)
        mine = held
        acc = lse = None
        for s, blocks in enumerate(steps):
            pending = start_shift(held, group_name, rank, world) if s + 1 < world else None
            if blocks:
                o, l = torch.ops.cpcompile.attend_blocks(q, [], [], blocks, scale, kernel, held, True)
                acc, lse = merge_step(acc, lse, o, l)
            if pending is not None:
                held = wait(pending).view(held.shape)
        out = acc.to(q.dtype)
        ctx.save_for_backward(q, mine, out, lse)
        ctx.args = (steps, scale, kernel, group_name, rank, world)
        ctx.kv_dtype = k.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        q, held, out, lse = ctx.saved_tensors
        steps, scale, kernel, group_name, rank, world = ctx.args
        dout = dout.contiguous()
        dq = travel = pending_grad = None
        for s, blocks in enumerate(steps):
            # the first shift's input tied to dout keeps every K/V shift in the backward graph (comm/pending.py)
            sent = in_backward(held, dout) if s == 0 else held
            pending = start_shift(sent, group_name, rank, world) if s + 1 < world else None
            part = None
            if blocks:
                dq_s, _, _, part = torch.ops.cpcompile.attend_blocks_backward(
                    dout, q, [], [], out, lse, blocks, scale, kernel, held, True
                )
                dq = add_part(dq, dq_s)
            if pending_grad is None:  # step 0: the rank's own K/V, nothing has arrived
                travel = part
            else:  # the held chunk's gradient so far arrived with it; add this rank's part, send it on
                arrived = wait(pending_grad).view(held.shape)
                travel = add_part(arrived, part)
            pending_grad = start_shift(travel, group_name, rank, world) if world > 1 else None
            if pending is not None:
                held = wait(pending).view(held.shape)
        home = travel if pending_grad is None else wait(pending_grad).view(held.shape)  # own K/V's, after a circle
        dk, dv = unpack_slots(home, q.shape[-1])
        return dq.to(q.dtype), dk.to(ctx.kv_dtype), dv.to(ctx.kv_dtype), None, None, None, None, None, None


def ring_attention(
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
    """Causal or full attention of this rank's q over every rank's K/V, which arrive one rank at a time."""
    lay = get_layout(layout)
    steps = ring_blocks(lay, world, rank, q.shape[-2] // lay.chunks_per_rank, causal)
    encoded = tuple(encode_dense(b) for b in steps)
    return _RingAttention.apply(q, k, v, encoded, scale, kernel, group_name, rank, world)


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
    """Bytes one rank sends per forward and per backward (dense and packed rings alike): forward, its held K/V
    of `tokens` tokens once per step but the last (world - 1 shifts); backward, the K/V again (world - 1 shifts)
    and the travelling fp32 K/V gradient once per step (world shifts: it comes home after a full circle). The
    lse never travels."""
    del q_heads, lse
    kv = tokens * batch * kv_heads * (head_dim + v_head_dim)
    return (world - 1) * kv * elt, (world - 1) * kv * elt + world * kv * acc_elt


def rank_blocks(layout: str, causal: bool, rank: int, world: int, local_len: int) -> list[Block]:
    """Every block this rank runs, over all ring steps (each against that step's held K/V)."""
    lay = get_layout(layout)
    return [b for step in ring_blocks(lay, world, rank, local_len // lay.chunks_per_rank, causal) for b in step]

"""The ring CP region (comm="ring"): K/V chunks travel around the ring, each step's blocks computed while the
next chunk is in flight; no rank ever holds more than two K/V chunks, and only its own K/V is saved.

Forward, step s of cp: issue the shift of the held K/V to rank + 1 (one all-to-all with one non-empty split,
comm/pending.py), run this step's blocks (comms/ring/schedule.py) on the held K/V, merge them into the running output
by LSE in fp32, then wait for the next chunk. Backward circulates K/V again and, with them, the gradient of the
held K/V: each rank adds its part (fp32, straight from the executor in the packed layout) to the gradient that
arrived with the chunk and sends it on, so after cp shifts every K/V gradient is home, summed in fp32, rounded
once. GQA travels as the kv heads (the executor reads each group's q heads against them). Under a sliding window
the ring visits only the steps some rank has blocks at, shifting by the gap between them, and sends each gradient
home from the last one (`schedule.step_gap`).
"""

from __future__ import annotations

import dataclasses

import torch

from ... import executor
from ...comm.pending import in_backward, start_shift, wait
from ...comm.wire import WireShape
from ...executor.blocks import encode_dense
from ...executor.sinks import fold_sinks, sinks_grad
from ...layouts import Block, ChunkLayout, get_layout
from ...regions.deferred import merge_all, sum_all
from ...regions.partials import add_part, merge_step
from ..all_gather.dense import executor_extra, pack_slots, unpack_slots
from .schedule import packed_visited_steps, packed_window, ring_blocks, step_gap, visited_steps


class _RingAttention(torch.autograd.Function):
    """Ring forward and backward over one packed K/V buffer (L, 1, 2, B, Hkv, D) (MLA: K and V side by side)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, steps, rows, visited, extras, scale, kernel, group_name, rank, world, deferred):
        held = pack_slots(k, v, 1)
        mine = held
        acc = lse = None
        parts = []  # deferred: every step's partial, merged once after the last step (regions/deferred.py)
        for i, (blocks, span, extra) in enumerate(zip(steps, rows, extras)):
            gap = step_gap(visited, i, world)
            pending = start_shift(held, group_name, rank, world, gap) if i + 1 < len(visited) else None
            if blocks:  # on the q rows the step's blocks reach (its blocks are relative to them)
                o, l = executor.attend(_rows(q, span), [], [], blocks, scale, kernel, held, True, **extra)
                if deferred:
                    parts.append((o, l, span[0]))
                else:
                    acc, lse = merge_step(acc, lse, o, l, start=span[0])
            if pending is not None:
                held = wait(pending).view(held.shape)
        if deferred:
            acc, lse = merge_all(parts, q.shape[-2])
        if sinks is not None:  # after the last step: every key of every row has been merged
            acc, lse = fold_sinks(acc, lse, sinks)
        out = acc.to(q.dtype)
        ctx.save_for_backward(q, mine, out, lse, sinks)
        ctx.args = (steps, rows, visited, extras, scale, kernel, group_name, rank, world, deferred)
        ctx.kv_dtype = k.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        q, held, out, lse, sinks = ctx.saved_tensors
        steps, rows, visited, extras, scale, kernel, group_name, rank, world, deferred = ctx.args
        dout = dout.contiguous()
        dq = travel = pending_grad = None
        dq_parts = []
        for i, (blocks, span, extra) in enumerate(zip(steps, rows, extras)):
            # the first shift's input tied to dout keeps every K/V shift in the backward graph (comm/pending.py)
            sent = in_backward(held, dout) if i == 0 else held
            gap = step_gap(visited, i, world)
            pending = start_shift(sent, group_name, rank, world, gap) if i + 1 < len(visited) else None
            part = None
            if blocks:
                dq_s, _, _, part = executor.attend_backward(
                    _rows(dout, span), _rows(q, span), [], [], _rows(out, span), _rows(lse, span, -1), blocks,
                    scale, kernel, held, True, **extra,
                )  # fmt: skip
                if deferred:
                    dq_parts.append((dq_s, span[0]))
                else:
                    dq = add_part(dq, dq_s, span[0])
            if pending_grad is None:  # step 0: the rank's own K/V, nothing has arrived
                travel = part
            else:  # the held chunk's gradient so far arrived with it; add this rank's part, send it on
                arrived = wait(pending_grad).view(held.shape)
                travel = add_part(arrived, part)
            # on with the chunk to the next visited step; after the last, home to the chunk's owner
            pending_grad = start_shift(travel, group_name, rank, world, gap) if gap % world else None
            if pending is not None:
                held = wait(pending).view(held.shape)
        home = travel if pending_grad is None else wait(pending_grad).view(held.shape)  # own K/V's, after a circle
        dk, dv = unpack_slots(home, q.shape[-1])
        dsinks = None if sinks is None else sinks_grad(dout, out, lse, sinks)
        dq = sum_all(dq_parts, q.shape[-2], q.dtype) if deferred else dq.to(q.dtype)
        return dq, dk.to(ctx.kv_dtype), dv.to(ctx.kv_dtype), dsinks, *([None] * 10)


Rows = tuple[int, int]
"""A step's q rows [start, end)."""


def step_rows(blocks: list[Block], total: int, first: bool) -> Rows:
    """The q rows a step's blocks span, which it runs on (a view of q, dout, out, lse) and folds into the running
    output and dq (the fused merge reads a partial over some rows where it lies: executor/merge_triton.py).
    A zigzag step holding a later rank's chunks reaches only the back chunk: on rank 0 every step but the
    first, so half the rows of every merge and dq sum, and no padded partial. The `first` step covers every row:
    it starts the running sums."""
    if first or not blocks:
        return 0, total
    return min(b.q_start for b in blocks), max(b.q_start + b.q_len for b in blocks)


def _rows(t: torch.Tensor, span: Rows, dim: int = -2) -> torch.Tensor:
    """t's rows `span` along `dim` (a view), or t itself where the span is all of them (nothing recorded)."""
    if span == (0, t.shape[dim]):
        return t
    return t.narrow(dim, span[0], span[1] - span[0])


def _relative(blocks: list[Block], span: Rows) -> list[Block]:
    """A step's blocks with their q rows counted from the start of the rows they span."""
    if span[0] == 0:
        return blocks
    return [dataclasses.replace(b, q_start=b.q_start - span[0]) for b in blocks]


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
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    deferred_merge: bool = False,
) -> torch.Tensor:
    """Causal or full attention of this rank's q over every rank's K/V, which arrive one rank at a time. A sliding
    `window` (left, right) over global positions runs only the band's blocks, on windowed kernels, and the ring
    visits only the steps some rank needs (comms/ring/schedule.visited_steps); `softcap` caps the scores; `sinks` (Hq,)
    fold one logit a head into every row's denominator after the last step (executor/sinks.py); `deferred_merge`:
    keep every step's partial and merge them once after the last step (regions/deferred.py)."""
    return ring_over(q, k, v, get_layout(layout), causal=causal, scale=scale, kernel=kernel, group_name=group_name,
                     rank=rank, world=world, window=window, softcap=softcap, sinks=sinks,
                     deferred_merge=deferred_merge)  # fmt: skip


def ring_over(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lay: ChunkLayout,
    *,
    causal: bool,
    scale: float,
    kernel: str,
    group_name: str,
    rank: int,
    world: int,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    deferred_merge: bool = False,
) -> torch.Tensor:
    """ring_attention over any chunk layout object (the hierarchical region's nodes: comms/hierarchical/levels.py)."""
    chunk = q.shape[-2] // lay.chunks_per_rank
    every = ring_blocks(lay, world, rank, chunk, causal, window)
    visited = visited_steps(lay, world, chunk, causal, window)
    rows = tuple(step_rows(every[s], q.shape[-2], i == 0) for i, s in enumerate(visited))
    steps = tuple(encode_dense(_relative(every[s], span)) for s, span in zip(visited, rows))
    extras = tuple(executor_extra(every[s], softcap) for s in visited)
    args = (steps, rows, visited, extras, scale, kernel, group_name, rank, world, bool(deferred_merge))
    return _RingAttention.apply(q, k, v, sinks, *args)


def wire_bytes(shape: WireShape) -> tuple[int, int]:
    """Bytes one rank sends per forward and per backward (dense and packed rings alike): forward, its held K/V
    of `tokens` tokens once per visited step but the last; backward, the K/V again and the travelling fp32 K/V
    gradient once per visited step (it comes home from the last one). Every step is visited (world - 1 K/V
    shifts, world gradient shifts) unless `dense_mask` (layout, causal, window) has a window that keeps some
    steps from every rank (comms/ring/schedule.visited_steps), or thd's steps are not all in reach of a
    document (a causal sliding window in `packed_mask`, or `max_doc`: comms/ring/schedule.packed_visited_steps):
    then only those. The lse never travels."""
    s = shape
    lay = None
    if s.dense_mask is not None and s.dense_mask[2] is not None:
        lay = get_layout(s.dense_mask[0])
    if s.packed_mask is not None:
        layout, causal, window = s.packed_mask
        window = packed_window(window, causal, s.max_doc, s.tokens * s.world)
        return _shift_bytes(shape, len(packed_visited_steps(layout, s.tokens, s.world, window, causal, s.max_doc)))
    return layout_wire_bytes(shape, lay)


def layout_wire_bytes(shape: WireShape, lay: ChunkLayout | None) -> tuple[int, int]:
    """wire_bytes with the steps a windowed `dense_mask` visits counted over the layout object `lay` (None: every
    step; the hierarchical region's ring runs over comms/hierarchical/levels.py's node layout)."""
    s = shape
    visited = s.world
    if lay is not None and s.dense_mask is not None and s.dense_mask[2] is not None:
        _, causal, window = s.dense_mask
        visited = len(visited_steps(lay, s.world, s.tokens // lay.chunks_per_rank, causal, window))
    return _shift_bytes(shape, visited)


def _shift_bytes(s: WireShape, visited: int) -> tuple[int, int]:
    """(forward, backward) bytes of a ring that visits `visited` steps."""
    kv = s.tokens * s.batch * s.kv_heads * (s.head_dim + s.v_head_dim)
    grad_shifts = visited if visited > 1 else 0  # from each visited step to the next, and home
    return (visited - 1) * kv * s.elt, (visited - 1) * kv * s.elt + grad_shifts * kv * s.acc_elt


def rank_blocks(
    layout: str, causal: bool, rank: int, world: int, local_len: int, window: tuple[int, int] | None = None
) -> list[Block]:
    """Every block this rank runs, over all ring steps (each against that step's held K/V)."""
    lay = get_layout(layout)
    steps = ring_blocks(lay, world, rank, local_len // lay.chunks_per_rank, causal, window)
    return [b for step in steps for b in step]

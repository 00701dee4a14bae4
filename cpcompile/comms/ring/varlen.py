"""The ring CP region for packed documents (varlen_attn under thd / thd_zigzag, comm="ring").

The same ring as comms/ring/dense.py over the packed (2, L, Hkv, D) K/V (MLA: (L, Hkv, D + Dv)): at each step the
held rank's K/V are attended with that step's varlen blocks (comms/ring/schedule.py, computed from the GLOBAL
cu_seqlens with device ops, so documents change without recompiling), the partial outputs merged by LSE in
fp32. Every step's blocks and kernel metadata (masks, cu_seqlens, lse slots: executor.varlen_meta) are built
before the step loop, in the graph, so a step's host work is its kernel call, its merge and its shift.
Backward sends each held chunk's K/V gradient on with the chunk, in fp32, home after one circle. Under a causal
sliding window the steps' blocks are layouts/packed_band.py's (exact per document on every provider), and the
ring visits only the steps some rank can reach (thd: the neighbours' for a window shorter than a rank's piece;
comms/ring/schedule.packed_visited_steps), shifting by the gap between two and sending each gradient home from the last.
"""

from __future__ import annotations

import torch

from ... import executor
from ...comm.pending import in_backward, start_shift, wait
from ...executor.blocks import encode_varlen
from ...executor.packed_kv import pack_kv, unpack_kv
from ...executor.varlen_meta import prepare_blocks
from ...layouts.block import NO_WINDOW
from ...regions.deferred import merge_all, sum_all
from ...regions.partials import add_part, merge_step
from .schedule import packed_step_blocks, packed_visited_steps, packed_window, step_gap

KV_DIM = 0
"""K and V stack on dim 0 of the held buffer, (2, L, Hkv, D): each is a contiguous view. Chosen while cuDNN's THD
backward copied strided q/k/v first (two K/V copies at every backward step with them on dim 1); it now reads
token-major views in place (cudnn_varlen.token_major), so either stacking would do there."""


def _step_inputs(spec: list[int], ranges, held, qk_dim):
    k, v = unpack_kv(held, KV_DIM, qk_dim)
    return [k], [v], list(ranges), spec


class _RingVarlenAttention(torch.autograd.Function):
    """Forward and backward of the packed ring; step s has `counts[s]` = (ranges tensors, metadata tensors) of
    the trailing tensors (0 ranges: no work), its metadata prepared once per batch (executor.varlen_meta)."""

    @staticmethod
    def forward(ctx, q, k, v, specs, counts, visited, scale, kernel, group_name, rank, world, deferred, *tensors):
        held = mine = pack_kv(k, v, KV_DIM)
        d = q.shape[-1]
        acc = lse = None
        parts = []  # deferred: every step's partial, merged once after the last step (regions/deferred.py)
        for i, (spec, (rs, meta)) in enumerate(zip(specs, _per_step(tensors, counts))):
            gap = step_gap(visited, i, world)
            pending = start_shift(held, group_name, rank, world, gap) if i + 1 < len(visited) else None
            if rs:
                ks, vs, rl, spec = _step_inputs(spec, rs, held, d)
                o, l = executor.attend_varlen(q, ks, vs, rl, spec, scale, kernel, list(meta))
                if deferred:
                    parts.append((o, l, 0))
                else:
                    acc, lse = merge_step(acc, lse, o, l, lse_last=False)
            if pending is not None:
                held = wait(pending).view(held.shape)
        if deferred:
            acc, lse = merge_all(parts, q.shape[0], lse_last=False)
        out = acc.to(q.dtype)
        ctx.save_for_backward(q, mine, out, lse, *tensors)
        ctx.args = (specs, counts, visited, scale, kernel, group_name, rank, world, deferred)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, held, out, lse, *tensors = ctx.saved_tensors
        specs, counts, visited, scale, kernel, group_name, rank, world, deferred = ctx.args
        dout, d = dout.contiguous(), q.shape[-1]
        dq_parts = []
        held = in_backward(held, dout)  # keeps the K/V shifts in the backward graph (comm/pending.py)
        dq = travel = pending_grad = None
        for i, (spec, (rs, meta)) in enumerate(zip(specs, _per_step(tensors, counts))):
            gap = step_gap(visited, i, world)
            pending = start_shift(held, group_name, rank, world, gap) if i + 1 < len(visited) else None
            part = None
            if rs:
                ks, vs, rl, spec = _step_inputs(spec, rs, held, d)
                dq_s, (dk,), (dv,) = executor.attend_varlen_backward(
                    dout, q, ks, vs, out, lse, rl, spec, scale, kernel, list(meta)
                )
                if deferred:
                    dq_parts.append((dq_s, 0))
                else:
                    dq = add_part(dq, dq_s)
                part = add_part(None, pack_kv(dk, dv, KV_DIM))
            if pending_grad is None:  # step 0: the rank's own K/V
                travel = part
            else:  # the held chunk's gradient so far arrived with it: add this rank's part, send it on
                travel = add_part(wait(pending_grad).view(held.shape), part)
            # on with the chunk to the next visited step; after the last, home to the chunk's owner
            pending_grad = start_shift(travel, group_name, rank, world, gap) if gap % world else None
            if pending is not None:
                held = wait(pending).view(held.shape)
        home = travel if pending_grad is None else wait(pending_grad).view(held.shape)
        dk, dv = unpack_kv(home.to(held.dtype), KV_DIM, d)
        dq = sum_all(dq_parts, None, q.dtype) if deferred else dq.to(q.dtype)
        return dq, dk, dv, *([None] * (9 + len(tensors)))


def _per_step(tensors: tuple, counts: tuple[tuple[int, int], ...]) -> list[tuple[tuple, tuple]]:
    """Each step's (ranges, metadata) out of the flat trailing tensors."""
    out, at = [], 0
    for n_ranges, n_meta in counts:
        out.append((tuple(tensors[at : at + n_ranges]), tuple(tensors[at + n_ranges : at + n_ranges + n_meta])))
        at += n_ranges + n_meta
    return out


def ring_varlen_attention(
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
    deferred_merge: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """varlen_attn of this rank's packed q over every rank's K/V (same document only, causal when asked, within
    a causal sliding `window` (w, -1) when given), the K/V arriving one rank at a time; `deferred_merge`: every
    step's partial kept and merged once after the last step (regions/deferred.py). Returns (out, lse
    (Hq, T_local) fp32, rng_state) like torch_attn._varlen_attn."""
    local = q.shape[0]
    window = packed_window(tuple(window), causal, max_doc, local * world)
    visited = packed_visited_steps(layout, local, world, window, causal, max_doc)
    steps = [packed_step_blocks(layout, cu_seqlens, local, world, rank, s, causal, max_doc, window) for s in visited]
    specs = tuple(encode_varlen(blocks) for blocks in steps)
    tensors, counts = [], []
    for blocks, spec in zip(steps, specs):  # every step's metadata, here in the graph: none in the step loop
        ranges = [b.ranges for b in blocks]
        meta = prepare_blocks(ranges, spec, local, [k.shape[0]], kernel)
        tensors += ranges + meta
        counts.append((len(ranges), len(meta)))
    args = (specs, tuple(counts), visited, scale, kernel, group_name, rank, world, bool(deferred_merge))
    out, lse = _RingVarlenAttention.apply(q, k, v, *args, *tensors)
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    return out, lse.to(torch.float32), rng_state


def rank_blocks(
    layout: str,
    causal: bool,
    rank: int,
    world: int,
    local_len: int,
    cu_seqlens: torch.Tensor,
    max_doc: int | None = None,
    window: tuple[int, int] = NO_WINDOW,
) -> list:
    """Every varlen block this rank runs, over the visited ring steps (each against that step's held K/V)."""
    window = packed_window(tuple(window), causal, max_doc, local_len * world)
    return [
        block
        for step in packed_visited_steps(layout, local_len, world, window, causal, max_doc)
        for block in packed_step_blocks(layout, cu_seqlens, local_len, world, rank, step, causal, max_doc, window)
    ]

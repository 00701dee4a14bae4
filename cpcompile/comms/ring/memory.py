"""What the ring's deferred merge (backend(deferred_merge=True), regions/deferred.py) costs in memory, for
explain(): the bytes it holds beyond the running merge, forward and backward, on the rank that holds the most."""

from __future__ import annotations

import torch

from ...layouts import get_layout
from ...precision import acc_dtype
from ...regions.deferred import extra_bytes
from .dense import step_rows
from .schedule import packed_visited_steps, packed_window, ring_blocks, visited_steps


def _elt(dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of the io dtype, bytes of its accumulation dtype)."""
    return torch.empty((), dtype=dtype).element_size(), torch.empty((), dtype=acc_dtype(dtype)).element_size()


def _bytes(rows: list[int], total: int, batch_heads: int, d: int, dv: int, dtype: torch.dtype) -> tuple[int, int]:
    elt, acc = _elt(dtype)
    fwd = extra_bytes(rows, batch_heads * dv * elt, batch_heads * 4, batch_heads * dv * acc, total)
    bwd = extra_bytes(rows, batch_heads * d * elt, 0, batch_heads * d * acc, total)
    return fwd, bwd


def dense_deferred_bytes(plan) -> tuple[int, int]:
    """(forward, backward) bytes: every visited step's partial output (the q rows it reaches) and lse alive until
    the merge after the last step, and backward every step's dq partial, against the running fp32 sums; the
    largest over the ranks (zigzag's rank 0 reaches only its back chunk at later steps, the last rank all rows)."""
    b, hq, length, d = plan.site.q_shape
    dv = plan.site.v_shape[-1]
    lay = get_layout(plan.layout)
    chunk = length // lay.chunks_per_rank
    world = plan.group.size
    window = plan.window
    visited = visited_steps(lay, world, chunk, plan.causal, window)
    worst = (0, 0)
    for rank in range(world):
        every = ring_blocks(lay, world, rank, chunk, plan.causal, window)
        spans = [step_rows(every[s], length, i == 0) for i, s in enumerate(visited) if every[s]]
        got = _bytes([end - start for start, end in spans], length, b * hq, d, dv, plan.site.dtype)
        worst = max(worst, got)
    return worst


def varlen_deferred_bytes(plan) -> tuple[int, int]:
    """(forward, backward) bytes, at most: every visited step's partial over all T rows (a step whose held pieces
    share no document with this rank's has none; that depends on the batch, so every step is counted)."""
    t, hq, d = plan.site.q_shape
    dv = plan.site.v_shape[-1]
    world = plan.group.size
    window = packed_window(tuple(plan.window), plan.causal, plan.max_doc, t * world)
    steps = len(packed_visited_steps(plan.layout, t, world, window))
    return _bytes([t] * steps, t, hq, d, dv, plan.site.dtype)

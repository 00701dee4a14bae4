"""What the ring's deferred merge (backend(deferred_merge=True), regions/deferred.py) costs in memory, for
explain(): the bytes it holds beyond the running merge, forward and backward, on the rank that holds the most."""

from __future__ import annotations

import torch

from ...executor import traced
from ...layouts import get_layout
from ...precision import acc_dtype
from ...regions.deferred import extra_bytes
from .dense import step_rows
from .schedule import packed_visited_steps, packed_window, ring_blocks, visited_steps


def _elt(dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of the io dtype, bytes of its accumulation dtype)."""
    return dtype.itemsize, acc_dtype(dtype).itemsize


def _one_call(blocks: list, span: tuple[int, int], kernel: str) -> bool:
    """Whether the executor returns the step's partial as one traced kernel call wrote it (its io dtype): a single
    block over every row of the span on a traceable provider; else the partial is merged or returned in fp32."""
    if len(blocks) != 1 or not traced(kernel):
        return False
    b = blocks[0]
    return (b.q_start, b.q_start + b.q_len) == span


def dense_deferred_bytes(plan) -> tuple[int, int]:
    """(forward, backward) bytes: every visited step's partial output (the q rows it reaches, in the dtype the
    executor returns it) and lse alive until the merge after the last step, and backward every step's dq
    partial, against the running fp32 sums and one partial; the largest over the ranks (zigzag's rank 0 reaches
    only its back chunk at later steps, the last rank all rows)."""
    b, hq, length, d = plan.site.q_shape
    dv = plan.site.v_shape[-1]
    elt, acc = _elt(plan.site.dtype)
    lay = get_layout(plan.layout)
    chunk = length // lay.chunks_per_rank
    world = plan.group.size
    visited = visited_steps(lay, world, chunk, plan.causal, plan.window)
    worst = (0, 0)
    for rank in range(world):
        every = ring_blocks(lay, world, rank, chunk, plan.causal, plan.window)
        fwd, bwd = [], []
        for i, s in enumerate(visited):
            if not every[s]:
                continue
            start, end = step_rows(every[s], length, i == 0)
            size = acc if not _one_call(every[s], (start, end), plan.kernel) else elt
            fwd.append((end - start) * b * hq * (dv * size + 4))
            bwd.append((end - start) * b * hq * d * size)
        running = (
            length * b * hq * (dv * acc + 4) + max(fwd, default=0),
            length * b * hq * d * acc + max(bwd, default=0),
        )
        worst = max(worst, (extra_bytes(fwd, running[0]), extra_bytes(bwd, running[1])))
    return worst


def varlen_deferred_bytes(plan) -> tuple[int, int]:
    """(forward, backward) bytes, at most: every visited step's partial over all T rows (a visited step whose
    held pieces share no document with this rank's has none; that depends on the batch, so every visited step is
    counted); its output
    in the io dtype (the varlen executor rounds its blocks' merge once), its dq in fp32 (several blocks a step
    sum in fp32; one block's dq would be the io dtype, so this is the bound)."""
    t, hq, d = plan.site.q_shape
    dv = plan.site.v_shape[-1]
    elt, acc = _elt(plan.site.dtype)
    world = plan.group.size
    window = packed_window(tuple(plan.window), plan.causal, plan.max_doc, t * world)
    steps = len(packed_visited_steps(plan.layout, t, world, window, plan.causal, plan.max_doc))
    part_fwd, part_bwd = t * hq * (dv * elt + 4), t * hq * d * acc
    fwd = extra_bytes([part_fwd] * steps, t * hq * (dv * acc + 4) + part_fwd)
    bwd = extra_bytes([part_bwd] * steps, t * hq * d * acc + part_bwd)
    return fwd, bwd

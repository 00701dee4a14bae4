"""Pure bookkeeping for the block executor: batch same-shaped blocks into one kernel call, cut row ranges
into segments by which partial results cover them. No kernels, no collectives.

A block is (q_start, q_len, source, kv_start, kv_len, causal). Blocks with the same shape, source and mask
whose q starts and kv starts step evenly (e.g. zigzag's two causal squares) run as ONE call: with batch 1, q
rows [a, a+n) and [a+d, a+d+n) are the two entries of a strided (2, H, n, D) view, no copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .blocks import BlockTuple


@dataclass(frozen=True)
class Call:
    """One kernel call: blocks `members` (indices into the block list), batched when there are several."""

    members: tuple[int, ...]
    q_start: int
    q_step: int
    q_len: int
    source: int
    kv_start: int
    kv_step: int
    kv_len: int
    causal: bool
    window: tuple[int, int] | None = None
    """The blocks' window (layouts.Block.window), None: causal or unmasked."""


def plan_calls(
    blocks: Sequence[BlockTuple], batch: int, windows: Sequence[tuple[int, int] | None] | None = None
) -> list[Call]:
    """Group blocks into kernel calls; with batch > 1 the batch dim is taken, so every block is its own call.
    `windows`: each block's window (None: no block has one); only blocks with the same window share a call."""
    windows = windows or [None] * len(blocks)
    groups: dict[tuple, list[int]] = {}
    for i, (_, qn, src, _, kn, causal) in enumerate(blocks):
        groups.setdefault((qn, src, kn, causal, windows[i]), []).append(i)
    calls: list[Call] = []
    for (qn, src, kn, causal, window), idx in groups.items():
        idx = sorted(idx, key=lambda i: blocks[i][0])
        q_steps = {blocks[b][0] - blocks[a][0] for a, b in zip(idx, idx[1:])}
        kv_steps = {blocks[b][3] - blocks[a][3] for a, b in zip(idx, idx[1:])}
        even = len(q_steps) == 1 and len(kv_steps) == 1 and min(q_steps) > 0 and min(kv_steps) > 0
        if batch == 1 and len(idx) > 1 and even:
            first = blocks[idx[0]]
            calls.append(Call(tuple(idx), first[0], min(q_steps), qn, src, first[3], min(kv_steps), kn, causal, window))
        else:
            for i in idx:
                q0, _, _, k0, _, _ = blocks[i]
                calls.append(Call((i,), q0, 0, qn, src, k0, 0, kn, causal, window))
    return sorted(calls, key=lambda c: c.members[0])


def batched_rows(t: torch.Tensor, start: int, step: int, length: int, count: int, dim: int) -> torch.Tensor:
    """Rows [start + i*step, start + i*step + length) of `t` (batch 1) along `dim`, as a new leading batch dim
    of size `count` (a strided view; with count 1, simply the narrowed rows).

    Built from view ops defined on the tensor's values (narrow, unfold, movedim), never `as_strided`, whose
    strides and offset are relative to the storage: a compiler that materialises `t` into a buffer of its own
    (Inductor may) would read the wrong rows."""
    if count == 1:
        return t if start == 0 and length == t.shape[dim] else t.narrow(dim, start, length)
    dim = dim % t.dim()
    assert t.shape[0] == 1, "batched block calls need batch 1"
    span = (count - 1) * step + length
    windows = t.narrow(dim, start, span).unfold(dim, length, step)  # the windows at `dim`, their rows last
    return windows.movedim(-1, dim + 1).movedim(dim, 0).squeeze(1)


def segments(total: int, pieces: Sequence[tuple[int, int]]) -> list[tuple[int, int, list[int]]]:
    """Cut [0, total) at every piece boundary; for each segment (start, end, [indices of covering pieces])."""
    cuts = sorted({0, total, *(p[0] for p in pieces), *(p[0] + p[1] for p in pieces)})
    out = []
    for a, b in zip(cuts, cuts[1:]):
        cover = [i for i, (s, n) in enumerate(pieces) if s <= a and b <= s + n]
        out.append((a, b, cover))
    return out

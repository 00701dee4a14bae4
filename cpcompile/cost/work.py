"""What one attention kernel call computes, counted from a layout's blocks (pure math, no kernels, no timing).

A call is a set of sequences: sequence i's q rows attend its keys bottom-right aligned (a q range is the last
tokens of its key range), causal or not, within an optional flash-attn window, exactly as the executor hands
them to a kernel (layouts' Block / VarlenBlock). The cost model (cost/rates.py) reads these counts:

- pairs: (q row, key) pairs the mask keeps; FLOPs follow from them (`flops`);
- tiles: 128 x 128 score tiles holding a kept pair: what a tiled kernel computes (short sequences pad them);
- rect_tiles: the tiles of each sequence's whole q x k rectangle (a kernel that does not skip masked tiles);
- ctas: q tiles plus k tiles of non-empty sequences (the forward's and backward's work units);
- grid_q / grid_k: launched (sequence x tile) slots up to the call's static bounds max_q / max_k, empty or not
  (varlen kernels size their grids by the bounds, since documents are unknown at compile time);
- br_tiles: the tiles of a masked call anchored bottom-right, i.e. one whose block does not vouch that all its
  ranges are square: cuDNN THD's bottom-right kernel, slower than its top-left one (1.6-1.8x on whole
  documents, docs/benchmarks.md);
- calls: kernel launches.
Counts are per head; `q_heads` says how many heads the call runs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..executor.blocks import decode_dense, encode_dense
from ..executor.calls import plan_calls
from ..layouts.block import NO_WINDOW

TILE = 128


@dataclass(frozen=True)
class CallWork:
    """The counts of one or more kernel calls (per head; they add up over calls with the same heads)."""

    pairs: int = 0
    tiles: int = 0
    rect_tiles: int = 0
    ctas: int = 0
    grid_q: int = 0
    grid_k: int = 0
    br_tiles: int = 0
    calls: int = 0

    def __add__(self, other: CallWork) -> CallWork:
        return CallWork(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


def _ceil(x: torch.Tensor | int) -> torch.Tensor | int:
    return (x + TILE - 1) // TILE


def _positive_sum(c: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """sum over t in [0, n) of max(0, c + t), per entry (closed form)."""
    start = (-c).clamp(min=0)
    count = (n - start).clamp(min=0)
    return count * (2 * (c + start) + count - 1) // 2


def _row_bounds(t: torch.Tensor, a: torch.Tensor, b: torch.Tensor, causal: bool, window) -> tuple:
    """(first, last) key each row t of a sequence (a q rows, b keys, bottom-right) sees."""
    left, right = window
    diag = b - a + t
    hi = diag if causal else (b - 1 if right < 0 else torch.minimum(b - 1, diag + right))
    lo = torch.zeros_like(diag) if left < 0 else (diag - left).clamp(min=0)
    return lo, hi


def sequence_work(
    q_lens: torch.Tensor,
    k_lens: torch.Tensor,
    causal: bool,
    window: tuple[int, int] = NO_WINDOW,
    *,
    bound_q: int | None = None,
    bound_k: int | None = None,
    launched: int | None = None,
    top_left: bool = False,
) -> CallWork:
    """The counts of ONE kernel call over sequences of (q_lens[i], k_lens[i]) (int64 tensors, q_len <= k_len
    when causal). `bound_q`/`bound_k` (default: the longest) and `launched` (default: the number of sequences)
    give the grid the kernel launches; the dense kernels launch exactly their tiles. `top_left`: the call's
    block vouches that its ranges are square (no br_tiles). O(sequences + q tiles)."""
    a, b = q_lens.long().cpu(), k_lens.long().cpu()
    keep = a > 0
    a, b = a[keep], b[keep]
    launched = int(q_lens.numel()) if launched is None else launched
    bound_q = int(a.max()) if bound_q is None and a.numel() else (bound_q or 0)
    bound_k = int(b.max()) if bound_k is None and b.numel() else (bound_k or 0)
    grid = CallWork(grid_q=launched * _ceil(bound_q), grid_k=launched * _ceil(bound_k), calls=1)
    if not a.numel():
        return grid
    left, right = window
    # pairs: sum over rows of (hi - lo + 1), hi = min(diag + right, b - 1), lo = max(diag - left, 0)
    diag0 = b - a  # row 0's diagonal key
    if causal or right >= 0:
        reach = 0 if causal else right
        his = a * (diag0 + reach) + a * (a - 1) // 2 - _positive_sum(diag0 + reach - (b - 1), a)
    else:
        his = a * (b - 1)
    los = 0 if left < 0 else _positive_sum(diag0 - left, a)
    pairs = int((his - los + a).sum())
    # tiles: per q tile, the key tiles from its first row's first key to its last row's last key
    per_seq = _ceil(a)
    seq = torch.repeat_interleave(torch.arange(a.numel()), per_seq)
    first = (torch.arange(seq.numel()) - torch.repeat_interleave(torch.cumsum(per_seq, 0) - per_seq, per_seq)) * TILE
    last = torch.minimum(first + TILE - 1, a[seq] - 1)
    lo, _ = _row_bounds(first, a[seq], b[seq], causal, window)
    _, hi = _row_bounds(last, a[seq], b[seq], causal, window)
    tiles = int(torch.where(hi >= lo, hi // TILE - lo // TILE + 1, 0).sum())
    banded = (causal or left >= 0 or right >= 0) and not top_left
    rect = int((per_seq * _ceil(b)).sum())
    ctas = int((per_seq + _ceil(b)).sum())
    counts = dict(pairs=pairs, tiles=tiles, rect_tiles=rect, ctas=ctas)
    return grid + CallWork(**counts, br_tiles=tiles if banded else 0)


def dense_work(blocks: list, batch: int) -> CallWork:
    """The counts of a rank's dense blocks (layouts.Block) as the executor runs them: one call per group of
    same-shaped blocks (executor.calls.plan_calls), every block a causal square, a full rectangle or a windowed
    band (its flash-attn window on the bottom-right diagonal), x batch."""
    total = CallWork()
    tuples = decode_dense(encode_dense(blocks))
    for call in plan_calls(tuples, batch, [b.window for b in blocks]):
        n = len(call.members) * batch
        q = torch.full((n,), call.q_len)
        k = torch.full((n,), call.kv_len)
        total = total + sequence_work(q, k, call.causal, call.window or NO_WINDOW)
    return total


def varlen_work(block) -> CallWork:
    """The counts of one varlen block (layouts.thd.VarlenBlock) as the CUDA varlen providers launch it: its
    ranges as sequences, plus the gaps between them (2B+1 sequences) unless the ranges tile both buffers
    (B+1: kernels.varlen_ranges), in a grid bounded by the block's static max_q / max_k, anchored top-left when
    the block is square."""
    qs, qe, ks, ke = block.ranges.long().cpu()
    tiled = block.covers_rows and block.covers_keys
    sequences = qs.numel() if tiled else 2 * qs.numel() + 1
    return sequence_work(
        qe - qs,
        ke - ks,
        block.causal,
        tuple(block.window),
        bound_q=block.max_q,
        bound_k=block.max_k,
        launched=sequences,
        top_left=block.square,
    )


def flops(pairs: int, q_heads: int, head_dim: int, v_head_dim: int, backward: bool = True) -> float:
    """FLOPs of attention over `pairs` kept (q, key) pairs: forward q.k^T and p.v (2 multiply-adds each), the
    backward's recomputed q.k^T, dv, dp, dq and dk; 7 * 2 * pairs * H * D for equal head dims, the count the
    benchmarks use."""
    forward = 2 * pairs * q_heads * (head_dim + v_head_dim)
    return forward + (2 * pairs * q_heads * (3 * head_dim + 2 * v_head_dim) if backward else 0)

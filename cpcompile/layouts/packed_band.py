"""A causal sliding window between a q piece and an EARLIER key piece of the same document, as varlen blocks whose
one static window is exact for every document (the packed ring's steps: comms/ring/schedule.py).

Under a causal window w, key k (global position) is visible to row q iff q - w <= k <= q. The varlen kernels
anchor a window at each sequence's bottom-right corner: with a sequence's rows ending at qend and its keys at
kend, (left, right) means -left <= (k - q) - (kend - qend) <= right. That is the global band for every sequence
only when kend - qend is the same constant for all of them; on a held piece of an earlier rank it is not (the
distance from a document's last local row to its last held key depends on where the document ends). So per
document, with rows [a, b) and keys [c, e), e <= a (every key before every row: k <= q holds):
- rows from e + w on see no key: rows [a, b'), b' = min(b, e + w);
- keys from kappa = b' - w on are seen by every one of those rows: one UNMASKED block, keys [kappa, e);
- keys [max(c, a - w), kappa) (none before a - w is seen) end exactly w before the rows, kend - qend = -w for
  every document: one block with window (0, w), exact everywhere (FA2's window_size, cuDNN's bottom-right
  band, the CPU mask). Every row of it sees a key (key kappa - 1 lies in [q - w, q] for every q < b').
A document whose part is empty gets empty rows AND keys (no kernel sees a sequence with rows but no keys).
The kernels take ranges as cu_seqlens, each range then its gap as one sequence (kernels/varlen_ranges.py), and a
gap with rows AND keys would attend them (garbage the executor masks, but up to a chunk squared of work). So each
range is preceded by a key-only range holding the keys since the previous one: every gap is then rows only. The
fillers are as long as the stretches between the parts, so the blocks' static bounds are the caller's `bound`
for any stretch of its buffers (the local length), not the band's width.
tests/unit/test_ring_window_blocks.py checks the blocks against a brute-force global-position mask.
"""

from __future__ import annotations

import torch

from .thd import VarlenBlock, interleave, qk_ranges

HELD = 0


def earlier_keys_band(
    q0: torch.Tensor,
    q1: torch.Tensor,
    q_offset: torch.Tensor | int,
    k0: torch.Tensor,
    k1: torch.Tensor,
    k_offset: torch.Tensor | int,
    w: int,
    bound: int,
) -> list[VarlenBlock]:
    """The (windowed, unmasked) blocks of local q rows [q0, q1) against held keys [k0, k1), per document, whose
    global positions are local + q_offset / + k_offset, every key before every row, under a causal window w >= 0.
    `bound`: a static bound of any stretch of the local rows or the held keys (the blocks' max_q and max_k)."""
    a, b = q0 + q_offset, q1 + q_offset  # global rows
    c, e = k0 + k_offset, k1 + k_offset  # global keys
    b_seen = torch.minimum(b, e + w)  # rows past e + w - 1 see no key
    rows = (b_seen > a) & (e > c)
    kappa = torch.minimum(torch.maximum(b_seen - w, c), e)  # keys from here on: seen by every row
    first = torch.maximum(c, a - w)  # the first key some row sees
    band = rows & (kappa > first)
    full = rows & (e > kappa)
    row_end = b_seen - q_offset
    windowed = _flanked(
        q0,
        torch.where(band, row_end, q0),
        torch.where(band, first - k_offset, k0),
        torch.where(band, kappa - k_offset, k0),
    )
    unmasked = _flanked(
        q0, torch.where(full, row_end, q0), torch.where(full, kappa - k_offset, k0), torch.where(full, k1, k0)
    )
    return [VarlenBlock(HELD, False, windowed, bound, bound, (0, w)), VarlenBlock(HELD, False, unmasked, bound, bound)]


def _flanked(q0: torch.Tensor, q1: torch.Tensor, k0: torch.Tensor, k1: torch.Tensor) -> torch.Tensor:
    """(4, 2B) ranges: before each range [q0, q1) x [k0, k1), a range without rows holding the keys since the
    previous range's end, so that no gap sequence has both rows and keys (the module docstring)."""
    since = torch.cat((k0[:1] * 0, k1[:-1]))
    return qk_ranges(interleave(q0, q0), interleave(q0, q1), interleave(since, k0), interleave(k0, k1))

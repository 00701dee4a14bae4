"""cuDNN THD's causal blocks of whole documents and cut pieces, as two calls on cuDNN's fast diagonal anchor.

A causal range whose q rows are the last n of its m keys (a cut piece: rows [a, b) of a document against its
keys [0, b)) needs the bottom-right anchor, and one such range puts the whole call on cuDNN 9.19's bottom-right
kernel, 1.6-1.8x slower than its top-left kernel on the same square mask (docs/benchmarks.md, "cuDNN THD"). The
range is the square of its last n keys (top-left causal) plus the rectangle of its first m - n keys (no mask):

    a cut piece, rows 4..6 of a document, keys 0..6        x: attended
              keys 0 1 2 3 | 4 5 6
        row 4      x x x x | x . .
        row 5      x x x x | x x .
        row 6      x x x x | x x x
                   rect      square (top-left causal)

so a block runs as two calls, each range addressed by its own ragged offsets (cudnn_graph.range_columns, as the
one call is):
    square  every range's rows against its last n keys, top-left causal (whole documents as they are)
    rect    the cut ranges' rows against their first m - n keys, unmasked; the other ranges empty
then the cut rows' outputs are merged by log-sum-exp (`merge`), their dq summed and dk/dv taken from the call that
owns each key, as the two calls' keys are disjoint (`combine`). Device ops only: traced with the provider,
Inductor fuses each into one kernel.
"""

from __future__ import annotations

import torch

from .base import range_ids
from .cudnn_graph import range_columns

SPLIT_COUNT = 13
"""How many tensors `prepare_split` returns: each call's four columns, the lse slots, the cut rows, the rect keys,
the dark rows."""


def parts(ranges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(square, rect) ranges of a causal (bottom-right) block. Square: each range's last s = min(n, m) rows
    against its last s keys (rows before them see no key); rect: a range with rows and more keys than rows, its
    rows against its first m - n keys; every other range empty there."""
    qs, qe, ks, ke = ranges
    n, m = qe - qs, ke - ks
    s = torch.minimum(n, m)
    cut = (m > n) & (n > 0)
    square = torch.stack((qe - s, qe, ke - s, ke))
    rect = torch.stack((qs, torch.where(cut, qe, qs), ks, torch.where(cut, ke - n, ks)))
    return square, rect


def prepare_split(ranges: torch.Tensor, tq: int, tk: int, slots) -> list[torch.Tensor]:
    """The split calls' metadata (SPLIT_COUNT tensors): the square's and the rect's `range_columns`, the lse slots
    both calls share (`slots(square)`: range i is sequence i in both), the rows of cut ranges (Tq,) and the keys
    of their rectangles (Tk,), and the dark rows (Tq,): rows of a range with keys that see none of them (more
    rows than keys), in neither call, which one bottom-right call leaves out = 0, lse = -inf, dq = 0; as bool."""
    square, rect = parts(ranges)
    rows = range_ids(rect[0], rect[1], tq) >= 0
    keys = range_ids(rect[2], rect[3], tk) >= 0
    qs, ke, ks = ranges[0], ranges[3], ranges[2]
    dark = range_ids(qs, torch.where(ke > ks, square[0], qs), tq) >= 0
    return [*range_columns(square), *range_columns(rect), *slots(square), rows, keys, dark]


def merge(
    o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor, rows: torch.Tensor, dark: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the square call's (o1, l1) with the rect call's (o2, l2) merged on `rows` (elsewhere the rect
    call wrote nothing: its values are never read), out = 0 and lse = -inf on the `dark` rows neither call wrote.
    out in o1's dtype, lse (Hq, Tq) fp32 contiguous."""
    l1, l2 = l1.float(), torch.where(rows[None], l2.float(), float("-inf"))
    lse = torch.where(dark[None], float("-inf"), torch.logaddexp(l1, l2))
    w1, w2 = (torch.exp(x - lse).t()[:, :, None] for x in (l1, l2))
    both = o1.float() * w1 + torch.where(rows[:, None, None], o2.float(), 0) * w2
    out = torch.where(rows[:, None, None], both, torch.where(dark[:, None, None], 0, o1.float()))
    return out.to(o1.dtype), lse.contiguous()


def combine(
    g1: tuple[torch.Tensor, ...],
    g2: tuple[torch.Tensor, ...],
    rows: torch.Tensor,
    keys: torch.Tensor,
    dark: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of the square call's gradients `g1` and the rect call's `g2`: dq summed in fp32 on the cut
    `rows` (rounded once more there), 0 on the `dark` rows, dk/dv the rect call's on its `keys`, the square
    call's elsewhere."""
    r3, k3 = rows[:, None, None], keys[:, None, None]
    dq = torch.where(r3, (g1[0].float() + g2[0].float()).to(g1[0].dtype), g1[0].masked_fill(dark[:, None, None], 0))
    return dq, torch.where(k3, g2[1], g1[1]), torch.where(k3, g2[2], g1[2])

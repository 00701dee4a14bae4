"""The ring's deferred merge (backend(deferred_merge=True)): every step's partial kept, all merged once at the end.

The running merge (regions/partials.py) folds each step's partial into an fp32 running output: per step it
reads and writes that q-sized fp32 tensor, forward (the LSE merge) and backward (the dq sum), cp - 1 times a
layer. Deferred, a step only stores its partial and the merge runs once after the last step, as pointwise torch
ops that Inductor fuses into one pass over the cp partials: the same sum in fp32, rounded once, for a fraction
of the memory traffic. The price is memory: the cp partials (and their lse) are alive together until the end of
the region's forward, and the cp dq partials until the end of its backward (`extra_bytes`). A partial is in the
io dtype where one traced kernel call wrote all its rows, else in fp32 (the executor merged several calls, or an
opaque provider returned it so). No merge op runs inside the step loop, so nothing fused pulls a later step's
kernel ahead of the shift that overlaps it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..executor.accumulate import padded_rows
from ..executor.dense_run import merged, summed
from ..precision import acc_dtype

Partial = tuple[torch.Tensor, torch.Tensor, int]
"""(out, lse, start): one step's partial over q rows [start, start + its rows)."""


def merge_all(parts: Sequence[Partial], total: int, lse_last: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of every step's partial merged by LSE, in the accumulation dtype. Dense (`lse_last`): out
    (B, H, n, D) and lse (B, H, n), a partial over rows [start, start + n) of `total`; varlen: out (T, H, D) and
    lse (H, T), every partial over all T rows."""
    acc_t = acc_dtype(parts[0][0].dtype)
    if lse_last:
        outs = [padded_rows(o, s, total, -2, 0.0) for o, _, s in parts]
        lses = [padded_rows(x.to(acc_t), s, total, -1, float("-inf")) for _, x, s in parts]
        return merged(outs, lses, acc_t)
    out, lse = merged([o for o, _, _ in parts], [x.to(acc_t).t() for _, x, _ in parts], acc_t)
    return out, lse.t()


def sum_all(parts: Sequence[tuple[torch.Tensor, int]], total: int | None, dtype: torch.dtype) -> torch.Tensor:
    """The sum of every step's partial gradient, in the accumulation dtype, rounded once to `dtype`. Dense: a
    partial over rows [start, start + its rows) of `total` (dim -2); varlen (`total` None): every partial over
    all rows."""
    if total is None:
        return summed([p for p, _ in parts], dtype)
    return summed([padded_rows(p, s, total, -2, 0.0) for p, s in parts], dtype)


def extra_bytes(kept: Sequence[int], running: int) -> int:
    """The memory a deferred merge holds beyond the running one, in one direction: every step's partial (with its
    lse) alive together (`kept`, bytes each), against the running merge's fp32 output, its lse and one partial
    at a time (`running` bytes)."""
    return max(sum(kept) - running, 0)

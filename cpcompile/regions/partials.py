"""Combining the partial results of several executor calls in a region (ring steps; the all-gather's local
blocks, which run before the gather arrives, and its gathered blocks): in fp32, rounded once by the caller.

Through executor/accumulate.py's opaque ops, so a chain of cp steps keeps at most two partials alive."""

from __future__ import annotations

import torch

from ..executor import accumulate  # noqa: F401  (registers torch.ops.cpcompile.merge_partial / add_partial)
from ..precision import acc_dtype


def merge_step(acc, lse, out, step_lse, lse_last: bool = True, start: int = 0):
    """The running LSE merge of one more partial (out, step_lse) into (acc, lse), in the accumulation dtype;
    acc None: the first partial, which must cover every row. `lse_last`: lse is laid out like out without its
    last dim (dense); else lse is (H, T) against out (T, H, D) (varlen). The partial may cover only rows
    [start, start + its rows) (dense: dim -2): the others are kept. Rows with no key seen yet (-inf) merge
    exactly."""
    if acc is None:
        assert start == 0, "the first partial of a running merge covers every row"
        return out.to(acc_dtype(out.dtype)), step_lse.to(acc_dtype(out.dtype))
    return torch.ops.cpcompile.merge_partial(acc, lse, out, step_lse.to(lse.dtype), lse_last, start)


def add_part(total: torch.Tensor | None, part: torch.Tensor | None, start: int = 0) -> torch.Tensor | None:
    """total + part in the accumulation dtype (either may be None: nothing yet / nothing to add); `part` may
    cover only rows [start, start + its rows) of total (dim -2), once total covers every row."""
    if part is None:
        return total
    if total is None:
        assert start == 0, "the first part of a running sum covers every row"
        return part.to(acc_dtype(part.dtype))
    return torch.ops.cpcompile.add_partial(total, part, start)  # part in any dtype: summed in total's, rounded once

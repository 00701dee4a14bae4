"""Combining the partial results of several executor calls in a region (ring steps; the all-gather's local
blocks, which run before the gather arrives, and its gathered blocks): in fp32, rounded once by the caller."""

from __future__ import annotations

import torch

from ..precision import acc_dtype


def merge_step(acc, lse, out, step_lse, lse_last: bool = True):
    """The running LSE merge of one more partial (out, step_lse) into (acc, lse), in the accumulation dtype;
    acc None: the first partial. `lse_last`: lse is laid out like out without its last dim (dense); else lse
    is (H, T) against out (T, H, D) (varlen). Rows with no key seen yet (-inf) merge exactly."""
    if acc is None:
        return out.to(acc_dtype(out.dtype)), step_lse
    merged = torch.logaddexp(lse, step_lse)
    safe = torch.where(merged == float("-inf"), 0.0, merged)
    keep, add = torch.exp(lse - safe), torch.exp(step_lse - safe)
    if not lse_last:
        keep, add = keep.T, add.T
    return acc * keep.unsqueeze(-1) + out * add.unsqueeze(-1), merged


def add_part(total: torch.Tensor | None, part: torch.Tensor | None) -> torch.Tensor | None:
    """total + part in the accumulation dtype (either may be None: nothing yet / nothing to add)."""
    if part is None:
        return total
    part = part.to(acc_dtype(part.dtype))
    return part if total is None else total + part

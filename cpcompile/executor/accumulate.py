"""Running sums over several executor calls (the ring's steps), as ops Inductor cannot fuse across calls.

Written as torch ops, the ring's per-step merges and dq sums are pointwise, and Inductor fuses the whole chain
into one kernel after the last step: one pass, but every step's partial (a q-sized fp32 tensor) stays alive
until then, cp of them. As opaque ops each step folds its partial into the running result, so at most two are
alive, and the steps keep their program order (the next chunk's shift issued before the current step's
blocks).
"""

from __future__ import annotations

import torch

from .merge import merge_outputs, sum_into


def _as_bhsd(out: torch.Tensor, lse: torch.Tensor, lse_last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense (B, H, S, D) / (B, H, S) as they are; varlen (T, H, D) / (H, T) as (1, H, T, D) / (1, H, T) views."""
    return (out, lse) if lse_last else (out.transpose(0, 1).unsqueeze(0), lse.unsqueeze(0))


@torch.library.custom_op("cpcompile::merge_partial", mutates_args=())
def merge_partial(
    acc: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, out_lse: torch.Tensor, lse_last: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(acc, lse) merged with one more partial (out, out_lse) over other keys, by LSE, in acc's dtype.
    `lse_last`: lse is out's shape without its last dim (dense); else out is (T, H, D) and lse (H, T)."""
    new_acc, new_lse = torch.empty_like(acc), torch.empty_like(lse)
    dst, dst_lse = _as_bhsd(new_acc, new_lse, lse_last)
    parts = [_as_bhsd(acc, lse, lse_last), _as_bhsd(out, out_lse, lse_last)]
    merge_outputs(dst, dst_lse, [p[0] for p in parts], [p[1] for p in parts])
    return new_acc, new_lse


@merge_partial.register_fake
def _merge_partial_fake(acc, lse, out, out_lse, lse_last):
    return torch.empty_like(acc), torch.empty_like(lse)


@torch.library.custom_op("cpcompile::add_partial", mutates_args=())
def add_partial(total: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """total + part in total's dtype (the accumulation dtype), rounded once."""
    out = torch.empty_like(total)
    sum_into(out, [total, part])
    return out


@add_partial.register_fake
def _add_partial_fake(total, part):
    return torch.empty_like(total)

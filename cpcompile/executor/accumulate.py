"""Running sums over several executor calls (the ring's steps): one more partial folded into the running result.

Written as plain torch ops, the ring's per-step merges and dq sums are pointwise, and Inductor fuses the whole
chain into one kernel after the last step: one pass, but every step's partial (a q-sized tensor) stays alive
until then, cp of them. So each fold is an op of its own that Inductor does not fuse across: a
`torch.library.triton_op`, whose Triton kernel (merge_triton.py) Inductor launches from its own code on CUDA, no
Python of ours at run time; on other devices (or tensors the kernel does not take) its body is the same
arithmetic as torch ops. At most two partials are then alive, and the steps keep their program order (the next
chunk's shift issued before the current step's blocks).
"""

from __future__ import annotations

import torch
from torch.library import triton_op

from ..precision import acc_dtype
from . import merge_triton
from .dense_run import merged


def _as_bhsd(out: torch.Tensor, lse: torch.Tensor, lse_last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense (B, H, S, D) / (B, H, S) as they are; varlen (T, H, D) / (H, T) as (1, H, T, D) / (1, H, T) views."""
    return (out, lse) if lse_last else (out.transpose(0, 1).unsqueeze(0), lse.unsqueeze(0))


def _fused(*tensors: torch.Tensor) -> bool:
    """Whether merge_triton's kernel takes these (CUDA, Triton importable, unit last strides, not fp64)."""
    return (
        merge_triton.available()
        and all(t.is_cuda and t.dtype != torch.float64 and t.stride(-1) == 1 for t in tensors)
        and tensors[0].dim() == 4
    )


def padded_rows(part: torch.Tensor, start: int, total: int, dim: int, fill: float) -> torch.Tensor:
    """`part` over rows [start, start + its length) of `total` along `dim`, `fill` elsewhere (torch ops: the
    fused kernel reads a partial over some rows as it is; regions/deferred.py pads its partials with it)."""
    n = part.shape[dim]
    if start == 0 and n == total:
        return part
    shape = list(part.shape)
    pieces = []
    for length in (start, total - start - n):
        shape[dim] = length
        pieces.append(part.new_full(shape, fill))
    return torch.cat([pieces[0], part, pieces[1]], dim)


@triton_op("cpcompile::merge_partial", mutates_args=())
def merge_partial(
    acc: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, out_lse: torch.Tensor, lse_last: bool, start: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(acc, lse) merged with one more partial (out, out_lse) over other keys, by LSE, in acc's dtype.
    `lse_last`: lse is out's shape without its last dim (dense); else out is (T, H, D) and lse (H, T). The partial
    may cover only rows [start, start + its rows) of acc (a ring step that reaches some q rows): the rest of acc
    is kept as it is, and on CUDA the partial is read where it lies, never padded."""
    new_acc, new_lse = torch.empty_like(acc), torch.empty_like(lse)
    dst, dst_lse = _as_bhsd(new_acc, new_lse, lse_last)
    (a, la), (o, lo) = _as_bhsd(acc, lse, lse_last), _as_bhsd(out, out_lse, lse_last)
    if _fused(dst, a, o):
        merge_triton.merge(dst, dst_lse, [a, o], [la, lo], start)
        return new_acc, new_lse
    total = a.shape[-2]
    o, lo = padded_rows(o, start, total, -2, 0.0), padded_rows(lo, start, total, -1, float("-inf"))
    merged_out, merged_lse = merged([a, o], [la, lo], acc.dtype)
    if lse_last:
        return merged_out, merged_lse
    return merged_out.squeeze(0).transpose(0, 1), merged_lse.squeeze(0)  # back to (T, H, D) and (H, T)


@triton_op("cpcompile::add_partial", mutates_args=())
def add_partial(total: torch.Tensor, part: torch.Tensor, start: int = 0) -> torch.Tensor:
    """total + part in total's dtype (the accumulation dtype), rounded once; `part` may cover only rows
    [start, start + its rows) of total (dim -2)."""
    if _fused(total, part):
        out = torch.empty_like(total)
        merge_triton.add(out, [total, part], start)
        return out
    part = padded_rows(part, start, total.shape[-2], -2, 0.0)
    return (total.to(acc_dtype(total.dtype)) + part.to(acc_dtype(total.dtype))).to(total.dtype)

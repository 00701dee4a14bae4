"""Combine partial attention results: the log-sum-exp merge of outputs, and the sum of partial gradients.

Both are memory-bound elementwise work next to compute-bound kernels, so they must stay cheap. On CUDA the
output merge is one fused Triton pass (read each partial once, write the result once, fp32 in registers);
elsewhere, or with CPCOMPILE_MERGE=torch, a few in-place torch ops with an fp32 (fp64 for fp64) accumulator.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from ..precision import acc_dtype

MAX_FUSED = 4


def _use_triton(out: torch.Tensor, parts: Sequence[torch.Tensor]) -> bool:
    if os.environ.get("CPCOMPILE_MERGE", "auto") == "torch" or not out.is_cuda or len(parts) > MAX_FUSED:
        return False
    if out.dtype == torch.float64 or any(p.stride(-1) != 1 for p in (out, *parts)):
        return False
    from . import merge_triton

    return merge_triton.available()


def merge_outputs(
    out: torch.Tensor, lse: torch.Tensor, outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]
) -> None:
    """Write into `out` (B, H, n, D) and `lse` (B, H, n) the merge of partials (o_i, lse_i) over disjoint keys:
    lse = log(sum exp lse_i), out = sum exp(lse_i - lse) * o_i."""
    if len(outs) == 1:
        out.copy_(outs[0])
        lse.copy_(lses[0])
        return
    if _use_triton(out, outs):
        from . import merge_triton

        merge_triton.merge(out, lse, outs, lses)
        return
    acc_t = acc_dtype(out.dtype)
    stacked = torch.stack([part.to(acc_t) for part in lses])
    total = torch.logsumexp(stacked, dim=0)
    weights = torch.exp(stacked - total.masked_fill(total == float("-inf"), 0.0)).unsqueeze(-1)
    acc = torch.mul(outs[0], weights[0])
    for o, w in zip(outs[1:], weights[1:]):
        acc.addcmul_(o, w)
    out.copy_(acc)
    lse.copy_(total)


def sum_into(dst: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
    """dst = sum(parts), rounded once to dst's dtype: terms accumulate in fp32 (one fused Triton pass on CUDA).

    dst may be wider than the parts (the fp32 packed K/V gradient from bf16 kernel outputs): then the sum is
    exact in dst's dtype. (torch.add(bf16, bf16, out=fp32) computes in bf16 and would round first.)
    """
    wider = bool(parts) and any(p.dtype != dst.dtype for p in parts)
    if dst.dim() == 4 and (len(parts) > 2 or (wider and len(parts) > 1)) and _use_triton(dst, parts):
        from . import merge_triton

        merge_triton.add(dst, parts)
    elif not parts:
        dst.zero_()
    elif len(parts) == 1:
        dst.copy_(parts[0])
    elif len(parts) == 2 and not wider:
        torch.add(parts[0], parts[1], out=dst)
    elif dst.dtype == acc_dtype(dst.dtype):  # dst is already the accumulator: sum in place
        dst.copy_(parts[0])
        for p in parts[1:]:
            dst.add_(p)
    else:
        acc = parts[0].to(acc_dtype(dst.dtype))
        for p in parts[1:]:
            acc.add_(p)
        dst.copy_(acc)

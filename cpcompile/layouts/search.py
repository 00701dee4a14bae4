"""`sorted_search`: torch.searchsorted as one opaque op, for the packed layouts' index math traced into graphs.

Inductor lowers searchsorted to a Triton binary search on CUDA (on CPU it calls ATen), and in torch 2.11 that
lowering fails on a boundaries tensor that is a slice of another ("NotImplementedError: SliceView", seen on the
H200 compiling thd_balanced's plan checks). As a custom op Inductor calls ATen's kernel on a realized buffer,
on every device; these searches run over a few offsets a batch, so nothing is lost by not fusing them.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("cpcompile::sorted_search", mutates_args=())
def sorted_search(sorted_sequence: torch.Tensor, values: torch.Tensor, right: bool = True) -> torch.Tensor:
    """torch.searchsorted(sorted_sequence, values, right=right) (int64) for a 1-D sorted_sequence."""
    return torch.searchsorted(sorted_sequence.contiguous(), values.contiguous(), right=right)


@sorted_search.register_fake
def _sorted_search_fake(sorted_sequence, values, right=True):
    return values.new_empty(values.shape, dtype=torch.int64)

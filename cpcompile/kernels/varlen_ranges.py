"""Block ranges -> cu_seqlens, for the CUDA varlen providers (FA2 varlen, cuDNN THD): both take one prefix
array per side, from which each sequence's offset and length follow, so gaps between ranges must be sequences
too. Device ops only (no host sync); the output length depends only on the ranges' (static) shape.
"""

from __future__ import annotations

import torch


def adjacent_cu_seqlens(ranges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_q, cu_k), int32 of length 2B+1: range i, then the gap after it (q gap with k gap) as one sequence.

    Two sequences a range instead of three (fewer empty tiles in the grid). A gap sequence may attend gap rows
    to gap keys when both are non-empty (cpcompile's layouts never make both); that only writes rows and keys
    outside every range, which the executor masks out of the merge and sums.
    """
    qs, qe, ks, ke = ranges.long()
    cu_q = torch.cat((torch.stack((qs, qe), 1).flatten(), qe[-1:]))
    cu_k = torch.cat((torch.stack((ks, ke), 1).flatten(), ke[-1:]))
    return cu_q.int(), cu_k.int()


def tiled_cu_seqlens(ranges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_q, cu_k), int32 of length B+1, for ranges that tile both buffers (each starts where the previous
    ends, from 0 to the end): the starts plus the last end, no gap sequences (half the grid of the general
    encoding, whose empty gap sequences still launch their tiles)."""
    qs, qe, ks, ke = ranges.long()
    return torch.cat((qs, qe[-1:])).int(), torch.cat((ks, ke[-1:])).int()


def cu_seqlens(ranges: torch.Tensor, tiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's cu_seqlens: tiled (B+1 offsets) when the block vouches for it, else adjacent (2B+1)."""
    return (tiled_cu_seqlens if tiled else adjacent_cu_seqlens)(ranges)

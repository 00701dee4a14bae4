"""K and V in one buffer, so one collective carries both: the regions pack it, the executor reads it in place.

With one head dim for q, k and v, K and V are stacked on a new dim (the layout every measurement was taken
with). When v's head dim differs (MLA, e.g. q/k 192, v 128) they cannot stack, so they sit side by side on the
last dim instead: each token and head holds K's qk_dim values, then V's. Either way K and V are views of the
buffer (unit last stride) and the buffer's gradient has its shape, so the reduce-scatter needs no repack.
"""

from __future__ import annotations

import torch


def pack_kv(k: torch.Tensor, v: torch.Tensor, dim: int) -> torch.Tensor:
    """One buffer of K and V: stacked on a new dim `dim` when their head dims match, else side by side."""
    return torch.stack((k, v), dim) if k.shape[-1] == v.shape[-1] else torch.cat((k, v), -1)


def unpack_kv(packed: torch.Tensor, dim: int, qk_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) views of a `pack_kv` buffer (or of its gradient); `qk_dim` is K's head dim (q's)."""
    if packed.shape[-1] == qk_dim:  # stacked: K and V have one head dim
        return packed.select(dim, 0), packed.select(dim, 1)
    return packed[..., :qk_dim], packed[..., qk_dim:]

"""The all-gather CP region for packed documents (varlen_attn under the thd / thd_zigzag layouts)."""

from __future__ import annotations

import torch

from .. import varlen_executor  # noqa: F401  (registers torch.ops.cpcompile.attend_varlen_blocks)
from ..comm import gather_seq_first
from ..layouts.thd import get_packed_layout


def _gather_kv(k: torch.Tensor, v: torch.Tensor, group_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather packed K and V (tokens on dim 0) in one collective when their shapes match."""
    if k.shape == v.shape and k.dtype == v.dtype:
        gathered = gather_seq_first(torch.stack((k, v), dim=1), group_name)  # (T, 2, Hkv, D)
        return gathered[:, 0], gathered[:, 1]
    return gather_seq_first(k, group_name), gather_seq_first(v, group_name)


def all_gather_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    layout: str,
    causal: bool,
    scale: float,
    kernel: str,
    group_name: str,
    rank: int,
    world: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """varlen_attn of this rank's packed q over every rank's K/V, same document only (causal when asked).

    cu_seqlens are the GLOBAL document offsets. The layout turns them into block ranges with device ops of
    static shape (no host sync, no recompiles when documents change). Returns what torch_attn._varlen_attn
    returns: (out, lse (Hq, T_local) fp32, rng_state), so the node's users are unchanged.
    """
    lay = get_packed_layout(layout)
    lay.device_check(cu_seqlens, world)
    gk, gv = _gather_kv(k, v, group_name)
    blocks = lay.blocks(cu_seqlens, q.shape[0], world, rank, causal)
    spec = [i for b in blocks for i in (b.source, int(b.causal), b.max_q, b.max_k)]
    out, lse = torch.ops.cpcompile.attend_varlen_blocks(
        q, [k, gk], [v, gv], [b.ranges for b in blocks], spec, scale, kernel
    )
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    return out, lse.to(torch.float32), rng_state

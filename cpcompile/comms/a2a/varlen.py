"""The all-to-all (Ulysses) CP region for packed documents: varlen_attn under the `thd` and `thd_balanced` layouts.

thd shards the packed buffer rank-major, so after the heads<->tokens exchange every rank holds all T tokens
in GLOBAL order for its heads: the attention is that of cp=1, one varlen block over the whole buffer with
the global cu_seqlens unchanged (causal, full or sliding-window), and no reorder: head_parallel.head_parallel
over the varlen executor, through heads.PackedHeads. Packing, the exchange and GQA replication are heads.py's, on
(T, H, D) tensors seen as (1, H, T, D).
thd_balanced's ranks hold pieces, so the received buffer is put in global order first (one index_select of
q, k and v each, from the plan) and the output back in rank-major order after (one of the output and lse):
it works, but a2a balances causal work by itself, so thd_balanced only adds these copies over thd. Both are
permutations, so each one's gradient is a gather through the other (reorder.permute_rows), not a scatter-add.
"""

from __future__ import annotations

import torch

from ... import executor
from ...executor.blocks import encode_varlen
from ...executor.varlen_meta import prepare_blocks
from ...layouts.block import NO_WINDOW
from ...layouts.heads import HeadSplit
from ...layouts.thd import get_packed_layout, whole_sequence_blocks
from .head_parallel import head_parallel
from .heads import PackedHeads, replicate_kv, thd_as_bhsd, tokens_as_thd
from .reorder import permute_rows


def rank_blocks(
    layout: str,
    causal: bool,
    rank: int,
    world: int,
    local_len: int,
    cu_seqlens: torch.Tensor,
    max_doc: int | None = None,
    window: tuple[int, int] = NO_WINDOW,
) -> list:
    """The varlen blocks every rank runs after the exchange: cp=1's, over all world * local_len tokens (for its
    Hq/cp heads), from the GLOBAL offsets (thd_balanced's buffer is put in global order first)."""
    del rank
    offsets = get_packed_layout(layout).offsets(cu_seqlens, world)  # thd_balanced's plan starts with them
    return whole_sequence_blocks(offsets, world * local_len, causal, tuple(window), max_doc)


def a2a_varlen_attention(
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
    window: tuple[int, int] = NO_WINDOW,
    return_lse: bool = True,
    max_doc: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """varlen_attn of this rank's packed tokens (thd or thd_balanced), computed head-parallel after an all-to-all.

    Returns what torch_attn._varlen_attn returns: (out (L, Hq, Dv), lse (Hq, L) fp32, rng_state). The lse
    costs one more (small) all-to-all, so the planner asks for it only when the graph reads it
    (`return_lse=False` returns NaNs there). `max_doc` (the call's max_q/max_k, a bound on every document)
    bounds the kernel's grid as on one device; without it the grid spans the whole packed length. The planner
    checked layout, heads and window.
    """
    del rank
    split = HeadSplit(q.shape[1], k.shape[1], world)
    k_h, v_h = replicate_kv(thd_as_bhsd(k), thd_as_bhsd(v), split)

    def attend(q_b: torch.Tensor, k_b: torch.Tensor, v_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cp=1's varlen attention over the received (T, 1, h*D) buffers: (out (T, h, Dv), lse (h, T)), rank-major."""
        lay, total, cu = get_packed_layout(layout), q_b.shape[0], cu_seqlens
        where = None  # thd: rank-major is global order
        if lay.carries_plan:  # the global position of each rank-major token, and its inverse
            where = torch.cat([lay.shard_index(cu, total, world, p) for p in range(world)])
            order = torch.empty_like(where).scatter_(0, where, torch.arange(total, device=where.device))
            q_b, k_b, v_b = (permute_rows(t, order, where) for t in (q_b, k_b, v_b))
            cu = lay.offsets(cu, world)
        blocks = whole_sequence_blocks(cu, total, causal, tuple(window), max_doc)
        spec, ranges = encode_varlen(blocks), [b.ranges for b in blocks]
        out, lse = executor.attend_varlen(
            tokens_as_thd(q_b, split.q_per_rank),
            [tokens_as_thd(k_b, split.kv_per_rank)],
            [tokens_as_thd(v_b, split.kv_per_rank)],
            ranges,
            spec,
            scale,
            kernel,
            prepare_blocks(ranges, spec, total, [total], kernel),
        )
        if where is not None:  # back to rank-major order
            out, lse = permute_rows(out, where, order), permute_rows(lse, where, order, dim=1)
        return out, lse

    exchange = PackedHeads(split, group_name, q.shape[1], return_lse)
    out_local, lse_local = head_parallel(attend, (thd_as_bhsd(q), k_h, v_h), exchange)
    if lse_local is None:  # not read by the graph
        lse_local = q.new_full((q.shape[1], q.shape[0]), float("nan"), dtype=torch.float32)
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    return out_local, lse_local.to(torch.float32), rng_state

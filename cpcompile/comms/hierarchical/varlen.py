"""comm="hierarchical" for packed documents (varlen_attn under `thd`) on a 2-D CP mesh: the a2a exchange inside a
node, the packed ring (comms/ring/varlen.py) across the nodes, the exchange back.

thd gives CP rank g = inter rank * intra + intra rank the g-th contiguous T/cp tokens, so node p's ranks hold the
p-th contiguous T/inter tokens rank-major, which after the heads<->tokens exchange are in global order already:
to the ring across the nodes a node is rank p of thd over the nodes, and the packed ring steps (comms/ring/schedule.py,
device ops on the GLOBAL cu_seqlens, no recompile when documents change) run over the node's tokens for the
rank's heads. thd_zigzag's and thd_balanced's node buffers interleave pieces of documents per document, which the
packed ring has no steps for (the planner refuses them).
"""

from __future__ import annotations

import torch

from ...layouts.block import NO_WINDOW
from ...layouts.heads import HeadSplit
from ..a2a.heads import (
    heads_to_bshd,
    replicate_kv,
    send_heads,
    send_lse_back,
    send_tokens_back,
    thd_as_bhsd,
    tokens_as_thd,
)
from ..ring.schedule import packed_step_blocks
from ..ring.varlen import ring_varlen_attention
from .dense import Level


def hierarchical_varlen_attention(
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
    levels: tuple[Level, Level],
    window: tuple[int, int] = NO_WINDOW,
    return_lse: bool = True,
    max_doc: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """varlen_attn of this rank's packed tokens (thd): head-parallel inside the node, a ring across the nodes.

    Returns what torch_attn._varlen_attn returns: (out (L, Hq, Dv), lse (Hq, L) fp32, rng_state); the lse costs
    one more small all-to-all inside the node, sent only when the graph reads it (`return_lse`). The planner
    checked the layout (thd), the heads (over the node's ranks) and the window (causal or full)."""
    del group_name, rank, world  # the flattened CP group: the region talks over the two levels only
    (inter_name, node, nodes), (intra_name, _, per_node) = levels
    split = HeadSplit(q.shape[1], k.shape[1], per_node)
    k_h, v_h = replicate_kv(thd_as_bhsd(k), thd_as_bhsd(v), split)
    q_n, k_n, v_n = send_heads(thd_as_bhsd(q), k_h, v_h, split, intra_name)  # (per_node * L, 1, h * D), in order
    out, lse, rng_state = ring_varlen_attention(
        tokens_as_thd(q_n, split.q_per_rank), tokens_as_thd(k_n, split.kv_per_rank),
        tokens_as_thd(v_n, split.kv_per_rank), cu_seqlens, layout=layout, causal=causal, scale=scale,
        kernel=kernel, group_name=inter_name, rank=node, world=nodes, max_doc=max_doc, window=window,
    )  # fmt: skip
    heads = send_tokens_back(out.unsqueeze(1), per_node, intra_name)  # (per_node, L, 1, h * Dv)
    out_local = heads_to_bshd(heads, q.shape[1])[0]
    if return_lse:
        lse_local = send_lse_back(lse, per_node, intra_name)
    else:
        lse_local = q.new_full((q.shape[1], q.shape[0]), float("nan"), dtype=torch.float32)
    return out_local, lse_local.to(torch.float32), rng_state


def rank_blocks(
    layout: str,
    causal: bool,
    rank: int,
    world: int,
    local_len: int,
    cu_seqlens: torch.Tensor,
    max_doc: int | None = None,
    window: tuple[int, int] = NO_WINDOW,
    *,
    levels: tuple[int, int],
) -> list:
    """Every varlen block CP rank `rank` runs (for its share of the heads): its node's packed ring steps over the
    node's per_node * local_len tokens. `levels`: (nodes, ranks a node)."""
    assert tuple(window) == NO_WINDOW, "the planner refuses sliding windows under the ring"
    nodes, per_node = levels
    node, tokens = rank // per_node, per_node * local_len
    return [
        block
        for step in range(nodes)
        for block in packed_step_blocks(layout, cu_seqlens, tokens, nodes, node, step, causal, max_doc)
    ]

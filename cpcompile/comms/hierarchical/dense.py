"""The hierarchical CP region (comm="hierarchical") on a 2-D CP mesh (inter x intra): an all-to-all of heads inside
a node, a ring of K/V across the nodes, composed of the a2a exchange (comms/a2a/heads.py) and the ring region
(comms/ring/dense.ring_over).

CP rank g = inter_rank * intra + intra_rank holds the layout's chunks of rank g of a 1-D group of inter * intra
ranks (mesh.py), so shard_batch shards for it as for any group of that size. Forward:

1. inside the node: ONE all-to-all trades q/k/v heads for tokens (send_heads, GQA's kv heads replicated where the
   node has more ranks than kv heads): each rank then holds every token of its node for Hq/intra q heads;
2. across the nodes: the ring passes the K/V of those heads only (Hkv/intra of them) around the nodes' ranks of the
   same intra index, the blocks of each step running while the next chunk is in flight; the node's tokens, put in
   global order by one copy of the received buffer (none under flat, where it is in order already), are one rank of
   flat or zigzag over the nodes to the ring (comms/hierarchical/levels.py);
3. inside the node: the output goes back by the inverse all-to-all.

Backward is the composition's: the ring's backward (K/V and their fp32 gradients around the nodes), then the
exchange's (the same all-to-all reversed). Per rank and layer a node link carries the ring's K/V of Hkv/intra heads
of the node's tokens, the NVLink the a2a's q/k/v/out (`level_bytes`).
"""

from __future__ import annotations

import torch

from ...comm.wire import LevelBytes, WireShape
from ...layouts import Block, get_layout
from ...layouts.heads import HeadSplit
from ...mesh import CP_LEVEL_NAMES
from ..a2a import dense as a2a
from ..a2a.heads import heads_to_bshd, replicate_kv, send_heads, send_tokens_back, tokens_to_bhsd
from ..ring.dense import layout_wire_bytes, ring_over
from ..ring.schedule import ring_blocks
from .levels import level_layout, sorted_order

Level = tuple[str, int, int]
"""One level of the 2-D CP group as the region call holds it: (group name, this rank in it, its size)."""


def hierarchical_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: str,
    causal: bool,
    scale: float,
    kernel: str,
    group_name: str,
    rank: int,
    world: int,
    levels: tuple[Level, Level],
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal or full attention of this rank's tokens: head-parallel inside the node, a ring across the nodes.

    q (B, Hq, L, D), k/v (B, Hkv, L, D[v]) are CP rank `rank`'s tokens of `layout` over `world` ranks; `levels`
    ((inter group, node index, nodes), (intra group, index in the node, ranks a node)). The planner checked that
    rank == node index * ranks a node + index in the node and that the heads split over the node's ranks. A
    sliding `window` and `softcap` run as the ring runs them; `sinks` (Hq,): this rank's heads', folded after the
    ring's last step."""
    del group_name, rank, world  # the flattened CP group: the region talks over the two levels only
    (inter_name, node, nodes), (intra_name, index, per_node) = levels
    split = HeadSplit(q.shape[1], k.shape[1], per_node)
    if sinks is not None:
        sinks = sinks.narrow(0, index * split.q_per_rank, split.q_per_rank)
    k, v = replicate_kv(k, v, split)
    base = get_layout(layout)
    chunk = q.shape[-2] // base.chunks_per_rank
    order = sorted_order(base, node, nodes, per_node)
    # (per_node * L, B, h * D) views of the node's tokens, put in global order by one copy of the received buffer
    q_n, k_n, v_n = send_heads(q, k, v, split, intra_name, lambda t: _reorder(t, order, chunk))
    out = ring_over(
        tokens_to_bhsd(q_n, split.q_per_rank), tokens_to_bhsd(k_n, split.kv_per_rank),
        tokens_to_bhsd(v_n, split.kv_per_rank), level_layout(base, nodes, per_node), causal=causal, scale=scale,
        kernel=kernel, group_name=inter_name, rank=node, world=nodes, window=window, softcap=softcap, sinks=sinks,
    )  # fmt: skip
    inverse = sorted(range(len(order)), key=order.__getitem__)
    back = _reorder(out.permute(2, 0, 1, 3), inverse, chunk)  # the exchanged buffer's order again
    back = send_tokens_back(back, per_node, intra_name)  # (per_node, L, B, h * Dv)
    return heads_to_bshd(back, q.shape[1]).transpose(1, 2)


class _Reorder(torch.autograd.Function):
    """Chunks of `chunk` tokens (dim 0) taken in `order`: one copy each way (the gradient by the inverse order,
    not a zero-filled buffer per chunk as narrow + cat would make)."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, order: list[int], chunk: int) -> torch.Tensor:
        ctx.inverse, ctx.chunk = sorted(range(len(order)), key=order.__getitem__), chunk
        return _take(tokens, order, chunk)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _take(grad, ctx.inverse, ctx.chunk), None, None


def _take(tokens: torch.Tensor, order: list[int], chunk: int) -> torch.Tensor:
    return torch.cat([tokens.narrow(0, i * chunk, chunk) for i in order])


def _reorder(tokens: torch.Tensor, order: list[int], chunk: int) -> torch.Tensor:
    """Chunks of `chunk` tokens (dim 0) taken in `order` (buffer positions): one copy, or `tokens` as it is when
    the order is already the buffer's (flat)."""
    return tokens if order == sorted(order) else _Reorder.apply(tokens, order, chunk)


def rank_blocks(
    layout: str,
    causal: bool,
    rank: int,
    world: int,
    local_len: int,
    window: tuple[int, int] | None = None,
    *,
    levels: tuple[int, int],
) -> list[Block]:
    """Every block CP rank `rank` runs (for its share of the heads): its node's ring steps over the node's tokens.
    `levels`: (nodes, ranks a node)."""
    nodes, per_node = levels
    lay = level_layout(get_layout(layout), nodes, per_node)
    chunk = per_node * local_len // lay.chunks_per_rank
    return [b for step in ring_blocks(lay, nodes, rank // per_node, chunk, causal, window) for b in step]


def level_bytes(shape: WireShape) -> tuple[LevelBytes, LevelBytes]:
    """Bytes one rank sends per forward and per backward on each level (dense and packed sites alike): inside the
    node the a2a's (q/k/v heads of its tokens in, the output back, a packed site's lse when read; reversed in
    backward), across the nodes the ring's (the K/V of its
    Hkv/intra heads of the node's tokens, once per step but the last; backward the K/V again and their fp32
    gradient)."""
    s = shape
    nodes, per_node = s.levels
    split = HeadSplit(s.q_heads, s.kv_heads, per_node)
    base = dict(batch=s.batch, head_dim=s.head_dim, v_head_dim=s.v_head_dim, elt=s.elt, acc_elt=s.acc_elt)
    intra = a2a.wire_bytes(
        WireShape(s.tokens, q_heads=s.q_heads, kv_heads=s.kv_heads, world=per_node, lse=s.lse, **base)
    )  # the lse only for a packed site whose graph reads it
    lay = None
    if s.dense_mask is not None:
        lay = level_layout(get_layout(s.dense_mask[0]), nodes, per_node)
    inter_shape = WireShape(
        s.tokens * per_node, q_heads=split.q_per_rank, kv_heads=split.kv_per_rank, world=nodes,
        dense_mask=s.dense_mask, **base,
    )  # fmt: skip
    inter = layout_wire_bytes(inter_shape, lay)
    return (
        LevelBytes(CP_LEVEL_NAMES[1], "a2a", *intra),
        LevelBytes(CP_LEVEL_NAMES[0], "ring", *inter),
    )


def wire_bytes(shape: WireShape) -> tuple[int, int]:
    """Bytes one rank sends per forward and per backward, both levels together (`level_bytes` splits them)."""
    levels = level_bytes(shape)
    return sum(lv.fwd for lv in levels), sum(lv.bwd for lv in levels)

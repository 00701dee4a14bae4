"""The all-to-all (Ulysses) CP region: trade heads for sequence, attend over the whole sequence, trade back.

Before attention one all-to-all per exchange (see layouts.exchange.exchange_slots) sends rank j the q heads
it owns plus the k/v heads those read, for this rank's tokens; q, k and v travel in ONE collective, packed
side by side per token. Afterwards every rank holds every token of its heads, rank-major, which for flat
(and any non-causal attention) is one buffer the block executor reads in place; zigzag's causal attention
exchanges each local slot separately, so each buffer is a monotone run of chunks and no reorder copy exists.
The output goes back the same way and lands in (batch, seq, heads, dim) memory, the layout models reshape.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import executor  # noqa: F401  (registers torch.ops.cpcompile.*)
from ..comm import exchange_first, grad_reduce_dtype
from ..head_split import HeadSplit
from ..layouts import Block, get_layout
from ..layouts.exchange import buffer_chunks, exchange_blocks, exchange_slots


class _ReplicateHeads(torch.autograd.Function):
    """Repeat each head `replicas` times along dim 1 (GQA with kv_heads < cp: one copy per rank that reads it).

    The copies' gradients come back from different ranks; they are summed in grad_reduce_dtype (fp32 for
    bf16), rounding once, as the all-gather region's reduce-scatter does.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, replicas: int) -> torch.Tensor:
        ctx.replicas = replicas
        return x.repeat_interleave(replicas, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        summed = grad.unflatten(1, (-1, ctx.replicas)).sum(2, dtype=grad_reduce_dtype(grad.dtype))
        return summed.to(grad.dtype), None


def _heads_to_ranks(x: torch.Tensor, world: int) -> torch.Tensor:
    """(B, world*h, n, D) -> (world, n, B, h*D): block j holds rank j's heads, token-major."""
    b, heads, n, d = x.shape
    return x.unflatten(1, (world, heads // world)).permute(1, 3, 0, 2, 4).reshape(world, n, b, heads // world * d)


def _tokens_to_bhsd(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(S, B, heads*D) token-major -> a (B, heads, S, D) view (no copy)."""
    return x.unflatten(-1, (heads, -1)).permute(1, 2, 0, 3)


def replicate_kv(k: torch.Tensor, v: torch.Tensor, split: HeadSplit) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, Hkv, n, D) k/v with each head repeated for the ranks that read it (GQA with Hkv < cp)."""
    if split.kv_replicas == 1:
        return k, v
    return _ReplicateHeads.apply(k, split.kv_replicas), _ReplicateHeads.apply(v, split.kv_replicas)


def send_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: HeadSplit, group_name: str
) -> tuple[torch.Tensor, ...]:
    """ONE all-to-all of (B, H, n, D) q/k/v (k/v already replicated): each rank gets its heads of every
    rank's n tokens, returned as token-major (cp*n, B, h*D) views of the received buffer (rank-major)."""
    widths = [split.q_per_rank * q.shape[-1], split.kv_per_rank * k.shape[-1], split.kv_per_rank * v.shape[-1]]
    parts = [_heads_to_ranks(t, split.cp) for t in (q, k, v)]
    tokens = exchange_first(torch.cat(parts, dim=-1), group_name).flatten(0, 1)  # (cp*n, B, W)
    return tokens.split(widths, dim=-1)


def send_tokens_back(out: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    """All-to-all of a token-major (world*n, B, h, Dv) output: (world, n, B, h*Dv), block j = rank j's heads."""
    tokens, b, h, dv = out.shape
    return exchange_first(out.reshape(world, tokens // world, b, h * dv), group_name)


def heads_to_bshd(heads: torch.Tensor, q_heads: int) -> torch.Tensor:
    """(world, n, B, h*Dv) received outputs -> (B, n, q_heads, Dv) memory: the one copy of the output."""
    world, n, b, width = heads.shape
    return heads.permute(2, 1, 0, 3).reshape(b, n, q_heads, world * width // q_heads)


def _used_sources(blocks: list[Block]) -> tuple[list[int], list[int]]:
    """The buffers a q buffer's blocks read, and the blocks renumbered to index that shorter list."""
    used = sorted({b.source for b in blocks})
    renumbered = [dataclasses.replace(b, source=used.index(b.source)) for b in blocks]
    return used, [i for b in renumbered for i in b.as_ints()]


def a2a_attention(
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
) -> torch.Tensor:
    """Causal or full attention of this rank's tokens, computed head-parallel after an all-to-all.

    q (B, Hq, L, D), k/v (B, Hkv, L, D[v]) are this rank's tokens in the layout's local order; the result
    has q's shape, in the same token order. Every rank runs the same blocks (the whole sequence), so `rank`
    only names the caller; the planner checked the head counts (head_split.head_split_problem).
    """
    del rank
    lay = get_layout(layout)
    split = HeadSplit(q.shape[1], k.shape[1], world)
    k, v = replicate_kv(k, v, split)
    chunk = q.shape[-2] // lay.chunks_per_rank
    exchanges = exchange_slots(lay, causal)
    buffers = [buffer_chunks(lay, world, slots) for slots in exchanges]
    qs, ks, vs = [], [], []
    for slots in exchanges:
        start, length = slots[0] * chunk, len(slots) * chunk
        rows = (t if length == t.shape[-2] else t.narrow(-2, start, length) for t in (q, k, v))
        q_b, k_b, v_b = send_heads(*rows, split, group_name)
        qs.append(_tokens_to_bhsd(q_b, split.q_per_rank))
        ks.append(_tokens_to_bhsd(k_b, split.kv_per_rank))
        vs.append(_tokens_to_bhsd(v_b, split.kv_per_rank))
    back = []
    for q_b, blocks in zip(qs, exchange_blocks(buffers, chunk, causal)):
        used, ints = _used_sources(blocks)
        k_src, v_src = [ks[i] for i in used], [vs[i] for i in used]
        out, _lse = torch.ops.cpcompile.attend_blocks(q_b, k_src, v_src, ints, scale, kernel)
        back.append(send_tokens_back(out.permute(2, 0, 1, 3), world, group_name))
    heads = torch.cat(back, dim=1) if len(back) > 1 else back[0]  # (world, L, B, h*Dv): block j = heads of rank j
    return heads_to_bshd(heads, q.shape[1]).transpose(1, 2)

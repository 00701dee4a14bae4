"""The all-to-all (Ulysses) CP region: trade heads for sequence, attend over the whole sequence, trade back
(head_parallel.head_parallel over the block executor, through heads.DenseHeads).

Before attention one all-to-all per exchange (see schedule.exchange_slots) sends rank j the q heads
it owns plus the k/v heads those read, for this rank's tokens; q, k and v travel in ONE collective, packed
side by side per token. Afterwards every rank holds every token of its heads, rank-major, which for flat
(and any non-causal attention) is one buffer the block executor reads in place; zigzag's causal attention
exchanges each local slot separately, so each buffer is a monotone run of chunks; a descending one (zigzag's
second slot) is reversed after the exchange (one copy of its q/k/v, and of its output before the way back), so
its causal attention is two kernel calls, not two a chunk.
The output goes back the same way and lands in (batch, seq, heads, dim) memory, the layout models reshape.
"""

from __future__ import annotations

import dataclasses

import torch

from ... import executor
from ...comm.wire import WireShape
from ...executor.blocks import encode_dense
from ...layouts import Block, get_layout
from ...layouts.heads import HeadSplit
from ..all_gather.dense import executor_extra
from .head_parallel import head_parallel
from .heads import DenseHeads, replicate_kv
from .schedule import ascending, buffer_chunks, descending, exchange_blocks, exchange_slots


def _used_sources(blocks: list[Block]) -> tuple[list[int], list[int]]:
    """The buffers a q buffer's blocks read, and the blocks renumbered to index that shorter list."""
    used = sorted({b.source for b in blocks})
    renumbered = [dataclasses.replace(b, source=used.index(b.source)) for b in blocks]
    return used, encode_dense(renumbered)


def exchanged_buffers(layout: str, causal: bool, world: int, windowed: bool) -> list[list[int]]:
    """Global chunk ids of each exchanged buffer, in received (rank-major) order."""
    lay = get_layout(layout)
    return [buffer_chunks(lay, world, slots) for slots in exchange_slots(lay, causal, windowed)]


def buffer_blocks(
    layout: str, causal: bool, world: int, local_len: int, window: tuple[int, int] | None = None
) -> list[list[Block]]:
    """Per exchanged q buffer, its blocks over all exchanged buffers, each buffer in ascending chunk order
    (schedule.ascending; the same on every rank)."""
    buffers = ascending(exchanged_buffers(layout, causal, world, window is not None))
    return exchange_blocks(buffers, local_len // get_layout(layout).chunks_per_rank, causal, window)


def _reverse_chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """x (B, H, n*chunk, D) with its n chunks of `chunk` tokens in reverse order (one copy; its own inverse)."""
    return x.unflatten(-2, (-1, chunk)).flip(-3).flatten(-3, -2)


def rank_blocks(
    layout: str, causal: bool, rank: int, world: int, local_len: int, window: tuple[int, int] | None = None
) -> list[Block]:
    """Every block a rank runs after the exchange (any rank: they all run the same)."""
    del rank
    return [b for blocks in buffer_blocks(layout, causal, world, local_len, window) for b in blocks]


def wire_bytes(shape: WireShape) -> tuple[int, int]:
    """Bytes one rank sends per forward and per backward (dense and packed regions alike): forward, its tokens'
    q heads of every other rank and the k/v heads those read (replicated kv heads count once per rank that
    reads them) in one all-to-all, the output of its heads back in another, and the packed region's fp32 lse
    when the graph reads it; backward, the same exchanges reversed (dout out, dq/dk/dv back), in `elt` bytes."""
    s = shape
    split = HeadSplit(s.q_heads, s.kv_heads, s.world)
    width = split.q_per_rank * s.head_dim + split.kv_per_rank * (s.head_dim + s.v_head_dim)
    sent = (s.world - 1) * s.tokens * s.batch  # token slots sent to the others
    qkv = sent * width * s.elt
    out = sent * split.q_per_rank * s.v_head_dim * s.elt
    lse_bytes = sent * split.q_per_rank * 4 if s.lse else 0
    return qkv + out + lse_bytes, qkv + out


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
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal or full attention of this rank's tokens, computed head-parallel after an all-to-all.

    q (B, Hq, L, D), k/v (B, Hkv, L, D[v]) are this rank's tokens in the layout's local order; the result
    has q's shape, in the same token order. Every rank runs the same blocks (the whole sequence), so `rank`
    only names the caller and its heads; the planner checked the head counts (layouts.heads.head_split_problem).
    A sliding `window` is cp=1's (the exchanged buffers hold the whole sequence); `softcap` caps the scores;
    `sinks` (Hq,): the executor folds in this rank's heads' sinks (each q buffer holds all keys of its rows).
    """
    lay = get_layout(layout)
    split = HeadSplit(q.shape[1], k.shape[1], world)
    if sinks is not None:
        sinks = sinks.narrow(0, rank * split.q_per_rank, split.q_per_rank)
    k, v = replicate_kv(k, v, split)
    slots = exchange_slots(lay, causal, window is not None)
    exchange = DenseHeads(split, group_name, q.shape[1], slots, q.shape[-2] // lay.chunks_per_rank)

    chunk = q.shape[-2] // lay.chunks_per_rank
    flipped = [descending(c) for c in exchanged_buffers(layout, causal, world, window is not None)]

    def attend(*received: torch.Tensor):
        """Each q buffer's blocks over the exchanged buffers, one output at a time (each goes back as it comes);
        descending buffers reversed into ascending order first, and their outputs back."""
        order = lambda ts: [_reverse_chunks(t, chunk) if f else t for t, f in zip(ts, flipped)]  # noqa: E731
        qs, ks, vs = order(received[0::3]), order(received[1::3]), order(received[2::3])
        for q_b, blocks, flip in zip(qs, buffer_blocks(layout, causal, world, q.shape[-2], window), flipped):
            used, ints = _used_sources(blocks)
            k_src, v_src = [ks[i] for i in used], [vs[i] for i in used]
            extra = executor_extra(blocks, softcap) | ({} if sinks is None else {"sinks": sinks})
            out, _lse = executor.attend(q_b, k_src, v_src, ints, scale, kernel, **extra)
            yield _reverse_chunks(out, chunk) if flip else out

    return head_parallel(attend, (q, k, v), exchange)

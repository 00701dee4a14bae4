"""Index math of the heads<->sequence exchange (a2a): which chunks each exchanged buffer holds, and the blocks.

After an all-to-all every rank holds every rank's tokens for its own heads, rank-major: the buffer of an
exchange is `[rank_chunks(0)[slots], rank_chunks(1)[slots], ...]`. The blocks below are the same on every
rank (every rank attends over the whole sequence), expressed per q buffer with sources = buffer indices.
"""

from __future__ import annotations

from ...layouts.base import Block, ChunkLayout, runs
from ...layouts.window import exchange_window_blocks


def exchange_slots(layout: ChunkLayout, causal: bool, windowed: bool = False) -> tuple[tuple[int, ...], ...]:
    """Which local slots travel together in one all-to-all: one exchange per group.

    Non-causal attention does not care about key or query order, and flat's rank-major buffer is already in
    global order, so both use one exchange of all local tokens. A causal multi-chunk layout (zigzag) exchanges
    each slot separately: slot s's buffer is then `source_chunks(s)`, a monotone run of chunks (zigzag: 0..cp-1
    ascending, 2cp-1..cp descending), so its blocks stay few and no reorder copy is ever needed. A sliding
    window depends on order too, so windowed zigzag exchanges per slot even when not causal.
    """
    if not (causal or windowed) or layout.chunks_per_rank == 1:
        return (tuple(range(layout.chunks_per_rank)),)
    return tuple((slot,) for slot in range(layout.chunks_per_rank))


def buffer_chunks(layout: ChunkLayout, cp: int, slots: tuple[int, ...]) -> list[int]:
    """Global chunk ids, in buffer order, of the all-to-all of local `slots` (rank-major, then slot)."""
    return [layout.rank_chunks(p, cp)[s] for p in range(cp) for s in slots]


def _ascending_segments(chunks: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of positions whose chunk ids go up by one: [(first position, count), ...]."""
    segments: list[tuple[int, int]] = []
    for pos, c in enumerate(chunks):
        if segments and chunks[pos - 1] + 1 == c:
            segments[-1] = (segments[-1][0], segments[-1][1] + 1)
        else:
            segments.append((pos, 1))
    return segments


def _coalesce(blocks: list[Block]) -> list[Block]:
    """Merge unmasked blocks over the same key range whose q rows touch (one larger kernel call)."""
    out: list[Block] = []
    for b in sorted(blocks, key=lambda b: (b.causal, b.source, b.kv_start, b.kv_len, b.q_start)):
        last = out[-1] if out else None
        if (
            last is not None
            and not b.causal
            and not last.causal
            and (last.source, last.kv_start, last.kv_len) == (b.source, b.kv_start, b.kv_len)
            and last.q_start + last.q_len == b.q_start
        ):
            out[-1] = Block(last.q_start, last.q_len + b.q_len, b.source, b.kv_start, b.kv_len, False)
        else:
            out.append(b)
    return sorted(out, key=lambda b: (b.q_start, b.source, b.kv_start))


def exchange_blocks(
    buffers: list[list[int]], chunk_len: int, causal: bool, window: tuple[int, int] | None = None
) -> list[list[Block]]:
    """For each q buffer, its attention blocks over all buffers (source i = buffer i), each pair once.

    Causal: every ascending segment of a buffer is one causal square against itself (flat: the whole
    sequence in one call); then each q chunk takes unmasked blocks over the runs of earlier chunks elsewhere,
    and q chunks that need the same key range share one block.
    Non-causal: every q buffer against each whole buffer.
    A sliding window: layouts/window.py (flat: one windowed block over the whole sequence, as on one GPU).
    """
    if window is not None:
        return exchange_window_blocks(buffers, chunk_len, causal, window)
    if not causal:
        return [
            [Block(0, len(q) * chunk_len, src, 0, len(kv) * chunk_len, False) for src, kv in enumerate(buffers)]
            for q in buffers
        ]
    per_buffer: list[list[Block]] = []
    for b, chunks in enumerate(buffers):
        segments = _ascending_segments(chunks)
        segment_of = {pos: seg for seg in segments for pos in range(seg[0], seg[0] + seg[1])}
        blocks = [Block(p * chunk_len, n * chunk_len, b, p * chunk_len, n * chunk_len, True) for p, n in segments]
        for pos, c in enumerate(chunks):
            first, count = segment_of[pos]
            for src, kv in enumerate(buffers):
                earlier = (j for j, g in enumerate(kv) if g < c and not (src == b and first <= j < first + count))
                for j, n in runs(earlier):
                    blocks.append(Block(pos * chunk_len, chunk_len, src, j * chunk_len, n * chunk_len, False))
        per_buffer.append(_coalesce(blocks))
    return per_buffer

"""Sliding windows on the chunk layouts: which (q, key) blocks a windowed attention needs, and their masks.

A window (left, right) over GLOBAL positions makes key k visible to query q iff -left <= k - q <= right (-1:
unbounded; causal forces right = 0). The rank's tokens come as pieces: runs contiguous both in their buffer and in
global order (a local chunk; a run of gathered chunks in ascending order). For every q piece against every key
piece the visible part is a diagonal band clipped to the rectangle:
- entirely outside the window: no block (skipped: this is what a window saves);
- entirely inside: an unmasked block (adjacent ones of one buffer merged into one call);
- partial: the band's bounding box (rows that see a key, keys some row sees), as a causal square when that is
  what the band is, else a block with a flash-attn window on the box's bottom-right diagonal. Inside the box the
  band always contains that diagonal (its first row sees its first key, its last row its last key), so both
  window sides are >= 0: every windowed kernel takes it (FA2's window_size_left/right, a mask on CPU).
  FA2 reads a side of -1, or one >= Sk, as Sk: for the right side that means "unbounded" only while
  Sq <= Sk + 1, so a taller box whose right side is unbounded (or >= Sk) is cut into row halves until each
  part holds (`fa2_exact`; seen on the H200: zigzag boxes of 300 x 192 rows x keys lost their upper keys).
Every row must see its own key, so the planner accepts only windows that contain the diagonal (left, right >= 0
or unbounded): each row is then covered by at least one block. tests/unit/test_window_blocks.py checks that the
blocks cover exactly the windowed mask, each pair once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .block import LOCAL_SOURCE, Block


class Chunks(Protocol):
    """What the window math reads of a chunk layout (layouts/base.py's ChunkLayout, which calls into here)."""

    chunks_per_rank: int

    def rank_chunks(self, rank: int, cp: int) -> tuple[int, ...]: ...

    def source_chunks(self, slot: int, cp: int) -> list[int]: ...


@dataclass(frozen=True)
class Piece:
    """Tokens [start, start + length) of buffer `source` (q pieces: 0), global positions glob .. glob + length."""

    source: int
    start: int
    length: int
    glob: int


def band(causal: bool, window: tuple[int, int]) -> tuple[int | None, int | None]:
    """(lo, hi): key k is visible to query q iff lo <= k - q <= hi (None: unbounded)."""
    left, right = window
    hi = 0 if causal else (right if right >= 0 else None)
    return (-left if left >= 0 else None), hi


def merge_pieces(pieces: list[Piece]) -> list[Piece]:
    """Join pieces that continue each other in their buffer and in global order."""
    out: list[Piece] = []
    for p in sorted(pieces, key=lambda p: (p.source, p.start)):
        last = out[-1] if out else None
        if (
            last
            and last.source == p.source
            and last.start + last.length == p.start
            and last.glob + last.length == p.glob
        ):
            out[-1] = Piece(p.source, last.start, last.length + p.length, last.glob)
        else:
            out.append(p)
    return out


def pair_block(q: Piece, k: Piece, lo: int | None, hi: int | None) -> Block | None:
    """The block of q piece against key piece k under the band (None: no visible pair)."""
    d = k.glob - q.glob  # k - q = d + j - i for row i of q, key j of k
    lq, lk = q.length, k.length
    if (hi is not None and d - (lq - 1) > hi) or (lo is not None and d + (lk - 1) < lo):
        return None
    if (lo is None or d - (lq - 1) >= lo) and (hi is None or d + (lk - 1) <= hi):
        return Block(q.start, lq, k.source, k.start, lk, False)
    r0 = max(0, d - hi) if hi is not None else 0  # rows that see a key ...
    r1 = min(lq - 1, lk - 1 + d - lo) if lo is not None else lq - 1
    c0 = max(0, r0 - d + lo) if lo is not None else 0  # ... and keys some row sees
    c1 = min(lk - 1, r1 - d + hi) if hi is not None else lk - 1
    sq, sk = r1 - r0 + 1, c1 - c0 + 1
    lo_box = None if lo is None else lo - d - c0 + r0  # the band in box coordinates: lo_box <= j - i <= hi_box
    hi_box = None if hi is None else hi - d - c0 + r0
    lower = lo_box is not None and lo_box > -(sq - 1)
    upper = hi_box is not None and hi_box < sk - 1
    if not lower and not upper:
        return Block(q.start + r0, sq, k.source, k.start + c0, sk, False)
    if not lower and sq == sk and hi_box == 0:
        return Block(q.start + r0, sq, k.source, k.start + c0, sk, True)
    shift = sk - sq  # flash-attn's windows sit on the bottom-right diagonal j - i = shift
    left = shift - lo_box if lower else -1
    right = hi_box - shift if upper else -1
    assert left >= -1 and right >= -1, (q, k, lo, hi)
    return Block(q.start + r0, sq, k.source, k.start + c0, sk, False, (left, right))


def fa2_exact(b: Block) -> bool:
    """Whether FlashAttention-2 reads b's window as written (kernels/flash.py; the CPU mask reads it exactly)."""
    if b.window is None:
        return True
    right = b.window[1]
    return b.q_len <= b.kv_len + 1 or 0 <= right < b.kv_len


def pair_blocks(q: Piece, k: Piece, lo: int | None, hi: int | None) -> list[Block]:
    """pair_block, with q cut into row halves until every windowed block is one FA2 reads exactly."""
    b = pair_block(q, k, lo, hi)
    if b is None:
        return []
    if fa2_exact(b):
        return [b]
    half = q.length // 2
    top = Piece(q.source, q.start, half, q.glob)
    bottom = Piece(q.source, q.start + half, q.length - half, q.glob + half)
    return pair_blocks(top, k, lo, hi) + pair_blocks(bottom, k, lo, hi)


def _merge_unmasked(blocks: list[Block]) -> list[Block]:
    """Unmasked blocks of the same q rows over adjacent keys of one buffer become one (order is irrelevant)."""
    out: list[Block] = []
    for b in sorted(blocks, key=lambda b: (b.source, b.kv_start)):
        last = out[-1] if out else None
        if last and last.source == b.source and last.kv_start + last.kv_len == b.kv_start:
            out[-1] = Block(b.q_start, b.q_len, b.source, last.kv_start, last.kv_len + b.kv_len, False)
        else:
            out.append(b)
    return out


def band_blocks(q_pieces: list[Piece], kv_pieces: list[Piece], lo: int | None, hi: int | None) -> list[Block]:
    """Every q piece against every key piece: the windowed blocks, each visible pair exactly once."""
    out: list[Block] = []
    for q in q_pieces:
        whole = []
        for b in (b for k in kv_pieces for b in pair_blocks(q, k, lo, hi)):
            unmasked_rows = not b.causal and b.window is None and (b.q_start, b.q_len) == (q.start, q.length)
            (whole if unmasked_rows else out).append(b)
        out += _merge_unmasked(whole)
    return sorted(out, key=lambda b: (b.q_start, b.source, b.kv_start))


def all_gather_window_blocks(
    layout: Chunks, cp: int, rank: int, chunk_len: int, causal: bool, window: tuple[int, int]
) -> list[Block]:
    """A rank's windowed blocks over its local K/V (its own chunks, source 0: they need no gather) and the
    gathered slots (every other rank's chunks)."""
    mine = layout.rank_chunks(rank, cp)
    q_pieces = merge_pieces([Piece(0, i * chunk_len, chunk_len, c * chunk_len) for i, c in enumerate(mine)])
    kv = [Piece(LOCAL_SOURCE, p.start, p.length, p.glob) for p in q_pieces]
    for slot in range(layout.chunks_per_rank):
        for pos, g in enumerate(layout.source_chunks(slot, cp)):
            if pos != rank:
                kv.append(Piece(1 + slot, pos * chunk_len, chunk_len, g * chunk_len))
    return band_blocks(q_pieces, merge_pieces(kv), *band(causal, window))


def exchange_window_blocks(
    buffers: list[list[int]], chunk_len: int, causal: bool, window: tuple[int, int]
) -> list[list[Block]]:
    """a2a: for each exchanged q buffer (its global chunk ids in buffer order), its windowed blocks over all
    buffers (source i = buffer i); the same on every rank."""
    pieces = [
        merge_pieces([Piece(b, p * chunk_len, chunk_len, g * chunk_len) for p, g in enumerate(chunks)])
        for b, chunks in enumerate(buffers)
    ]
    kv = [p for ps in pieces for p in ps]
    lo, hi = band(causal, window)
    return [band_blocks([Piece(0, p.start, p.length, p.glob) for p in ps], kv, lo, hi) for ps in pieces]


def ring_window_blocks(
    layout: Chunks, cp: int, rank: int, held: int, chunk_len: int, causal: bool, window: tuple[int, int]
) -> list[Block]:
    """The ring: rank `rank`'s windowed blocks over the K/V of rank `held` (one buffer, source 0, in that rank's
    local order); [] when the window keeps every held key from every local row."""
    mine, theirs = layout.rank_chunks(rank, cp), layout.rank_chunks(held, cp)
    q_pieces = merge_pieces([Piece(0, i * chunk_len, chunk_len, c * chunk_len) for i, c in enumerate(mine)])
    kv = merge_pieces([Piece(0, j * chunk_len, chunk_len, c * chunk_len) for j, c in enumerate(theirs)])
    return band_blocks(q_pieces, kv, *band(causal, window))

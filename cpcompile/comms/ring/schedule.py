"""Ring steps: which K/V chunk a rank holds at each step of the ring, and which of its q rows attend it.

At step s rank r holds the K/V of rank (r - s) mod cp (every rank sends what it holds to r + 1 and receives
from r - 1), so after cp steps every rank has seen every rank's K/V once. The held buffer is that rank's local
K/V in its local order, so a step's blocks are rectangles of (local q rows, held keys): derived here from the
layouts' own chunk assignment (`rank_chunks`) or packed documents (cu_seqlens), never from a table.

Dense (flat, zigzag): blocks read source 0, the held buffer. Causal: a held chunk strictly before a local
chunk is an unmasked block, the rank's own chunk a causal square (step 0 only), a later chunk nothing.
Zigzag steps are balanced: step 0 is two causal squares plus one full chunk-square, which together are the
causal mask over the rank's two chunks in local order, so they run as one causal call (`causal_square`); every
later step two full chunk-squares (the held rank's front chunk for both local chunks, or the back local chunk
for both held chunks), the same on every rank. A sliding window: the band's blocks of the local chunks against
the held ones (layouts/window.py); `visited_steps` keeps only the steps some rank has blocks at, which the ring
visits.

Packed (thd, thd_zigzag): varlen blocks over the held buffer, as device ops on cu_seqlens. thd: step 0 is each
local document piece against itself (bottom-right causal); later steps the piece against the held rank's
piece of the same document, unmasked (all of it precedes this rank's tokens), and nothing for a later rank
under causal attention. thd_zigzag: every rank's local offsets of a document are the same, so a held front
chunk (rank p < r) is seen by both local chunks, a held rank p > r is seen (both chunks) by the back chunk:
per document the same work every step on every rank. A causal sliding window: the squares keep it, every held
piece before a local piece becomes packed_band.py's two blocks (one window for every document). thd's ring
visits only the steps a document can reach (`packed_visited_steps`): those within the window, or within the
longest document (varlen_attn's max_q/max_k). thd_zigzag's step 0 is one causal square per document: its two
local chunks in local order, whose causal mask is both chunks' squares plus the back chunk against the front.
"""

from __future__ import annotations

import dataclasses

import torch

from ...layouts.base import Block, ChunkLayout
from ...layouts.block import NO_WINDOW
from ...layouts.packed_band import earlier_keys_band
from ...layouts.thd import VarlenBlock, doc_bound, get_packed_layout, interleave, qk_ranges, token_reach
from ...layouts.window import ring_window_blocks

HELD = 0
"""The held buffer is source 0 of every step's executor call."""


def held_rank(rank: int, step: int, cp: int) -> int:
    """The rank whose local K/V `rank` holds at ring step `step`."""
    return (rank - step) % cp


def step_blocks(
    layout: ChunkLayout,
    cp: int,
    rank: int,
    step: int,
    chunk_len: int,
    causal: bool,
    window: tuple[int, int] | None = None,
) -> list[Block]:
    """Rank `rank`'s dense blocks at ring step `step` over the held buffer (source 0), coalesced into as few
    rectangles as the chunk order allows; under a sliding `window` only the band's blocks (layouts/window.py)."""
    if window is not None:
        return ring_window_blocks(layout, cp, rank, held_rank(rank, step, cp), chunk_len, causal, window)
    mine = layout.rank_chunks(rank, cp)
    theirs = layout.rank_chunks(held_rank(rank, step, cp), cp)
    blocks = []
    for i, c in enumerate(mine):
        for j, held in enumerate(theirs):
            if not causal or held < c:
                blocks.append(Block(i * chunk_len, chunk_len, HELD, j * chunk_len, chunk_len, False))
            elif held == c:  # the rank's own chunk: only at step 0
                blocks.append(Block(i * chunk_len, chunk_len, HELD, j * chunk_len, chunk_len, True))
    return causal_square(_coalesce(blocks))


def ring_blocks(
    layout: ChunkLayout, cp: int, rank: int, chunk_len: int, causal: bool, window: tuple[int, int] | None = None
) -> list[list[Block]]:
    """Every step's blocks (a step may have none: a causal rank whose held chunks all come later, or a held
    chunk wholly outside every local row's window)."""
    return [step_blocks(layout, cp, rank, s, chunk_len, causal, window) for s in range(cp)]


def visited_steps(
    layout: ChunkLayout, cp: int, chunk_len: int, causal: bool, window: tuple[int, int] | None = None
) -> tuple[int, ...]:
    """The ring steps some rank has blocks at (step 0 always): the ring visits only these, shifting the K/V by
    the gap between two (comm/pending.start_shift's offset). Without a window every step; with a window shorter
    than a chunk, the neighbours' steps only (flat: 1 causal, 1 and cp - 1 both sides), so a rank sends and
    attends at most its neighbours' K/V instead of every rank's. The same on every rank (all ranks' blocks)."""
    if window is None:
        return tuple(range(cp))
    used = {0}
    for rank in range(cp):
        used.update(s for s, blocks in enumerate(ring_blocks(layout, cp, rank, chunk_len, causal, window)) if blocks)
    return tuple(sorted(used))


def step_gap(visited: tuple[int, ...], i: int, world: int) -> int:
    """How far the held chunk moves after visited step i: to the next visited step, or after the last one the
    way home to its owner (world - step: 1 when every step is visited)."""
    return visited[i + 1] - visited[i] if i + 1 < len(visited) else world - visited[i]


def causal_square(blocks: list[Block]) -> list[Block]:
    """The blocks as ONE causal square when together they are exactly its mask, else as they are.

    Zigzag's step 0 holds the rank's own chunks (c, c') with c < c': two causal squares and the full square of
    c' against c. In local order that is the causal mask over the rank's 2 chunks (c's rows never see c', every
    row of c' sees all of c), so one kernel call does the work of two (the batched squares a, the rectangle b),
    with no partial outputs to merge and no partial gradients to sum:

        q / keys   c     c'              q / keys   c     c'
        c          a.                    c          x.
        c'         bb    a.              c'         xx    x.
                   (2 calls)                        (1 call)

    The test: every block lies in the square's lower triangle (a causal block on its diagonal, a full block
    wholly left of the diagonal), no two overlap, and their areas sum to the triangle's."""
    if len(blocks) < 2 or any(b.window is not None for b in blocks) or len({b.source for b in blocks}) > 1:
        return blocks
    q0 = min(b.q_start for b in blocks)
    k0 = min(b.kv_start for b in blocks)
    n = max(b.q_start + b.q_len for b in blocks) - q0
    if max(b.kv_start + b.kv_len for b in blocks) - k0 != n:
        return blocks
    area = 0
    for b in blocks:
        row, key = b.q_start - q0, b.kv_start - k0
        if b.causal:
            if row != key or b.q_len != b.kv_len:
                return blocks
            area += b.q_len * (b.q_len + 1) // 2
        else:
            if key + b.kv_len - 1 > row:  # some key right of the diagonal for the block's first row
                return blocks
            area += b.q_len * b.kv_len
    overlap = any(
        a.q_start < b.q_start + b.q_len and b.q_start < a.q_start + a.q_len
        and a.kv_start < b.kv_start + b.kv_len and b.kv_start < a.kv_start + a.kv_len
        for i, a in enumerate(blocks) for b in blocks[i + 1 :]
    )  # fmt: skip
    if overlap or area != n * (n + 1) // 2:
        return blocks
    return [Block(q0, n, blocks[0].source, k0, n, True)]


def _coalesce(blocks: list[Block]) -> list[Block]:
    """Merge unmasked blocks that share a q range and touch along the keys, or share a key range and touch
    along q: one kernel call instead of two, the same (q, k) pairs."""
    out = list(blocks)
    merged = True
    while merged:
        merged = False
        for a in out:
            for b in out:
                if a is b or a.causal or b.causal:
                    continue
                same_q = (a.q_start, a.q_len) == (b.q_start, b.q_len) and a.kv_start + a.kv_len == b.kv_start
                same_k = (a.kv_start, a.kv_len) == (b.kv_start, b.kv_len) and a.q_start + a.q_len == b.q_start
                if same_q:
                    joined = dataclasses.replace(a, kv_len=a.kv_len + b.kv_len)
                elif same_k:
                    joined = dataclasses.replace(a, q_len=a.q_len + b.q_len)
                else:
                    continue
                out = [x for x in out if x is not a and x is not b] + [joined]
                merged = True
                break
            if merged:
                break
    return sorted(out, key=lambda b: (b.q_start, b.kv_start))


def packed_window(window: tuple[int, int], causal: bool, max_doc: int | None, total: int) -> tuple[int, int]:
    """The window the packed ring's steps apply: NO_WINDOW when it keeps no pair of one document apart (w at
    least the longest document, `max_doc`, or the packed `total`, minus one), else (w, -1) under causal
    attention (the planner takes no other: Capabilities.packed_window_problem)."""
    left = window[0]
    if left < 0 or left >= (total if max_doc is None else min(max_doc, total)) - 1:
        return NO_WINDOW
    assert causal, "the packed ring takes causal sliding windows only (the planner refuses two-sided ones)"
    return (left, -1)


def packed_visited_steps(
    strategy: str,
    local_len: int,
    cp: int,
    window: tuple[int, int] = NO_WINDOW,
    causal: bool = True,
    max_doc: int | None = None,
) -> tuple[int, ...]:
    """The ring steps some rank has packed blocks at (step 0 always). thd's pieces are contiguous: the piece
    held s steps back is at least (s - 1) * local_len + 1 tokens from every local row, so a step is out of reach
    when no same-document pair can be that far apart (`thd_reach`: under `packed_window`'s causal window, or
    documents of at most `max_doc` tokens, varlen_attn's static max_q/max_k, which the token guard enforces).
    Causal: steps 0 .. reach; both ways: also the steps whose held piece is at most reach pieces AFTER a rank's
    (s >= cp - reach). thd_zigzag's chunks are a share of each document, as short as it, so no step is provably
    out of reach: every step."""
    reach = thd_reach(local_len, window, max_doc) if strategy == "thd" else None
    if reach is None or reach >= cp - 1:
        return tuple(range(cp))
    return tuple(s for s in range(cp) if s <= reach or (not causal and cp - s <= reach))


def thd_reach(local_len: int, window: tuple[int, int], max_doc: int | None) -> int | None:
    """How many pieces apart (under thd) a row and a key of one document can be, at most: None when nothing
    bounds it. A pair d tokens apart spans pieces at most 1 + (d - 1) // local_len apart (0 when d = 0); d is
    at most `token_reach` (a sliding window's left w, the longest document's max_doc - 1)."""
    d = token_reach(max_doc, window[0])
    if d is None:
        return None
    return 0 if d == 0 else 1 + (d - 1) // local_len


def packed_step_blocks(
    strategy: str,
    cu_seqlens: torch.Tensor,
    local_len: int,
    cp: int,
    rank: int,
    step: int,
    causal: bool,
    max_doc: int | None = None,
    window: tuple[int, int] = NO_WINDOW,
) -> list[VarlenBlock]:
    """Rank `rank`'s varlen blocks at ring step `step` over the held buffer (source 0); [] when it has none.
    `window`: `packed_window`'s (a causal (w, -1), or NO_WINDOW)."""
    if strategy == "thd":
        return _thd_step(cu_seqlens, local_len, cp, rank, step, causal, max_doc, window)
    if strategy == "thd_zigzag":
        return _thd_zigzag_step(cu_seqlens, local_len, cp, rank, step, causal, max_doc, window)
    raise ValueError(f"no ring steps for packed layout {strategy!r}")


def _thd_step(cu_seqlens, local_len, cp, rank, step, causal, max_doc, window):
    held = held_rank(rank, step, cp)
    reach = thd_reach(local_len, window, max_doc)
    if (causal and held > rank) or (reach is not None and abs(held - rank) > reach):
        return []
    cu = cu_seqlens.long()
    piece = lambda r: ((cu[:-1] - r * local_len).clamp(0, local_len), (cu[1:] - r * local_len).clamp(0, local_len))  # noqa: E731
    q0, q1 = piece(rank)
    bound = doc_bound(local_len, max_doc)
    if step == 0:  # every local piece against itself: a causal square per document piece (windowed), or unmasked
        return [VarlenBlock(HELD, causal, qk_ranges(q0, q1, q0, q1), bound, bound, window, True, True, True)]
    k0, k1 = piece(held)  # the held rank's piece of each document: all before this rank's tokens when causal
    if window[0] < 0:
        return [VarlenBlock(HELD, False, qk_ranges(q0, q1, k0, k1), bound, bound)]
    if window[0] <= (step - 1) * local_len:  # the held keys are at least (step - 1) * L + 1 before the rows
        return []
    return earlier_keys_band(q0, q1, rank * local_len, k0, k1, held * local_len, window[0], local_len)


def _thd_zigzag_step(cu_seqlens, local_len, cp, rank, step, causal, max_doc, window):
    layout = get_packed_layout("thd_zigzag")
    start, mid, end, chunk = layout.local_docs(cu_seqlens, cp)
    one = doc_bound(local_len // 2, None if max_doc is None else max_doc // (2 * cp))  # one chunk, at most
    full = dict(covers_rows=True, covers_keys=True)
    if not causal:  # both local chunks against both held chunks of every document
        return [VarlenBlock(HELD, False, qk_ranges(start, end, start, end), 2 * one, 2 * one, NO_WINDOW, **full)]
    held = held_rank(rank, step, cp)
    if window[0] >= 0:
        bounds = (one, local_len)
        return _thd_zigzag_band(start, mid, end, chunk, cu_seqlens.long()[:-1], cp, rank, held, window, bounds)
    if step == 0:  # per document the causal mask over its two local chunks (front, back) in local order: the
        # two chunks' causal squares and the back chunk against the whole front one, as ONE causal square call
        square = qk_ranges(start, end, start, end)
        return [VarlenBlock(HELD, True, square, 2 * one, 2 * one, NO_WINDOW, **full, square=True)]
    if held < rank:  # the held front chunk precedes both local chunks; its back chunk follows both
        return [VarlenBlock(HELD, False, qk_ranges(start, end, start, mid), 2 * one, one, NO_WINDOW, covers_rows=True)]
    # held > rank: both held chunks precede the local back chunk and follow the local front chunk
    return [VarlenBlock(HELD, False, qk_ranges(mid, end, start, end), one, 2 * one, NO_WINDOW, covers_keys=True)]


def _thd_zigzag_band(start, mid, end, chunk, doc_start, cp, rank, held, window, bounds):
    """thd_zigzag's causal step blocks under a sliding window: the squares keep the window (a square's two
    anchors agree), every chunk pair whose keys precede its rows is `earlier_keys_band`'s two blocks (the local
    and held pieces are chunks r, 2cp-1-r and p, 2cp-1-p of each document: global = local + offset). `bounds`:
    (one chunk, the local length: any stretch of the buffers, which the band blocks' fillers may span)."""
    w, (one, local_len) = window[0], bounds
    front = lambda x: doc_start + x * chunk - start  # noqa: E731  (global - local, rank x's front chunk)
    back = lambda x: doc_start + (2 * cp - 1 - x) * chunk - mid  # noqa: E731
    band = lambda rows, keys: earlier_keys_band(*rows, *keys, w, local_len)  # noqa: E731
    rows_front, rows_back = (start, mid, front(rank)), (mid, end, back(rank))
    if held == rank:  # two causal squares (front, back), then the back chunk against the front chunk
        squares = qk_ranges(interleave(start, mid), interleave(mid, end), interleave(start, mid), interleave(mid, end))
        square = VarlenBlock(HELD, True, squares, one, one, window, covers_rows=True, covers_keys=True, square=True)
        return [square, *band(rows_back, (start, mid, front(rank)))]
    if held < rank:  # the held front chunk precedes both local chunks; its back chunk follows both
        keys = (start, mid, front(held))
        return [*band(rows_front, keys), *band(rows_back, keys)]
    # held > rank: both held chunks precede the local back chunk and follow the local front chunk
    return [*band(rows_back, (start, mid, front(held))), *band(rows_back, (mid, end, back(held)))]

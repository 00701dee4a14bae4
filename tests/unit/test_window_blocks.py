"""Sliding windows on the chunk layouts: a rank's windowed blocks (all_gather, a2a, the ring's steps) cover exactly
the windowed mask, each pair once, skip what lies outside the window (the ring: whole steps), and carry windows every windowed kernel takes (both sides >= 0 or unbounded)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from cpcompile.comms.a2a.schedule import buffer_chunks, exchange_blocks, exchange_slots
from cpcompile.comms.ring.schedule import held_rank, ring_blocks, visited_steps
from cpcompile.layouts import LAYOUTS, LOCAL_SOURCE
from cpcompile.layouts.window import band

WINDOWS = [(0, 0), (1, 0), (2, 0), (3, 1), (-1, 2), (4, -1), (5, 5), (0, -1), (-1, 0)]


def _fa2_reading(window: tuple[int, int], kv_len: int) -> tuple[int, int]:
    """FlashAttention-2 reads a window side of -1, or one >= Sk, as Sk (its flash_api); the mask kernels read
    -1 as unbounded and the rest as written. Blocks must mean the same to both (layouts/window.fa2_exact)."""
    return tuple(kv_len if side < 0 or side >= kv_len else side for side in window)


def _block_pairs(b, rows, keys, fa2: bool = False) -> list[tuple[int, int]]:
    """(global q, global key) pairs a block attends, by its own mask semantics (layouts.base.Block), or as
    FlashAttention-2 reads its window."""
    out = []
    window = None if b.window is None else (_fa2_reading(b.window, b.kv_len) if fa2 else b.window)
    for i, j in itertools.product(range(b.q_len), range(b.kv_len)):
        if b.causal and j > i:
            continue
        if window is not None:
            left, right = window
            rel = j - i - (b.kv_len - b.q_len)
            if (left >= 0 and rel < -left) or (right >= 0 and rel > right):
                continue
        out.append((rows[b.q_start + i], keys[b.source][b.kv_start + j]))
    return out


def _pairs(b, rows, keys) -> list[tuple[int, int]]:
    """The block's pairs, after checking FA2 attends the same ones (seen on the H200 when it did not)."""
    pairs = _block_pairs(b, rows, keys)
    assert b.window is None or pairs == _block_pairs(b, rows, keys, fa2=True), f"FA2 reads {b} otherwise"
    return pairs


def _wanted(seq: int, causal: bool, window) -> Counter:
    lo, hi = band(causal, window)
    return Counter(
        {
            (q, k): 1
            for q in range(seq)
            for k in range(seq)
            if (lo is None or k - q >= lo) and (hi is None or k - q <= hi)
        }
    )


def _check_window(b):
    if b.window is not None:
        assert not b.causal and all(x >= -1 for x in b.window) and b.window != (-1, -1), b


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_all_gather_window_blocks_cover_the_mask_exactly_once(name, cp, chunk, causal):
    layout = LAYOUTS[name]
    seq = layout.num_chunks(cp) * chunk
    for window in WINDOWS:
        if causal and window[1] != 0:
            continue
        seen: Counter = Counter()
        for rank in range(cp):
            rows = layout.shard_index(seq, cp, rank).tolist()
            keys = {LOCAL_SOURCE: rows}
            for slot in range(layout.chunks_per_rank):
                keys[1 + slot] = [c * chunk + t for c in layout.source_chunks(slot, cp) for t in range(chunk)]
            for b in layout.blocks(cp, rank, chunk, causal, window):
                _check_window(b)
                assert b.source == LOCAL_SOURCE or all(
                    c not in layout.rank_chunks(rank, cp)
                    for c in {keys[b.source][j] // chunk for j in range(b.kv_start, b.kv_start + b.kv_len)}
                ), f"rank {rank} reads its own chunk from a gathered source: {b}"
                seen.update(_pairs(b, rows, keys))
        assert seen == _wanted(seq, causal, window), (name, cp, chunk, causal, window)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_exchange_window_blocks_cover_the_mask_exactly_once(name, cp, causal):
    lay, chunk = LAYOUTS[name], 2
    buffers = [buffer_chunks(lay, cp, slots) for slots in exchange_slots(lay, causal, windowed=True)]
    keys = {b: [c * chunk + t for c in chunks for t in range(chunk)] for b, chunks in enumerate(buffers)}
    seq = lay.num_chunks(cp) * chunk
    for window in WINDOWS:
        if causal and window[1] != 0:
            continue
        seen: Counter = Counter()
        for q_buf, blocks in enumerate(exchange_blocks(buffers, chunk, causal, window)):
            for b in blocks:
                _check_window(b)
                seen.update(_pairs(b, keys[q_buf], keys))
        assert seen == _wanted(seq, causal, window), (name, cp, causal, window)


def test_blocks_outside_the_window_are_skipped():
    """Zigzag cp=4, chunks of 8, a causal window of 4 tokens (the token and 3 before): each chunk needs its own
    causal square and the last 3 keys of the chunk before it, nothing else."""
    blocks = LAYOUTS["zigzag"].blocks(4, 1, 8, True, (3, 0))  # rank 1 owns chunks 1 and 6
    assert [(b.q_start, b.q_len, b.source, b.kv_start, b.kv_len, b.causal, b.window) for b in blocks] == [
        (0, 8, 0, 0, 8, False, (3, 0)),  # chunk 1 against itself: the band, on the local K/V
        (0, 3, 1, 5, 3, False, (0, -1)),  # its first 3 rows see the last 3 keys of chunk 0 (gathered slot 0)
        (8, 8, 0, 8, 8, False, (3, 0)),
        (8, 3, 2, 21, 3, False, (0, -1)),  # chunk 6 sees the end of chunk 5 (slot 1, position 2)
    ]


def test_flat_a2a_window_is_one_block():
    buffers = [buffer_chunks(LAYOUTS["flat"], 4, s) for s in exchange_slots(LAYOUTS["flat"], True, windowed=True)]
    assert exchange_blocks(buffers, 8, True, (5, 0)) == [[exchange_blocks(buffers, 8, True, (5, 0))[0][0]]]
    (block,) = exchange_blocks(buffers, 8, True, (5, 0))[0]
    assert (block.q_len, block.kv_len, block.window) == (32, 32, (5, 0))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_window_steps_cover_the_mask_exactly_once(name, cp, chunk, causal):
    """Over the steps the ring visits, every rank's blocks against the K/V it holds cover exactly its rows of the
    windowed mask; the steps it skips hold nothing any rank's window reaches."""
    layout = LAYOUTS[name]
    seq = layout.num_chunks(cp) * chunk
    for window in WINDOWS:
        if causal and window[1] != 0:
            continue
        visited = visited_steps(layout, cp, chunk, causal, window)
        seen: Counter = Counter()
        for rank in range(cp):
            rows = layout.shard_index(seq, cp, rank).tolist()
            for step, blocks in enumerate(ring_blocks(layout, cp, rank, chunk, causal, window)):
                assert step in visited or not blocks, (rank, step)
                held = {0: layout.shard_index(seq, cp, held_rank(rank, step, cp)).tolist()}
                for b in blocks:
                    _check_window(b)
                    seen.update(_pairs(b, rows, held))
        assert seen == _wanted(seq, causal, window), (name, cp, chunk, causal, window)


def test_ring_skips_the_steps_outside_a_short_window():
    """A window shorter than a chunk: the ring visits only the neighbours' steps, at cp=8, and each of those
    runs one block of the window's width."""
    flat, zigzag = LAYOUTS["flat"], LAYOUTS["zigzag"]
    assert visited_steps(flat, 8, 16, True, (3, 0)) == (0, 1)
    assert visited_steps(flat, 8, 16, False, (4, 4)) == (0, 1, 7)
    assert visited_steps(zigzag, 8, 16, True, (3, 0)) == (0, 1, 7)  # the back chunk's predecessor is on rank + 1
    assert visited_steps(flat, 8, 16, True, None) == tuple(range(8))
    (block,) = ring_blocks(flat, 8, 3, 16, True, (3, 0))[1]  # rank 2's last 3 keys for rank 3's first 3 rows
    assert (block.q_start, block.q_len, block.kv_start, block.kv_len, block.window) == (0, 3, 13, 3, (0, -1))

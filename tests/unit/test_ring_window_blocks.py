"""Causal sliding windows on the packed ring (layouts/packed_band.py, comms/ring/schedule.py): over the visited steps
every rank's blocks, read the way EACH provider reads them (the CPU mask; FA2 with aten's window clamping; cuDNN's
band keywords through the stand-in's reading), attend exactly the same-document pairs with 0 <= q - k <= w by
global position, each once; every row of a range with keys sees one; the static bounds hold; the skipped
steps hold no pair (that is the exactness over the visited ones); and the cuDNN path equals the reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpcompile.comms.ring.schedule import held_rank, packed_step_blocks, packed_visited_steps, packed_window
from cpcompile.executor import encode_varlen
from cpcompile.kernels import cudnn_varlen as cv
from cpcompile.kernels.cpu_varlen_ref import _mask
from cpcompile.kernels.flash_varlen import _window_kwargs
from cpcompile.kernels.varlen_ranges import adjacent_cu_seqlens
from cpcompile.layouts.thd import THD_LAYOUTS
from tests.support.cudnn_stand_in import CuDNNStandIn
from tests.unit.test_thd_layouts import _cu, _expected_mask


def _fa2_mask(b, tq: int, tk: int) -> torch.Tensor:
    """What aten's FA2 varlen attends for block b: a side >= max_seqlen_k becomes -1, and a -1 opposite a set
    side becomes max_seqlen_k (flash_api.cpp), on the bottom-right diagonal."""
    kw, max_k = _window_kwargs(b.window, b.causal), max(b.max_k, 1)
    left, right = kw.get("window_size_left", -1), kw.get("window_size_right", -1)
    if not kw:
        return _mask(b.ranges, tq, tk, b.causal, (-1, -1))
    right = 0 if b.causal else right
    left, right = (-1 if left >= max_k else left), (-1 if right >= max_k else right)
    left, right = (max_k if left < 0 <= right else left), (max_k if right < 0 <= left else right)
    return _mask(b.ranges, tq, tk, False, (left, right))


def _cudnn_mask(b, tq: int, tk: int) -> torch.Tensor:
    """What cuDNN attends for block b: the provider's band keywords, read as the stand-in reads them (cuDNN's
    left bound counting the diagonal, top-left unless causal_bottom_right)."""
    kw = cv.band(b.causal, b.window, b.square)
    args = (kw.get("is_causal", False), kw.get("causal_bottom_right", False))
    causal, window, top_left = CuDNNStandIn()._mask_args(*args, kw.get("window_left", -1), kw.get("window_right", -1))
    return _mask(b.ranges, tq, tk, causal, window, top_left)


def _ring_coverage(strategy: str, lengths: list[int], cp: int, w: int) -> None:
    layout = THD_LAYOUTS[strategy]
    cu = _cu(lengths)
    total = int(cu[-1])
    local = total // cp
    window = packed_window((w, 0), True, max(lengths), total)
    index = [layout.shard_index(cu, total, cp, r) for r in range(cp)]
    got = {name: torch.zeros(total, total, dtype=torch.int64) for name in ("cpu", "fa2", "cudnn")}
    for r in range(cp):
        # the steps the region visits: the window's reach and max_doc's (the longest document), as ring/varlen.py
        for step in packed_visited_steps(strategy, local, cp, window, True, max(lengths)):
            keys = index[held_rank(r, step, cp)]
            for b in packed_step_blocks(strategy, cu, local, cp, r, step, True, max(lengths), window):
                qs, qe, ks, ke = b.ranges
                ordered = bool((qs[1:] >= qe[:-1]).all() and (ks[1:] >= ke[:-1]).all())
                assert ordered and bool((qe >= qs).all() and (ke >= ks).all()), "ranges in order, no overlap"
                assert int((qe - qs).max()) <= b.max_q and int((ke - ks).max()) <= b.max_k, "a bound is too small"
                cu_q, cu_k = adjacent_cu_seqlens(b.ranges)  # how the CUDA providers see it: gaps are sequences
                nq, nk = (cu_q[1:] - cu_q[:-1]).long(), (cu_k[1:] - cu_k[:-1]).long()
                assert int(nq.max()) <= b.max_q and int(nk.max()) <= b.max_k, "a gap sequence exceeds the bounds"
                if not b.causal and window != (-1, -1):  # band blocks: no gap sequence has rows AND keys
                    assert not bool(((nq[1::2] > 0) & (nk[1::2] > 0)).any()), "a gap sequence has rows and keys"
                    assert bool(((qe > qs) <= (ke > ks)).all()), "a range has rows without keys"
                live = torch.zeros(local, dtype=torch.bool)
                for a, z, n in zip(qs.tolist(), qe.tolist(), (ke - ks).tolist()):
                    live[a:z] = n > 0
                for name, mask in (
                    ("cpu", _mask(b.ranges, local, local, b.causal, b.window)),
                    ("fa2", _fa2_mask(b, local, local)),
                    ("cudnn", _cudnn_mask(b, local, local)),
                ):
                    assert bool(mask.any(1)[live].all()), f"{name}: a row of a range with keys sees none (lse +inf)"
                    pairs = mask.long()
                    rows = index[r][:, None].expand_as(pairs)
                    got[name].index_put_((rows, keys[None, :].expand_as(pairs)), pairs, True)
    want = _expected_mask(cu, True, w).long()
    for name, hits in got.items():
        assert torch.equal(hits, want), f"{name}: some pair of the windowed mask is not attended exactly once"


@st.composite
def _windowed(draw, multiple_of: int):
    cp = draw(st.integers(2, 4))
    unit = multiple_of * cp if multiple_of else 1
    lengths = [n * unit for n in draw(st.lists(st.integers(0, 7), min_size=1, max_size=6))]  # empty ones too
    if not any(lengths):
        lengths.append(unit)
    if not multiple_of:
        extra = -sum(lengths) % cp
        lengths += [extra] if extra else []
    return cp, lengths, draw(st.integers(0, max(lengths) + 1))


@settings(max_examples=40, deadline=None)
@given(_windowed(0))
def test_thd_ring_window_blocks_are_the_global_band(case):
    cp, lengths, w = case
    _ring_coverage("thd", lengths, cp, w)


@settings(max_examples=25, deadline=None)
@given(_windowed(2))
def test_thd_zigzag_ring_window_blocks_are_the_global_band(case):
    cp, lengths, w = case
    _ring_coverage("thd_zigzag", lengths, cp, w)


@pytest.mark.parametrize(
    ("lengths", "cp", "w"),
    [([3, 9, 4], 2, 3), ([1, 15], 2, 7), ([2, 2, 12], 2, 1), ([16], 4, 5), ([5, 6, 1, 4], 4, 4), ([24], 3, 9)],
)
def test_thd_ring_windows_fixed_cases(lengths, cp, w):
    """Hand-picked off-by-one cases: windows of a piece, one less and one more, documents crossing ranks."""
    for left in (w - 1, w, w + 1):
        _ring_coverage("thd", lengths, cp, left)


def test_visited_steps_skip_what_no_window_reaches():
    """thd: the held rank s steps back is (s - 1) * L + 1 tokens away at least; thd_zigzag: every step."""
    assert packed_visited_steps("thd", 8, 4, (0, -1)) == (0,)
    assert packed_visited_steps("thd", 8, 4, (1, -1)) == (0, 1)
    assert packed_visited_steps("thd", 8, 4, (8, -1)) == (0, 1)
    assert packed_visited_steps("thd", 8, 4, (9, -1)) == (0, 1, 2)
    assert packed_visited_steps("thd", 8, 4, (100, -1)) == (0, 1, 2, 3)
    assert packed_visited_steps("thd_zigzag", 8, 4, (1, -1)) == (0, 1, 2, 3)
    assert packed_window((15, 0), True, 16, 64) == (-1, -1), "a window as long as every document is no window"
    assert packed_window((14, 0), True, 16, 64) == (14, -1)


def test_a_short_window_does_at_most_the_neighbours_work():
    """A window shorter than a rank's piece: each thd rank attends its own piece and its predecessor's only."""
    cu = _cu([34, 30])
    steps = packed_visited_steps("thd", 16, 4, (5, -1))
    assert steps == (0, 1)
    band = packed_step_blocks("thd", cu, 16, 4, 2, 1, True, 34, (5, -1))
    assert [b.window for b in band] == [(0, 5), (-1, -1)]
    (wq0, wq1, wk0, wk1), (uq0, uq1, uk0, uk1) = (b.ranges[:, 1::2].tolist() for b in band)  # the real ranges
    # rank 2 holds [32, 48), rank 1 [16, 32): document 0 = [0, 34) has rows 32, 33 here; row 32 sees keys 27..31,
    # row 33 keys 28..31: keys 29..31 (local 13..15) are seen by both (unmasked), 27, 28 on the band (0, 5)
    assert (wq0[0], wq1[0], wk0[0], wk1[0]) == (0, 2, 11, 13)
    assert (uq0[0], uq1[0], uk0[0], uk1[0]) == (0, 2, 13, 16)
    # rank 3 ([48, 64)): document 1 = [34, 64) rows 48..52 see keys 43..47 of rank 2 (local 11..15), on the band
    window, unmasked = packed_step_blocks("thd", cu, 16, 4, 3, 1, True, 34, (5, -1))
    assert window.ranges[:, 1::2].tolist() == [[0, 0], [0, 5], [0, 11], [0, 16]]
    assert not bool((unmasked.ranges[1] > unmasked.ranges[0]).any()), "no key is seen by all of rows 48..52"


@pytest.mark.parametrize("strategy", ["thd", "thd_zigzag"])
def test_cudnn_band_blocks_equal_the_reference(monkeypatch, strategy):
    """Every windowed ring step through the executor on the cuDNN stand-in (its band keywords, bottom-right,
    unseen-key zeros) equals cpu_varlen_ref's, forward and backward."""
    from tests.unit.test_cudnn_varlen import _tensors, _through_executor

    stand_in = CuDNNStandIn()
    monkeypatch.setattr(cv, "_ops", lambda: stand_in)
    g = torch.Generator().manual_seed(3)
    lengths = [8, 24, 16] if strategy == "thd_zigzag" else [3, 14, 1, 9, 5]
    cp, cu = 2, _cu(lengths)
    local = sum(lengths) // cp
    window = (5, -1)
    for rank in range(cp):
        for step in packed_visited_steps(strategy, local, cp, window):
            blocks = packed_step_blocks(strategy, cu, local, cp, rank, step, True, max(lengths), window)
            if not blocks:
                continue
            q, k, v, dout = _tensors(g, local, local)
            spec, ranges = encode_varlen(blocks), [b.ranges for b in blocks]
            results = [_through_executor(q, k, v, dout, ranges, spec, n) for n in ("cudnn_varlen", "cpu_varlen_ref")]
            for got, want in zip(*results):
                torch.testing.assert_close(got.double(), want.double(), rtol=1e-6, atol=1e-6)

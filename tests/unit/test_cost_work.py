"""cost/work.py's counts against brute force, and the cost model's FLOPs against single-device attention: the
layouts' blocks cover the mask exactly once, so the ranks' FLOPs must add up to one device's (a2a: per head)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from cpcompile.cost import SiteShape, estimate
from cpcompile.cost.work import TILE, flops, sequence_work
from cpcompile.families.sdpa.costing import DENSE
from cpcompile.families.varlen.costing import PACKED, assumed_documents


def _brute(q_lens, k_lens, causal, window) -> tuple[int, int, int]:
    """(pairs, tiles, rect tiles) from an explicit mask per sequence (bottom-right, flash-attn windows)."""
    left, right = window
    pairs = tiles = rect = 0
    for a, b in zip(q_lens, k_lens):
        if a == 0:
            continue
        t = torch.arange(a)[:, None]
        j = torch.arange(b)[None, :]
        d = b - a + t
        keep = (j <= d) if causal else (j <= d + right) if right >= 0 else torch.ones(a, b, dtype=torch.bool)
        if left >= 0:
            keep &= j >= d - left
        pairs += int(keep.sum())
        for i, k in itertools.product(range(0, a, TILE), range(0, b, TILE)):
            tiles += bool(keep[i : i + TILE, k : k + TILE].any())
            rect += 1
    return pairs, tiles, rect


def _cases():
    rng = random.Random(0)
    for _ in range(120):
        causal = rng.random() < 0.6
        window = rng.choice(
            [(-1, -1), (rng.randint(0, 300), -1), (-1, rng.randint(0, 200)), (rng.randint(0, 300),) * 2]
        )
        if causal:
            window = (window[0], -1)
        q = [rng.choice([0, 1, 127, 128, 129, rng.randint(0, 400)]) for _ in range(rng.randint(1, 4))]
        k = [a + rng.randint(0, 300) for a in q]
        yield q, k, causal, window


@pytest.mark.parametrize("q_lens, k_lens, causal, window", list(_cases()))
def test_counts_match_the_mask(q_lens, k_lens, causal, window):
    w = sequence_work(torch.tensor(q_lens), torch.tensor(k_lens), causal, window)
    assert (w.pairs, w.tiles, w.rect_tiles) == _brute(q_lens, k_lens, causal, window)


def test_grid_counts_the_static_bounds():
    w = sequence_work(torch.tensor([5, 0]), torch.tensor([5, 0]), True, bound_q=300, bound_k=600, launched=5)
    assert (w.grid_q, w.grid_k, w.ctas, w.calls) == (5 * 3, 5 * 5, 2, 1)


def _shape(kind, tokens, world, causal=True, **kw):
    return SiteShape(
        DENSE if kind == "sdpa" else PACKED, 2 if kind == "sdpa" else 1, tokens, 8, 2, 16, 16, 2, 4, causal, world, **kw
    )


def _single_device(kind, seq, causal, docs=None) -> float:
    if kind == "sdpa":
        pairs = seq * (seq + 1) // 2 if causal else seq * seq
        return 2 * flops(pairs, 8, 16, 16)  # batch 2
    pairs = sum(n * (n + 1) // 2 if causal else n * n for n in docs)
    return flops(pairs, 8, 16, 16)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout, comm", [("flat", "all_gather"), ("zigzag", "all_gather"), ("flat", "a2a")])
def test_dense_flops_add_up_to_one_device(layout, comm, causal, world):
    if comm == "a2a" and 8 % world:
        pytest.skip("heads do not split")
    seq = 2 * world * 24
    e = estimate(_shape("sdpa", seq // world, world, causal), layout, comm, "cpu_flash")
    total = sum(e.flops) if comm == "all_gather" else e.flops[0] * world  # a2a: every rank Hq/cp heads
    assert total == _single_device("sdpa", seq, causal)
    assert len(e.blocks) == world and e.balance >= 1.0


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout, comm", [("thd", "all_gather"), ("thd_zigzag", "all_gather"), ("thd", "a2a")])
def test_packed_flops_add_up_to_one_device(layout, comm, causal, world):
    docs = [8 * world, 24 * world, 2 * world, 14 * world]  # multiples of 2 * world (thd_zigzag)
    cu = torch.tensor([0, *itertools.accumulate(docs)])
    e = estimate(_shape("varlen", sum(docs) // world, world, causal, max_doc=max(docs)), layout, comm,
                 "cpu_varlen_ref", cu)  # fmt: skip
    total = sum(e.flops) if comm == "all_gather" else e.flops[0] * world
    assert total == _single_device("varlen", None, causal, docs)
    assert e.documents == "this batch's 4 documents"


def test_thd_zigzag_balances_what_thd_does_not():
    docs = [64, 8, 8, 48]
    cu = torch.tensor([0, *itertools.accumulate(docs)])
    shape = _shape("varlen", 32, 4, max_doc=64)
    thd, zigzag = (estimate(shape, layout, "all_gather", "cpu_varlen_ref", cu) for layout in ("thd", "thd_zigzag"))
    assert zigzag.balance == 1.0 and thd.balance > 1.5


def test_assumed_documents_fill_the_packed_length():
    assert assumed_documents(100, 30).tolist() == [0, 30, 60, 90, 100]
    assert assumed_documents(100, None).tolist() == [0, 100]
    e = estimate(_shape("varlen", 50, 2, max_doc=30), "thd", "all_gather", "cpu_varlen_ref")
    assert e.documents == "assumed: documents of 30 tokens"


@pytest.mark.parametrize("comm", ["all_gather", "a2a", "ring"])
@pytest.mark.parametrize("causal,window", [(True, (100, 0)), (True, (300, 0)), (False, (64, 200))])
def test_windowed_dense_sites_are_costed_with_their_window(comm, causal, window):
    """A windowed dense site's FLOPs over its ranks add up to one device's windowed attention (the blocks cover
    the band once), not to the unwindowed square the model counted before."""
    world, seq, heads, d = 4, 768, 8, 64
    shape = SiteShape(
        costing=DENSE, batch=1, tokens=seq // world, q_heads=heads, kv_heads=2, head_dim=d, v_head_dim=d,
        elt=2, acc_elt=4, causal=causal, world=world, window=window,
    )  # fmt: skip
    rel = torch.arange(seq)[None, :] - torch.arange(seq)[:, None]
    pairs = int(((rel >= -window[0]) & (rel <= (0 if causal else window[1]))).sum())
    e = estimate(shape, "zigzag", comm, "cpu_flash")
    total = e.flops[0] * world if comm == "a2a" else sum(e.flops)  # a2a: every rank Hq/cp heads, whole sequence
    assert total == flops(pairs, heads, d, d), (total, flops(pairs, heads, d, d))

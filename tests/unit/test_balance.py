"""The thd_balanced solver (layouts/balance.py) and its plan tensor: hypothesis over document mixes.

Properties: every rank owns exactly T/cp tokens; the pieces tile every document once; at most 2 pieces of a
document a rank, within the piece slots and the key budget; at most 2 (cp - 1) documents are cut; and the
balance property max rank work <= mean x (1 + eps) + one token's work of the longest document (the finest
cut there is). The plan tensor passes the layout's own device check, and shard / unshard invert each other.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpcompile.layouts.balance import balance, piece_work, rank_work
from cpcompile.layouts.thd import THD_LAYOUTS
from cpcompile.layouts.thd_balanced import is_plan, key_budget, make_plan, pieces_per_rank

EPS = 0.01
"""The solver's tolerance (balance(tolerance=0.01)): boundaries snap to whole documents within it."""
LAYOUT = THD_LAYOUTS["thd_balanced"]


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)


@st.composite
def _mix(draw):
    """(cp, lengths): 1-token documents, a document longer than T/cp, thousands of tiny documents, log-normal-ish
    mixes, empty (padding) documents; the total padded to a multiple of cp with one more document."""
    cp = draw(st.integers(2, 8))
    kind = draw(st.sampled_from(["ones", "long", "tiny", "mixed"]))
    if kind == "ones":
        lengths = [1] * draw(st.integers(1, 300)) + draw(st.lists(st.integers(1, 60), max_size=4))
    elif kind == "long":
        others = draw(st.lists(st.integers(1, 40), max_size=30))
        lengths = others + [draw(st.integers(sum(others) + 1, 3 * sum(others) + 200))]  # > T/cp for any cp
    elif kind == "tiny":
        lengths = [draw(st.integers(1, 4))] * draw(st.integers(1000, 3000)) + [draw(st.integers(1, 2000))]
    else:
        lengths = draw(st.lists(st.integers(1, 4000), min_size=1, max_size=80))
    lengths = draw(st.permutations(lengths)) + [0] * draw(st.integers(0, 2))
    extra = -sum(lengths) % cp
    return cp, lengths + ([extra] if extra else [])


def _solve(lengths: list[int], cp: int):
    local = sum(lengths) // cp
    return balance(lengths, cp, pieces_per_rank(len(lengths) + 1, cp), key_budget(local, cp))


@settings(max_examples=60, deadline=None)
@given(_mix())
def test_balance_properties(case):
    cp, lengths = case
    local = sum(lengths) // cp
    ranks, balanced = _solve(lengths, cp)
    assert balanced, "the solver fell back to contiguous runs on a mix it should balance"
    assert [sum(b - a for _, a, b in r) for r in ranks] == [local] * cp, "every rank owns exactly T/cp tokens"
    for r in ranks:
        assert len(r) <= pieces_per_rank(len(lengths) + 1, cp), "more pieces than the rank has slots"
        assert sum(b for _, _, b in r) <= key_budget(local, cp), "the pieces' key prefixes overflow the buffer"
        docs = [d for d, _, _ in r]
        assert max(docs.count(d) for d in docs) <= 2 if docs else True, "3+ pieces of one document on a rank"
    covered: dict[int, list[tuple[int, int]]] = {}
    for r in ranks:
        for d, a, b in r:
            assert 0 <= a < b <= lengths[d]
            covered.setdefault(d, []).append((a, b))
    for d, n in enumerate(lengths):
        spans = sorted(covered.get(d, []))
        assert [a for a, _ in spans[1:]] == [b for _, b in spans[:-1]], f"document {d} not tiled"
        assert (spans[0][0], spans[-1][1]) == (0, n) if n else not spans
    cut = sum(len(s) > 1 for s in covered.values())
    assert cut <= 2 * (cp - 1), f"{cut} documents cut; the sweep cuts at most 2 a rank boundary"
    work = [rank_work(r) for r in ranks]
    mean = sum(work) / cp
    assert max(work) <= mean * (1 + EPS) + max(lengths), f"unbalanced: {work}"


def test_balance_examples():
    """The docstrings' examples, one document over every rank, 1-token documents only."""
    ranks, _ = _solve([12, 1, 1, 1, 1], 2)
    assert [sorted(r) for r in ranks] == [
        [(0, 0, 3), (0, 9, 12), (3, 0, 1), (4, 0, 1)],  # A's front and back, d, e: work 6 + 33 + 1 + 1
        [(0, 3, 9), (1, 0, 1), (2, 0, 1)],  # A's middle, b, c: work 39 + 1 + 1
    ]
    assert [rank_work(r) for r in ranks] == [41, 41]
    ranks, _ = _solve([20, 6, 2, 2, 1, 1], 4)  # the picture in layouts/balance.py's docstring
    assert [sorted(r) for r in ranks] == [
        [(0, 0, 6), (0, 18, 20)],
        [(0, 6, 12), (4, 0, 1), (5, 0, 1)],
        [(0, 15, 18), (1, 0, 1), (2, 0, 2), (3, 0, 2)],
        [(0, 12, 15), (1, 1, 6)],
    ]
    assert [rank_work(r) for r in ranks] == [60, 59, 58, 62]
    ranks, _ = _solve([64], 8)  # one document: zigzag-like pairs, equal work
    assert len({rank_work(r) for r in ranks}) <= 2 and max(len(r) for r in ranks) <= 2
    assert sum(piece_work(a, b) for r in ranks for _, a, b in r) == piece_work(0, 64)
    ranks, balanced = _solve([1] * 64, 8)
    assert balanced and all(len(r) == 8 for r in ranks)


@pytest.mark.parametrize("cp,lengths", [(2, [12, 1, 1, 1, 1]), (3, [1] * 20 + [7]), (4, [0, 30, 0, 1, 1]), (8, [64])])
def test_plan_tensor_checks_and_round_trips(cp, lengths):
    """make_plan's tensor passes the device check, and sharding then unsharding (index math) is the identity."""
    offsets = _cu(lengths)
    total = int(offsets[-1])
    plan = make_plan(offsets, cp)
    assert is_plan(plan) and not is_plan(offsets)
    assert bool(LAYOUT.metadata_ok(plan, total, cp, None))
    assert torch.equal(LAYOUT.offsets(plan, cp), offsets.long())
    x = torch.arange(total) * 10
    shards = [x[LAYOUT.shard_index(plan, total, cp, r)] for r in range(cp)]
    assert all(s.numel() == total // cp for s in shards)
    back = torch.empty_like(x)
    back[torch.cat([LAYOUT.shard_index(plan, total, cp, r) for r in range(cp)])] = torch.cat(shards)
    assert torch.equal(back, x)


def test_metadata_check_refuses_tampered_plans():
    """The device check sees a plan whose pieces do not tile the buffer, or a plan for another cp."""
    offsets = _cu([12, 1, 1, 1, 1])
    plan = make_plan(offsets, 2)
    n = offsets.numel()
    shifted = plan.clone()
    shifted[n] += 1  # rank 0's first piece starts one token late
    assert not bool(LAYOUT.metadata_ok(shifted, 16, 2, None))
    swapped = plan.clone()
    swapped[-1] = -((1 << 30) + 4)  # tagged for cp=4
    assert not bool(LAYOUT.metadata_ok(swapped, 16, 2, None))
    assert not bool(LAYOUT.metadata_ok(plan, 16, 2, 11)), "a document longer than max_q/max_k"

"""comm="selective"'s index math (comms/selective/schedule.py) against a brute force, and its cost (comm="auto")."""

from __future__ import annotations

import random

import pytest
import torch

from cpcompile.comms.selective.schedule import capacity, global_key_buffer, held_len, select, select_thd
from cpcompile.cost import SiteShape, choose
from cpcompile.families.varlen.costing import PACKED
from cpcompile.layouts import get_packed_layout
from cpcompile.layouts.block import NO_WINDOW
from cpcompile.layouts.thd_balanced import make_plan

LAYOUT = get_packed_layout("thd_balanced")
THD = get_packed_layout("thd")


def _lengths(rng: random.Random, total: int, local: int) -> list[int]:
    out, left = [], total
    while left:
        out.append(min(left, rng.choice([1, 1, 2, 3, 5, local + 3, 2 * local])))
        left -= out[-1]
    if rng.random() < 0.3:
        out.insert(rng.randrange(len(out) + 1), 0)  # an empty (padding) document
    return out


def _brute(plan, offsets, cp, local, causal, layout=LAYOUT):
    """Per rank: its global positions, and the set of other ranks' positions its queries read."""
    pos = [layout.shard_index(plan, cp * local, cp, r).tolist() for r in range(cp)]
    doc = {g: max(i for i in range(len(offsets) - 1) if offsets[i] <= g < offsets[i + 1]) for g in range(cp * local)}
    reads = []
    for r in range(cp):
        keys = set()
        for g in pos[r]:
            d = doc[g]
            keys.update(range(offsets[d], g + 1 if causal else offsets[d + 1]))
        reads.append(keys - set(pos[r]))
    return pos, reads


@pytest.mark.parametrize("strategy", ["thd_balanced", "thd"])
@pytest.mark.parametrize("seed", range(12))
def test_slots_deliver_exactly_what_each_rank_reads(seed, strategy):
    """need = the brute force's counts; where every need fits C, the sent slots put each read token at its
    held_position on the reader, and `back` finds each token's returned gradient slot on its owner. Under thd
    every need fits C = min(L, the longest document)."""
    rng = random.Random(seed)
    cp, local = rng.choice([2, 3, 4]), rng.choice([4, 8])
    lengths = _lengths(rng, cp * local, local)
    offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    thd = strategy == "thd"
    plan = torch.tensor(offsets) if thd else make_plan(torch.tensor(offsets), cp)
    pick = select_thd if thd else select
    for causal in (True, False):
        pos, reads = _brute(plan, offsets, cp, local, causal, get_packed_layout(strategy))
        owner = {g: r for r in range(cp) for g in pos[r]}
        if thd:
            assert all(
                bool(select_thd(plan, local, cp, r, causal, capacity(local, max(lengths))).fits) for r in range(cp)
            )
        for cap in (1, 3, local):
            sels = [pick(plan, local, cp, r, causal, cap) for r in range(cp)]
            need = [[sum(owner[g] == p for g in reads[r]) for p in range(cp)] for r in range(cp)]
            assert all(s.need.tolist() == need for s in sels)
            assert all(bool(s.fits) == (max(map(max, need)) <= cap) for s in sels)
            if not bool(sels[0].fits):
                continue
            for r in range(cp):
                held = list(pos[r])
                for p in (p for p in range(cp) if p != r):  # what p sends r: its block for r
                    block = [x for x in range(cp) if x != p].index(r)
                    held += [pos[p][i] for i in sels[p].send_index.view(cp - 1, cap)[block].tolist()]
                assert all(held[int(sels[r].held_position[g])] == g for g in reads[r] | set(pos[r]))
                mask = {g for g in range(cp * local) if sels[r].held_mask[g]}
                assert mask == reads[r] | set(pos[r])
                if thd:  # the key buffer in global order, and its fold back onto the held buffer
                    size = held_len(local, cp, cap)
                    index, fold = global_key_buffer(sels[r], size)
                    assert all(held[int(index[g])] == g for g in mask)
                    assert {(int(fold[0, h]), h) for h in range(size) if fold[0, h] >= 0} == {
                        (g, int(index[g])) for g in mask
                    }
                    # the region's slice of it: the keys the rank's rows can reach (the longest document bounds
                    # how far back, causal rows stop at the rank's end), every read key inside it
                    # the region's slice of it: the keys the rank's rows can reach (the longest document bounds
                    # how far back, and a causal window's left side; causal rows stop at the rank's end), every
                    # key a row reads inside it; held tokens before it (a window) fold to nothing
                    for left in (-1, 1, 3) if causal else (-1,):
                        attn = (left, 0) if left >= 0 else NO_WINDOW
                        key_slice = THD.key_window(local, cp, r, causal, max(lengths), attn) or (0, cp * local)
                        start, stop = key_slice
                        seen = {
                            k for k in reads[r] | set(pos[r]) if left < 0 or any(0 <= t - k <= left for t in pos[r])
                        }
                        assert all(start <= g < stop for g in seen)
                        index_w, fold_w = global_key_buffer(sels[r], size, key_slice)
                        assert torch.equal(index_w, index[start:stop])
                        assert {(int(fold_w[0, h]), h) for h in range(size) if fold_w[0, h] >= 0} == {
                            (g - start, int(index[g])) for g in mask if start <= g < stop
                        }
                for i, p in enumerate(x for x in range(cp) if x != r):  # p returns the gradient of r's tokens
                    for j, g in enumerate(pos[r]):
                        slot = int(sels[r].back[i, j])
                        if g not in reads[p]:
                            assert slot == -1
                            continue
                        on_p = int(sels[p].held_position[g]) - local  # where p received it
                        assert slot - i * cap == on_p - [x for x in range(cp) if x != p].index(r) * cap


def test_capacity_is_the_static_bound():
    assert (capacity(8, None), capacity(8, 6), capacity(8, 64)) == (8, 6, 8)


def _shape(tokens, world, max_doc):
    return SiteShape(PACKED, 1, tokens, 32, 8, 128, 128, 2, 4, True, world, max_doc=max_doc)


def test_auto_picks_selective_only_when_its_slots_send_less():
    """thd_balanced under comm="auto": the same blocks either way (the cost of the plan made of the assumed
    documents), so the wire decides: short documents (max_q 1K of 8K tokens a rank) send 1/8 of the all-gather's
    bytes; without max_q the slots are a whole rank's tokens and the all-gather (first in order) stays."""
    options = [("all_gather", "flash_varlen"), ("selective", "flash_varlen")]
    short = choose(_shape(8192, 8, 1024), "thd_balanced", options)
    assert short.chosen.comm == "selective" and short.chosen.sent_fwd * 8 == short.runner_up.sent_fwd
    assert short.chosen.flops == short.runner_up.flops  # the same blocks; the region overhead scales with bytes
    whole = choose(_shape(8192, 8, None), "thd_balanced", options)
    assert whole.chosen.comm == "all_gather" and whole.chosen.total_ms == whole.runner_up.total_ms

"""layouts/flex.py: global positions of a flex region's buffers, and the block tables derived from the global mask.

On CPU, flex_attention's eager path ignores the block tables (it evaluates the mask_mod everywhere), so the CPU
parity tests cannot see a wrong table: these tests check every derived table block by block against the
token mask itself, for every layout, CP size, rank and comm.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from cpcompile.layouts import get_layout
from cpcompile.layouts.flex import Positions, derive_tables, rank_major_chunks, transpose_tables


def _buffers(layout_name: str, cp: int, rank: int, seq: int, comm: str) -> tuple[Positions, Positions, bool]:
    """(q positions, key positions, whether heads are split) exactly as comms/all_gather/flex.py and comms/a2a/flex.py build them."""
    lay = get_layout(layout_name)
    chunk = seq // cp // lay.chunks_per_rank
    kv = Positions(tuple(rank_major_chunks(lay, cp)), chunk)
    if comm == "a2a":
        return kv, kv, True
    return Positions(tuple(lay.rank_chunks(rank, cp)), chunk), kv, False


def _global(pos: Positions) -> torch.Tensor:
    idx = torch.arange(pos.tokens, dtype=torch.int32)
    table = pos.table(torch.device("cpu")) if pos.offset is None else None
    return pos.apply(idx, table).long()


def _listed(num: torch.Tensor, idx: torch.Tensor) -> set:
    """{(b, h, row, col)} of the blocks a (counts, indices) pair lists."""
    out = set()
    for b, h, r in itertools.product(*(range(n) for n in num.shape)):
        for c in idx[b, h, r, : num[b, h, r]].tolist():
            out.add((b, h, r, c))
    return out


@pytest.mark.parametrize("layout", ["flat", "zigzag"])
@pytest.mark.parametrize("cp", [2, 4])
def test_positions_are_the_layout_tokens(layout, cp):
    seq = 64
    lay = get_layout(layout)
    for rank in range(cp):
        q, kv, _ = _buffers(layout, cp, rank, seq, "all_gather")
        assert torch.equal(_global(q), lay.shard_index(seq, cp, rank))
        assert torch.equal(_global(kv), torch.cat([lay.shard_index(seq, cp, p) for p in range(cp)]))


def _random_mask(seed: int, heads: int, seq: int) -> torch.Tensor:
    """A token mask with empty, full and partial blocks (bands of random density per head)."""
    g = torch.Generator().manual_seed(seed)
    dens = torch.rand(heads, seq // 8, seq // 8, generator=g).repeat_interleave(8, 1).repeat_interleave(8, 2)
    dens = torch.where(dens < 0.3, 0.0, torch.where(dens > 0.7, 1.0, dens))
    return torch.rand(heads, seq, seq, generator=g) < dens


@pytest.mark.parametrize("layout,cp,comm,heads,block", [
    ("flat", 2, "all_gather", 1, (8, 8)),
    ("flat", 4, "all_gather", 2, (8, 16)),
    ("zigzag", 2, "all_gather", 1, (8, 8)),
    ("zigzag", 4, "all_gather", 2, (8, 4)),
    ("flat", 2, "a2a", 2, (16, 8)),
    ("zigzag", 2, "a2a", 1, (8, 8)),
    ("zigzag", 4, "a2a", 4, (4, 8)),
])  # fmt: skip
def test_derived_tables_are_the_buffers_blocks(layout, cp, comm, heads, block):
    seq = 128
    for seed in range(3):
        mask = _random_mask(seed, heads, seq)
        bm = create_block_mask(
            lambda b, h, q, k, m=mask: m[h, q, k], 2, heads, seq, seq, device="cpu", BLOCK_SIZE=block
        )
        tables = bm.as_tuple()[2:10]
        for rank in range(cp):
            qpos, kvpos, a2a = _buffers(layout, cp, rank, seq, comm)
            heads_of = (rank * heads // cp, heads // cp) if a2a else None  # the region's q heads (= mask heads)
            derived = derive_tables(tables, qpos, kvpos, block, heads_of)
            first = heads_of[0] if heads_of and heads > 1 else 0
            local = mask[first : first + derived[0].shape[1]][:, _global(qpos)][:, :, _global(kvpos)]
            qb, kb = block
            n_q, n_k = qpos.tokens // qb, kvpos.tokens // kb
            blocks = local.view(local.shape[0], n_q, qb, n_k, kb).permute(0, 1, 3, 2, 4).flatten(-2)
            any_, all_ = blocks.any(-1), blocks.all(-1)
            partial = _listed(derived[0], derived[1])
            full = _listed(derived[2], derived[3])
            for b, h, i, j in itertools.product(range(2), range(local.shape[0]), range(n_q), range(n_k)):
                key = (b, h, i, j)
                if all_[h, i, j]:
                    assert key in full and key not in partial, (rank, key)
                elif any_[h, i, j]:
                    assert key in partial and key not in full, (rank, key)
                else:
                    assert key not in partial and key not in full, (rank, key)
            transpose = lambda s: {(b, h, j, i) for b, h, i, j in s}  # noqa: E731
            assert _listed(derived[4], derived[5]) == transpose(partial)
            assert _listed(derived[6], derived[7]) == transpose(full)


def test_transpose_tables_lists_blocks_in_order():
    num = torch.tensor([[[2, 0, 1]]], dtype=torch.int32)
    idx = torch.tensor([[[[3, 1, 0, 0], [0, 0, 0, 0], [1, 2, 0, 0]]]], dtype=torch.int32)
    t_num, t_idx = transpose_tables(num, idx, 4)
    assert t_num.tolist() == [[[0, 2, 0, 1]]]  # column 1: rows 0 and 2; column 3: row 0
    assert t_idx[0, 0, 1, :2].tolist() == [0, 2] and t_idx[0, 0, 3, 0] == 0

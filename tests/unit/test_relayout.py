"""The relayout region's permutation (cpcompile/mixers/relayout.py) against a global reference, in one process: the
all-to-all is played by the test (each rank's send buffer cut by its splits and delivered), so the region's own
packing and unpacking run as on the ranks, at cp 2, 3 and 4, zigzag -> flat and back, fp64 bit-equal."""

from __future__ import annotations

import pytest
import torch

import cpcompile.mixers.relayout as relayout_module
from cpcompile.layouts import LAYOUTS
from cpcompile.mixers.relayout import received_tokens, relayout, relayout_routes


def _play(pieces: dict[int, list[torch.Tensor]], src: str, dst: str, cp: int, seq_dim: int, monkeypatch) -> list:
    """Every rank's relayout of its `pieces[rank]` (one region call, its all-to-alls one chain), the all-to-alls
    delivered between two runs of the region."""
    sent: dict[int, list] = {}

    def record(rank):
        def fake(x, out_splits, in_splits, group_name):
            assert sum(in_splits) == x.shape[0], (in_splits, x.shape)
            sent.setdefault(rank, []).append((x, list(in_splits), list(out_splits)))
            return x.new_zeros(sum(out_splits), *x.shape[1:])

        return fake

    def call(rank):
        dims = (seq_dim,) * len(pieces[rank])
        return relayout(*pieces[rank], seq_dims=dims, src=src, dst=dst, group_name="0", rank=rank, world=cp)

    for rank in range(cp):
        monkeypatch.setattr(relayout_module, "exchange_uneven", record(rank))
        call(rank)
    outs = []
    for rank in range(cp):
        arrived = []
        for k in range(len(pieces[rank])):  # the k-th all-to-all of the chain
            parts = [sent[p][k][0].split(sent[p][k][1])[rank] for p in range(cp)]  # what rank p sent to `rank`
            assert [t.shape[0] for t in parts] == sent[rank][k][2], "the receive splits do not match what arrives"
            arrived.append(torch.cat(parts))
        monkeypatch.setattr(relayout_module, "exchange_uneven", lambda x, o, i, g, arrived=arrived: arrived.pop(0))
        outs.append(call(rank))
    return outs


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("seq_dim", [1, 0])
def test_relayout_is_the_layouts_permutation(cp, seq_dim, monkeypatch):
    seq = 4 * 2 * cp  # 4 tokens a zigzag chunk
    shape = [2, 3] if seq_dim == 1 else [3, 2]
    whole = torch.randn(shape[0], seq, 5, dtype=torch.float64)
    whole = whole if seq_dim == 1 else whole.transpose(0, 1).contiguous()  # (seq, 3, 5)

    def shard(t: torch.Tensor, name: str, rank: int) -> torch.Tensor:
        return t.index_select(seq_dim, LAYOUTS[name].shard_index(seq, cp, rank))

    ids = torch.randint(0, 100, (shape[0], seq) if seq_dim == 1 else (seq, shape[1]))  # int64 tokens in the chain
    for src, dst in (("zigzag", "flat"), ("flat", "zigzag")):
        outs = _play({r: [shard(whole, src, r), shard(ids, src, r)] for r in range(cp)}, src, dst, cp, seq_dim,
                     monkeypatch)  # fmt: skip
        for rank, (out, out_ids) in enumerate(outs):
            assert torch.equal(out, shard(whole, dst, rank)), (src, dst, cp, rank)
            assert torch.equal(out_ids, shard(ids, dst, rank)), (src, dst, cp, rank)


def test_routes_and_bytes():
    """cp 2: rank 0 (chunks 0 and 3) keeps chunk 0 and sends chunk 3 to rank 1; rank 1 (chunks 1 and 2) sends
    chunk 1 to rank 0 and keeps chunk 2. Each rank receives half its tokens from the other rank at cp 2; from cp
    3 on some rank receives all of them (cp 4: ranks 1 and 2, whose zigzag and flat chunks share nothing)."""
    zigzag, flat = LAYOUTS["zigzag"], LAYOUTS["flat"]
    assert relayout_routes(zigzag, flat, 2, 0).sends == ((0,), (1,))
    assert relayout_routes(zigzag, flat, 2, 0).recvs == ((0,), (1,))
    assert relayout_routes(zigzag, flat, 2, 1).sends == ((0,), (1,))
    assert relayout_routes(flat, zigzag, 2, 1).recvs == ((0,), (1,))  # chunk 1 from rank 0, chunk 2 kept
    assert [received_tokens(zigzag, flat, cp, 8) for cp in (2, 3, 4)] == [4, 8, 8]
    assert [received_tokens(flat, zigzag, cp, 8) for cp in (2, 3, 4)] == [4, 8, 8]
    assert received_tokens(flat, flat, 4, 8) == 0


def test_a_round_trip_through_flat_receives_the_chunks_a_rank_trades():
    """zigzag -> flat -> zigzag at cp 4, 8 tokens a rank (chunks of 4): ranks 1 and 3 share no chunk between their
    zigzag and flat slices and receive both chunks each way (16 tokens); ranks 0 and 2 keep one (8); flat moves
    nothing."""
    zigzag, flat = LAYOUTS["zigzag"], LAYOUTS["flat"]

    def received(src, dst, rank: int) -> int:
        routes = relayout_routes(src, dst, 4, rank)
        return sum(len(r) for peer, r in enumerate(routes.recvs) if peer != rank) * 8 // routes.fine

    assert [received(zigzag, flat, r) + received(flat, zigzag, r) for r in range(4)] == [8, 16, 8, 16]
    assert max(received(flat, flat, r) for r in range(4)) == 0

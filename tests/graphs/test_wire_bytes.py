"""The comm registry's wire_bytes (what the cost model and explain() report a rank sends) against the collectives
the regions really launch: the AOT forward and backward graphs on a fake process group, one rank of 4.

A rank sends (world - 1) copies of an all-gather's input, and (world - 1) / world of a reduce-scatter's or an
all-to-all's input. The packed-metadata check's 2-int64 all-gather (once per graph, not per site) is left out.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import AuxRequest, varlen_attn

import cpcompile
from cpcompile.comm.wire import WireShape
from cpcompile.comms.registry import get_comm
from cpcompile.testing.varlen_model import GQA
from tests.support.fake_pg import capture_graphs, fake_group
from tests.support.graphs import sent_bytes

WORLD, RANK = 4, 1


def _sent(gm) -> int:
    return sent_bytes(gm, WORLD, RANK)


def _dense(layout, comm, heads, dtype):
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(2, h, 16, 8, generator=g, dtype=dtype, requires_grad=True) for h in (heads[0], heads[1], heads[1])
    )

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    with fake_group(RANK, WORLD):
        graphs = capture_graphs(fn, cpcompile.backend(strategy=layout, comm=comm, inner="eager"), q, k, v)
    return graphs, (16, 2, heads[0], heads[1], 8, 8, dtype)


def _packed(layout, comm, heads, dtype, lse):
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(8, h, 8, generator=g, dtype=dtype, requires_grad=True) for h in (heads[0], heads[1], heads[1])
    )
    cu = torch.tensor([0, 8, 24, 32], dtype=torch.int32)
    aux = {"return_aux": AuxRequest(lse=True)} if lse else {}

    def fn(q, k, v, cu):
        return varlen_attn(q, k, v, cu, cu, 32, 32, window_size=(-1, 0), **GQA, **aux)

    with fake_group(RANK, WORLD):
        graphs = capture_graphs(fn, cpcompile.backend(strategy=layout, comm=comm, inner="eager"), q, k, v, cu)
    return graphs, (8, 1, heads[0], heads[1], 8, 8, dtype)


def _expected(comm, dims, lse=False):
    tokens, batch, hq, hkv, d, dv, dtype = dims
    acc = torch.promote_types(dtype, torch.float32)
    return get_comm(comm).wire_bytes(
        WireShape(tokens, batch, hq, hkv, d, dv, WORLD, dtype.itemsize, acc.itemsize, lse)
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "layout, comm, heads",
    [("flat", "all_gather", (4, 2)), ("zigzag", "all_gather", (4, 4)), ("flat", "a2a", (8, 2)),
     ("zigzag", "a2a", (4, 4)), ("zigzag", "a2a", (8, 8)), ("flat", "ring", (4, 2)), ("zigzag", "ring", (4, 4))],
)  # fmt: skip
def test_dense_wire_bytes_are_the_collectives(layout, comm, heads, dtype):
    graphs, dims = _dense(layout, comm, heads, dtype)
    assert (_sent(graphs["fw"]), _sent(graphs["bw"])) == _expected(comm, dims)


@pytest.mark.parametrize(
    "layout, comm, heads, lse",
    [("thd", "all_gather", (4, 2), False), ("thd_zigzag", "all_gather", (4, 4), True),
     ("thd", "a2a", (4, 2), False), ("thd", "a2a", (8, 8), True), ("thd", "ring", (4, 2), False),
     ("thd_zigzag", "ring", (4, 4), True), ("thd", "selective", (4, 2), True)],
)  # fmt: skip
def test_packed_wire_bytes_are_the_collectives(layout, comm, heads, lse):
    graphs, dims = _packed(layout, comm, heads, torch.float32, lse)
    assert (_sent(graphs["fw"]), _sent(graphs["bw"])) == _expected(comm, dims, lse=lse)


@pytest.mark.parametrize("max_len", [6, 32])
def test_selective_wire_bytes_are_the_collectives(max_len):
    """comm="selective" sends its static slots, C = min(T/cp, max_q) tokens a peer (6 or all 8 here)."""
    from cpcompile.layouts.thd_balanced import make_plan

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, h, 8, generator=g, requires_grad=True) for h in (4, 2, 2))
    plan = make_plan(torch.tensor([0, 5, 11, 17, 23, 28, 32], dtype=torch.int32), WORLD)

    def fn(q, k, v, cu):
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=(-1, 0), **GQA)

    with fake_group(RANK, WORLD):
        be = cpcompile.backend(strategy="thd_balanced", comm="selective", inner="eager")
        graphs = capture_graphs(fn, be, q, k, v, plan)
    expected = get_comm("selective").wire_bytes(WireShape(8, 1, 4, 2, 8, 8, WORLD, 4, 4, max_doc=max_len))
    assert (_sent(graphs["fw"]), _sent(graphs["bw"])) == expected
    assert expected[0] == (WORLD - 1) * min(8, max_len) * 2 * 16 * 4


@pytest.mark.parametrize(
    "layout, window, steps", [("flat", (3, 0), 2), ("zigzag", (3, 0), 3), ("zigzag", (20, 0), 4), ("flat", (40, 0), 4)]
)
def test_windowed_ring_wire_bytes_are_the_collectives(layout, window, steps):
    """Under a window the ring visits only the steps some rank's window reaches (comms/ring/schedule.visited_steps):
    fewer K/V shifts and gradient shifts, as the cost model now says (it counted every step before)."""
    from cpcompile.comms.ring.schedule import visited_steps
    from cpcompile.layouts import get_layout

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g, requires_grad=True) for _ in range(3))

    def fn(q, k, v):
        return cpcompile.attention(q, k, v, is_causal=True, window=window)

    with fake_group(RANK, WORLD):
        graphs = capture_graphs(fn, cpcompile.backend(strategy=layout, comm="ring", inner="eager"), q, k, v)
    lay = get_layout(layout)
    visited = len(visited_steps(lay, WORLD, 16 // lay.chunks_per_rank, True, window))
    expected = get_comm("ring").wire_bytes(WireShape(16, 2, 4, 4, 8, 8, WORLD, 4, 4, dense_mask=(layout, True, window)))
    assert (_sent(graphs["fw"]), _sent(graphs["bw"])) == expected
    assert visited == steps  # 2 and 3 of 4: the window saves shifts; 4: it reaches every step


@pytest.mark.parametrize("layout, window, steps", [("thd", (3, 0), 2), ("thd", (9, 0), 3)])
def test_windowed_packed_ring_wire_bytes_are_the_collectives(layout, window, steps):
    """Packed documents under a causal sliding window: thd's ring visits the steps the window reaches (a window
    shorter than a rank's 8 tokens: the neighbour's; comms/ring/schedule.packed_visited_steps); the cost model's bytes
    are the collectives the region launches."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, 4, 8, generator=g, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 8, 24, 32], dtype=torch.int32)

    def fn(q, k, v, cu):
        return varlen_attn(q, k, v, cu, cu, 32, 32, window_size=window)

    with fake_group(RANK, WORLD):
        graphs = capture_graphs(fn, cpcompile.backend(strategy=layout, comm="ring", inner="eager"), q, k, v, cu)
    shape = WireShape(8, 1, 4, 4, 8, 8, WORLD, 4, 4, max_doc=32, packed_mask=(layout, True, (window[0], -1)))
    expected = get_comm("ring").wire_bytes(shape)
    assert (_sent(graphs["fw"]), _sent(graphs["bw"])) == expected
    kv = 8 * 4 * 16 * 4  # one rank's K and V, fp32
    assert expected[0] == (steps - 1) * kv, "the window saves K/V shifts"

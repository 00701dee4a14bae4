"""bench.thd_region's compiled all_gather region computes what the rank's attention is: its output and gradients
match the same region run eagerly (bit for bit) and a dense per-document causal attention over the gathered K/V
(its dK/dV: the rank's rows of that attention's gradient, as the reduce-scatter stand-in returns them). CPU
tensors, the CPU reference provider, Inductor on CPU."""

from __future__ import annotations

import pytest
import torch

from bench import thd_cases, thd_region
from bench.common import HKV, HQ
from cpcompile.layouts import get_packed_layout

KERNEL = "cpu_varlen_ref"
LENGTHS, CP, RANK = [96, 160, 48, 208], 2, 1


def dense_reference(case: thd_region.RankCase, total: int) -> tuple[torch.Tensor, ...]:
    """(out, dq, dk, dv) in float64: the rank's q rows against every gathered key of the same document up to the row's
    global position, dK/dV the rows of the gathered buffer that the rank sent."""
    lay = get_packed_layout(case.layout)
    offsets = lay.offsets(case.cu, case.cp).long()
    rows = lay.shard_index(case.cu, total, case.cp, case.rank)
    keys = torch.cat([lay.shard_index(case.cu, total, case.cp, r) for r in range(case.cp)])  # rank-major
    doc_of = lambda p: torch.searchsorted(offsets, p, right=True)  # noqa: E731
    allowed = (doc_of(rows)[:, None] == doc_of(keys)[None]) & (keys[None] <= rows[:, None])
    q = case.q.detach().double().requires_grad_()
    kv = case.gathered.double().requires_grad_()
    k, v = (kv[:, i].repeat_interleave(HQ // HKV, 1) for i in (0, 1))
    scores = torch.einsum("qhd,khd->hqk", q, k) * thd_cases.SCALE
    out = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)
    out.backward(case.dout.double())
    local = total // case.cp
    mine = kv.grad[case.rank * local : (case.rank + 1) * local]
    return out.detach(), q.grad, mine[:, 0], mine[:, 1]


@pytest.fixture
def on_cpu(monkeypatch):
    """The bench's rank inputs on the CPU (the CPU reference provider runs there)."""
    monkeypatch.setattr(thd_cases, "DEVICE", "cpu")


@pytest.mark.parametrize("layout", ["thd", "thd_balanced"])  # thd: a key window slice; balanced: key buffer, fold
def test_compiled_region_is_the_rank_attention(on_cpu, monkeypatch, layout):
    for module in (thd_cases, thd_region):  # float64: the dense reference to float64's tolerances
        monkeypatch.setattr(module, "DTYPE", torch.float64)
    case = thd_region.rank_case(layout, LENGTHS, CP, RANK)
    run = thd_region.compiled_region_fn(case, KERNEL)
    compiled = run()
    eager = thd_region.compiled_region_fn(case, KERNEL, compiled=False)()
    for name, got, same, want in zip(("out", "dq", "dk", "dv"), compiled, eager, dense_reference(case, sum(LENGTHS))):
        assert got.dtype == torch.float64 and got.shape == want.shape, name
        assert torch.equal(got, same), f"{name}: compiled != eager"
        torch.testing.assert_close(got, want, msg=f"{name}: not the dense attention's")
    again = run()  # a timed call again: the same results (no gradient left over from the call before)
    assert all(torch.equal(a, b) for a, b in zip(again, compiled))


def test_compiled_region_in_the_bench_dtype(on_cpu):
    """bf16, as the bench runs it: Inductor's casts and fold give the eager region's bits (thd_zigzag's key
    buffer and fold of a key held twice). A second case of the same shapes reuses the compiled region (the same
    guards): it must read that case's tensors, the gathered K/V the stand-in returns included."""
    for _ in range(2):
        case = thd_region.rank_case("thd_zigzag", LENGTHS, CP, RANK)
        compiled = thd_region.compiled_region_fn(case, KERNEL)()
        eager = thd_region.compiled_region_fn(case, KERNEL, compiled=False)()
        assert compiled[0].dtype == torch.bfloat16
        for name, got, same in zip(("out", "dq", "dk", "dv"), compiled, eager):
            assert torch.equal(got, same), f"{name}: compiled != eager"

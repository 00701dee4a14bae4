"""comm="auto" on 4 gloo ranks: every rank makes the same choice (rank agreement would stop it otherwise), the
choice is one the site's rules allow, and the result matches single-process attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import cpcompile
from cpcompile.testing.distributed import run_ranks
from tests.support.parity import _assert_reports, bf16_rule, max_err, reference, sdpa_case
from tests.support.thd_parity import compare_packed

WORLD = 4


def _dense(strategy: str, shape) -> tuple[dict, str]:
    """(per-tensor (error, allowed), the comm auto chose) of causal SDPA with comm="auto", fp32."""
    q, k, v, dout = sdpa_case(0, *shape)
    exact = reference(q, k, v, dout, True, torch.float64)
    shard = lambda t: cpcompile.shard(t, strategy=strategy, seq_dim=2)  # noqa: E731
    leaves = [shard(t).float().detach().requires_grad_() for t in (q, k, v)]
    be = cpcompile.backend(strategy=strategy, comm="auto", inner="aot_eager")
    torch._dynamo.reset()
    fn = torch.compile(
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True),
        backend=be,
        fullgraph=True,
    )
    out = fn(*leaves)
    out.backward(shard(dout).float())
    got = [out.detach()] + [t.grad for t in leaves]
    report = {
        n: (max_err(g, shard(e)), bf16_rule(0, 0, torch.float32))
        for n, g, e in zip(("out", "dq", "dk", "dv"), got, exact)
    }
    return report, be.plans[0].comm


def _sweep(rank, world):
    results, chosen = {}, {}
    for strategy in ("flat", "zigzag"):
        for name, shape in {"split": (1, 4, 2, 64, 8), "no_split": (1, 3, 1, 64, 8)}.items():
            results[(strategy, name)], chosen[(strategy, name)] = _dense(strategy, shape)
    for strategy, window in (("thd", None), ("thd", (8, 4)), ("thd_zigzag", None)):
        be = cpcompile.backend(strategy=strategy, comm="auto", inner="aot_eager")
        lengths = [16, 40, 8, 32] if strategy == "thd_zigzag" else [5, 50, 1, 40]
        results[(strategy, window)] = compare_packed(strategy, True, torch.float32, lengths, backend=be, window=window)
        chosen[(strategy, window)] = be.plans[0].comm
    return results, chosen


def test_auto_comm_parity_and_agreement():
    per_rank = run_ranks(_sweep, WORLD, timeout=600)
    _assert_reports([results for results, _ in per_rank])
    choices = [chosen for _, chosen in per_rank]
    assert all(c == choices[0] for c in choices), choices
    c = choices[0]
    assert c[("flat", "no_split")] == c[("zigzag", "no_split")] == "all_gather"  # 3 q heads do not split over 4
    assert c[("thd", (8, 4))] == "a2a"  # a two-sided window: only a2a takes it
    assert c[("thd_zigzag", None)] == "all_gather"  # a2a refuses thd_zigzag

"""comm="auto" on 2 gloo ranks gives the same result as the comm it chose, named: the same plan on every rank
(rank agreement would stop it otherwise), a choice the site's rules allow, bit-identical outputs and grads to the
named comm's, and both within the parity rule of single-process attention."""

from __future__ import annotations

import torch

import cpcompile
from cpcompile.testing.distributed import run_ranks
from tests.support.parity import _assert_reports, bf16_rule, cp_attention, max_err, reference, sdpa_case
from tests.support.thd_parity import cp_varlen, cu_of, doc_reference, packed_case

WORLD = 2


def _auto_then_named(strategy: str, run, exact: list, shard) -> tuple[dict, str, bool]:
    """Run `run(backend)` with comm="auto", then with the comm (and kernel) it chose named: (per-tensor (error, allowed) of
    auto against float64, the comm chosen, whether the two runs agree bit for bit)."""
    auto = cpcompile.backend(strategy=strategy, comm="auto", inner="aot_eager")
    got = run(auto)
    chosen, kernel = auto.plans[0].comm, auto.plans[0].kernel
    named = run(cpcompile.backend(strategy=strategy, comm=chosen, kernel=kernel, inner="aot_eager"))
    report = {
        n: (max_err(g, shard(e)), bf16_rule(0, 0, torch.float32))
        for n, g, e in zip(("out", "dq", "dk", "dv"), got, exact)
    }
    return report, chosen, all(torch.equal(a, b) for a, b in zip(got, named))


def _dense(strategy: str, shape) -> tuple[dict, str, bool]:
    q, k, v, dout = sdpa_case(0, *shape)
    exact = reference(q, k, v, dout, True, torch.float64)

    def run(be):
        return cp_attention(q, k, v, dout, strategy=strategy, causal=True, dtype=torch.float32, backend=be)

    return _auto_then_named(strategy, run, exact, lambda t: cpcompile.shard(t, strategy=strategy, seq_dim=2))


def _packed(strategy: str, lengths: list[int], window) -> tuple[dict, str, bool]:
    cu = cu_of(lengths)
    q, k, v, dout = packed_case(0, int(cu[-1]), 4, 2, 8)
    exact = doc_reference(q, k, v, dout, cu, True, torch.float64, window)

    def run(be):
        return cp_varlen(
            q, k, v, dout, cu, strategy=strategy, causal=True, dtype=torch.float32, backend=be, window=window
        )

    shard = lambda t: cpcompile.shard(t, strategy=strategy, seq_dim=0, cu_seqlens=cu)  # noqa: E731
    return _auto_then_named(strategy, run, exact, shard)


def _sweep(rank, world):
    cases = {
        ("zigzag", "split"): lambda: _dense("zigzag", (1, 4, 2, 64, 8)),
        ("flat", "no_split"): lambda: _dense("flat", (1, 3, 1, 64, 8)),  # 3 q heads do not split over 2
        ("thd", "window"): lambda: _packed("thd", [5, 50, 1, 40], (8, 4)),  # two-sided: only a2a takes it
        ("thd_zigzag", "causal"): lambda: _packed("thd_zigzag", [16, 40, 8, 32], None),  # a2a refuses thd_zigzag
    }
    results, chosen, same = {}, {}, {}
    for case, run in cases.items():
        results[case], chosen[case], same[case] = run()
    return results, chosen, same


def test_auto_comm_is_the_named_comm_it_chose():
    per_rank = run_ranks(_sweep, WORLD, timeout=600)
    _assert_reports([results for results, _, _ in per_rank])
    choices = [chosen for _, chosen, _ in per_rank]
    assert all(c == choices[0] for c in choices), choices
    for _, _, same in per_rank:
        assert all(same.values()), same
    c = choices[0]
    assert c[("flat", "no_split")] == "all_gather" and c[("thd", "window")] == "a2a", c
    assert c[("thd_zigzag", "causal")] == "all_gather", c
    assert c[("zigzag", "split")] in ("all_gather", "a2a"), c

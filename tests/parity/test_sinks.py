"""Attention sinks (cpcompile.attention(..., sinks=), GPT-OSS's s_aux) under CP, forward and backward, against the
same op on one process: flat and zigzag x all_gather, a2a and ring, causal and not, with a window and a softcap.

One spawn of 2 ranks (fp64, eager inner compiler: the op-level path; tests/parity/test_hf_zoo.py runs GPT-OSS through
HF). Every rank returns its errors on out and q/k/v gradients and its share of the sinks' gradient; the shares
summed over ranks must be the single-process gradient (each rank's rows give their part, as for every parameter).
"""

from __future__ import annotations

import torch

import cpcompile
from cpcompile.testing.distributed import run_ranks

SEQ, HQ, HKV, D = 24, 4, 2, 8
CASES = [
    # (strategy, comm, causal, window, softcap)
    ("zigzag", "all_gather", True, None, 0.0),
    ("flat", "all_gather", False, None, 0.0),
    ("zigzag", "a2a", True, None, 0.0),
    ("flat", "a2a", False, (4, 4), 0.0),
    ("zigzag", "ring", True, None, 0.0),
    ("flat", "ring", False, None, 0.0),
    ("zigzag", "all_gather", True, (5, 0), 0.0),  # GPT-OSS: alternating windows, sinks on every layer
    ("zigzag", "all_gather", True, None, 20.0),  # softcapped scores: the sink is not capped
]


def _inputs():
    g = torch.Generator().manual_seed(0)
    shapes = ((1, HQ, SEQ, D), (1, HKV, SEQ, D), (1, HKV, SEQ, D), (1, HQ, SEQ, D))
    q, k, v, dout = (torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)
    return q, k, v, dout, torch.randn(HQ, generator=g, dtype=torch.float64)


def _attn(causal, window, softcap):
    def attn(q, k, v, sinks):
        w = window or (-1, -1)
        return cpcompile.attention(q, k, v, is_causal=causal, window=w, softcap=softcap, sinks=sinks)

    return attn


def _rank_result(strategy, comm, causal, window, softcap):
    q, k, v, dout, sinks = _inputs()
    attn = _attn(causal, window, softcap)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref = attn(*leaves)
    ref.backward(dout)
    shard = lambda t: cpcompile.shard(t, strategy=strategy, seq_dim=2)  # noqa: E731
    local = [shard(t).requires_grad_() for t in (q, k, v)] + [sinks.clone().requires_grad_()]
    be = cpcompile.backend(strategy=strategy, comm=comm, inner="eager")
    torch._dynamo.reset()
    out = torch.compile(attn, backend=be, fullgraph=True)(*local)
    out.backward(shard(dout))
    (plan,) = be.plans
    assert plan.sinks and plan.comm == comm, plan
    errs = [(out - shard(ref)).abs().max().item()]
    errs += [(t.grad - shard(r.grad)).abs().max().item() for t, r in zip(local[:3], leaves[:3])]
    return errs, local[3].grad, leaves[3].grad


def _run_all(rank, world):
    return {case: _rank_result(*case) for case in CASES}


def test_sinks_parity_2_ranks():
    results = run_ranks(_run_all, 2, timeout=600)
    bad = {}
    for case in CASES:
        errs = [e for found in results for e in found[case][0]]
        summed = sum(found[case][1] for found in results)
        sink_err = (summed - results[0][case][2]).abs().max().item()
        if max(errs) > 1e-10 or sink_err > 1e-10:
            bad[case] = (max(errs), sink_err)
    assert not bad, bad


def test_sinks_op_matches_gpt_oss_formula():
    """The op's own (eager) semantics: GPT-OSS's eager attention (scores and a sink column through one softmax,
    the sink column dropped), i.e. out * sigmoid(lse - sink)."""
    q, k, v, _, sinks = _inputs()
    out = cpcompile.attention(q, k, v, is_causal=True, sinks=sinks)
    kk, vv = (t.repeat_interleave(HQ // HKV, 1) for t in (k, v))
    scores = (q @ kk.transpose(-1, -2)) / D**0.5
    scores = scores.masked_fill(~torch.ones(SEQ, SEQ, dtype=torch.bool).tril(), float("-inf"))
    combined = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(1, HQ, SEQ, 1)], dim=-1)
    ref = torch.softmax(combined, dim=-1)[..., :-1] @ vv
    torch.testing.assert_close(out, ref)
    lse = torch.logsumexp(scores, -1, keepdim=True)
    plain = torch.softmax(scores, -1) @ vv
    torch.testing.assert_close(out, plain * torch.sigmoid(lse - sinks.view(1, -1, 1, 1)))

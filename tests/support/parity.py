"""Shared parity machinery for the multi-rank tests: references, tolerances, per-rank comparisons."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import cpcompile

FLOORS = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-3}


def bf16_rule(cp_err: float, ref_err: float, dtype: torch.dtype, roundings: int = 1) -> float:
    """Allowed error: fp64/fp32 tight; low precision (1 + sqrt(roundings)) x the single-device error + floor.

    One device rounds an element to the low precision once. CP rounds it `roundings` times where a kernel
    returns partial results already rounded (tests/support/roundings.py counts them; 1 = the plain 2x rule), and
    independent rounding errors add like a random walk, so the allowance grows with the square root."""
    if dtype in (torch.float64, torch.float32):
        return FLOORS[dtype] * 50 if dtype == torch.float32 else FLOORS[dtype]
    return (1 + roundings**0.5) * ref_err + FLOORS[dtype]


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b| relative to the largest |b| (floored at 1e-6), in fp64."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-6)).item()


def sdpa_case(seed: int, b: int, hq: int, hkv: int, s: int, d: int):
    """Full-sequence q, k, v and an output gradient, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, s, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64)
    dout = torch.randn(b, hq, s, d, generator=g, dtype=torch.float64)
    return q, k, v, dout


def reference(q, k, v, dout, causal: bool, dtype: torch.dtype, scale=None):
    """(out, dq, dk, dv) of single-process SDPA over the full sequence, computed in `dtype`."""
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True, scale=scale)
    out.backward(dout.to(dtype))
    return [out.detach()] + [t.grad for t in leaves]


def cp_attention(
    q, k, v, dout, *, strategy, causal, dtype, inner="aot_eager", scale=None, comm="all_gather", backend=None
):
    """(out, dq, dk, dv) of the compiled CP region on this rank's shards, in local layout (`backend`: a
    cpcompile backend to use instead of one made from strategy/comm/inner)."""
    shard = lambda t: cpcompile.shard(t.to(dtype), strategy=strategy, seq_dim=2)  # noqa: E731
    leaves = [shard(t).detach().requires_grad_() for t in (q, k, v)]
    be = backend or cpcompile.backend(strategy=strategy, comm=comm, inner=inner)

    def attn(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, is_causal=causal, enable_gqa=True, scale=scale)

    torch._dynamo.reset()
    out = torch.compile(attn, backend=be, fullgraph=True)(*leaves)
    out.backward(shard(dout))
    assert len(be.plans) == 1, f"expected 1 rewritten attention node, got {len(be.plans)}"
    return [out.detach()] + [t.grad for t in leaves]


def compare_sdpa(
    strategy: str, causal: bool, dtype: torch.dtype, shape, inner="aot_eager", scale=None, comm="all_gather"
) -> dict:
    """Per-tensor (cp error, allowed error) of one CP SDPA configuration on this rank."""
    q, k, v, dout = sdpa_case(0, *shape)
    exact = reference(q, k, v, dout, causal, torch.float64, scale)
    low = reference(q, k, v, dout, causal, dtype, scale) if dtype == torch.bfloat16 else exact
    got = cp_attention(
        q, k, v, dout, strategy=strategy, causal=causal, dtype=dtype, inner=inner, scale=scale, comm=comm
    )
    shard = lambda t: cpcompile.shard(t, strategy=strategy, seq_dim=2)  # noqa: E731
    report = {}
    for name, g, e, lo in zip(("out", "dq", "dk", "dv"), got, exact, low):
        err = max_err(g, shard(e))
        allowed = bf16_rule(err, max_err(shard(lo), shard(e)), dtype)
        report[name] = (err, allowed)
    return report


def _assert_reports(per_rank):
    failures = []
    for rank, results in enumerate(per_rank):
        for case, report in results.items():
            for tensor, (err, allowed) in report.items():
                if not err <= allowed:
                    failures.append(f"rank {rank} {case} {tensor}: error {err:.3g} > allowed {allowed:.3g}")
    assert not failures, "\n".join(failures)

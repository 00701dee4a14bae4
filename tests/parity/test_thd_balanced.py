"""thd_balanced (equal tokens and work a rank, the plan per batch in cu_seqlens): parity fwd+bwd with
per-document SDPA at cp 2, 3, 4, one spawn per cp.

Each configuration (all_gather causal, full and sliding causal; a2a causal) is compiled ONCE and fed several
batches of different documents (1-token documents, a document longer than T/cp, T - 3 tiny documents, an
empty padding document) under error_on_recompile: the plan changes every batch, the shapes never do, so a
recompile fails the test. Outputs and q/k/v grads of every batch against the fp64 reference; and
unshard(shard(x)) == x with its backward.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.varlen import varlen_attn

import cpcompile
from cpcompile.testing.distributed import run_ranks
from cpcompile.testing.varlen_model import GQA
from tests.support.parity import FLOORS, _assert_reports, max_err
from tests.support.thd_parity import cu_of, doc_reference, packed_case

STRATEGY = "thd_balanced"
LOCAL = 8
"""Tokens a rank: T = 8 * cp."""


def _batches(world: int) -> dict[str, list[int]]:
    """Document mixes of T = 8 * cp tokens (the only divisibility rule: T is a multiple of cp)."""
    total = world * LOCAL

    def fill(lengths: list[int]) -> list[int]:
        return lengths + [total - sum(lengths)]

    return {
        "long doc": fill([1, 1, LOCAL + 3, 1]),  # longer than T/cp: pieces on several ranks
        "tiny docs": [1] * (total - 3) + [3],
        "uneven": fill([5, 1, 0, 4, 2]),  # an empty document (padding inside cu_seqlens)
        "one doc": [total],
    }


def _attn(window: tuple[int, int]):
    def fn(q, k, v, cu):
        return varlen_attn(q, k, v, cu, cu, 64, 64, window_size=window, **GQA)

    return fn


def _run(world: int, window: tuple[int, int], heads: tuple[int, int], comm: str, names: tuple[str, ...]) -> dict:
    """One compiled varlen_attn fed the batches `names` (cu_seqlens padded to one length): per batch, per tensor
    (error, allowed)."""
    be = cpcompile.backend(strategy=STRATEGY, comm=comm, inner="aot_eager")
    torch._dynamo.reset()  # each configuration compiles once; only the batches must not recompile
    fn = torch.compile(_attn(window), backend=be, fullgraph=True)
    causal, ref_window = window[1] == 0, (None if window in ((-1, 0), (-1, -1)) else window)
    results = {}
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i, name in enumerate(names):
            lengths = _batches(world)[name]
            cu = cpcompile.pad_cu_seqlens(cu_of(lengths), sum(lengths), world * LOCAL + 1)
            q, k, v, dout = packed_case(i, sum(lengths), *heads, 8)
            keys = ("q", "k", "v", "dout")
            batch = cpcompile.shard_batch(
                dict(zip(keys, (q, k, v, dout))), strategy=STRATEGY, seq_dim=0, seq_keys=keys, cu_seqlens=cu
            )
            plan = batch["cu_seqlens"]  # the offsets and this batch's plan: what the model takes
            leaves = [batch[n].detach().requires_grad_() for n in keys[:3]]
            out = fn(*leaves, plan)
            out.backward(batch["dout"])
            exact = doc_reference(q, k, v, dout, cu, causal, torch.float64, ref_window)
            report = {}
            for tensor, got, ref in zip(("out", "dq", "dk", "dv"), [out.detach()] + [t.grad for t in leaves], exact):
                local_ref = cpcompile.shard(ref, strategy=STRATEGY, seq_dim=0, cu_seqlens=plan)
                report[tensor] = (max_err(got, local_ref), FLOORS[torch.float64])
            results[(comm, window, name)] = report
    return results


def _round_trip(world: int) -> dict:
    """unshard(shard(x)) == x for every mix, given plain offsets or the plan (2-D, seq_dim=1), and its backward
    hands each rank its own tokens' gradient."""
    report = {}
    for name, lengths in _batches(world).items():
        cu = cu_of(lengths)
        plan = cpcompile.plan_documents(cu, strategy=STRATEGY)
        x = torch.arange(2 * sum(lengths), dtype=torch.float64).view(2, -1)
        for given, meta in (("offsets", cu), ("plan", plan)):
            local = cpcompile.shard(x, strategy=STRATEGY, seq_dim=1, cu_seqlens=meta).requires_grad_()
            back = cpcompile.unshard(local, strategy=STRATEGY, seq_dim=1, cu_seqlens=meta)
            (back * x).sum().backward()
            err = max(max_err(back, x), max_err(local.grad, local))  # d(sum(back * x))/d local = x's shard
            report[f"{name} {given}"] = err
    return {("round trip",): {case: (err, 0.0) for case, err in report.items()}}


def _sweep(rank, world):
    del rank
    every = tuple(_batches(world))
    results = _round_trip(world)
    results |= _run(world, (-1, 0), (4, 2), "all_gather", every)
    results |= _run(world, (-1, -1), (4, 2), "all_gather", every)
    results |= _run(world, (3, 0), (4, 2), "all_gather", ("long doc", "uneven"))
    results |= _run(world, (-1, 0), (world, world), "a2a", ("long doc", "tiny docs"))  # a2a splits heads over cp
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
def test_thd_balanced_parity(world):
    _assert_reports(run_ranks(_sweep, world, timeout=600))

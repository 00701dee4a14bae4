"""comm="selective" (thd_balanced, each rank receives only the K/V its documents read): parity fwd+bwd with
per-document SDPA at cp 2, 3 and 4, in one pool of 4 ranks (cp < 4 runs on a subgroup of the first cp ranks).

Each configuration is compiled ONCE and fed several batches of different documents under error_on_recompile, and
the backend is called exactly once (a compile counter): the plan and the exchange's slots change every batch,
the shapes never do. max_q = 6 < T/cp = 8 makes the slots smaller than a rank's tokens (C = 6); max_q = 64 gives
C = T/cp with documents longer than a rank. Output and q/k/v gradients of every batch against one process
(fp64 reference), fp64 and fp32. A batch whose plan needs more than C tokens from one peer fails on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.attention.varlen import varlen_attn

import cpcompile
from cpcompile.layouts.thd_balanced import TAG
from cpcompile.testing.distributed import RankPool
from cpcompile.testing.varlen_model import GQA
from tests.support.parity import FLOORS, _assert_reports, bf16_rule, max_err
from tests.support.thd_parity import cu_of, doc_reference, packed_case

STRATEGY = "thd_balanced"
LOCAL = 8
"""Tokens a rank: T = 8 * cp."""


def _batches(world: int, short: bool) -> list[list[int]]:
    """New documents every batch, T = 8 * cp tokens; `short`: every document <= 6 (max_q = 6)."""
    total = world * LOCAL

    def fill(lengths: list[int], most: int) -> list[int]:
        out, left = [], total
        for n in lengths * total:
            if not left:
                break
            out.append(min(n, left, most))
            left -= out[-1]
        return out

    if short:
        return [fill([5, 1, 6, 3, 2], 6), fill([1], 6), fill([6, 0, 4, 6, 1, 2], 6)]
    return [fill([1, 1, LOCAL + 3, 1], total), [total], fill([3, 2 * LOCAL, 5], total)]


def _attn(window: tuple[int, int], max_len: int):
    def fn(q, k, v, cu):
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=window, **GQA)

    return fn


def _run(group, world, window, dtype, short) -> dict:
    """One compiled varlen_attn fed every batch of `_batches` (cu_seqlens padded to one length): per batch, per
    tensor (error, allowed); and the number of backend calls."""
    be = cpcompile.backend(strategy=STRATEGY, comm="selective", group=group, inner="aot_eager")
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(1)
        return be(gm, example_inputs)

    torch._dynamo.reset()
    fn = torch.compile(_attn(window, 6 if short else 64), backend=counting, fullgraph=True)
    causal, ref_window = window[1] == 0, (None if window in ((-1, 0), (-1, -1)) else window)
    allowed = FLOORS[dtype] if dtype == torch.float64 else bf16_rule(0.0, 0.0, dtype)
    results = {}
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i, lengths in enumerate(_batches(world, short)):
            cu = cpcompile.pad_cu_seqlens(cu_of(lengths), sum(lengths), world * LOCAL + 1)
            q, k, v, dout = packed_case(i, sum(lengths), 4, 2, 8)
            keys = ("q", "k", "v", "dout")
            batch = cpcompile.shard_batch(
                dict(zip(keys, (q, k, v, dout))), strategy=STRATEGY, group=group, seq_dim=0, seq_keys=keys,
                cu_seqlens=cu,
            )  # fmt: skip
            plan = batch["cu_seqlens"]
            leaves = [batch[n].detach().to(dtype).requires_grad_() for n in keys[:3]]
            out = fn(*leaves, plan)
            out.backward(batch["dout"].to(dtype))
            exact = doc_reference(q, k, v, dout, cu, causal, torch.float64, ref_window)
            report = {}
            for tensor, got, ref in zip(("out", "dq", "dk", "dv"), [out.detach()] + [t.grad for t in leaves], exact):
                local_ref = cpcompile.shard(ref, strategy=STRATEGY, group=group, seq_dim=0, cu_seqlens=plan)
                report[tensor] = (max_err(got, local_ref), allowed)
            results[(world, window, str(dtype), short, i)] = report
    results[(world, window, str(dtype), short, "compiles")] = {"backend calls - 1": (len(compiles) - 1.0, 0.0)}
    return results


def _too_small(group, world) -> dict:
    """A valid plan whose rank 1 needs 8 tokens from rank 0 (four 4-token documents, each cut in half) with
    max_q = 4 (C = 4): the region's check fails, on every rank, before the exchange."""
    cu = torch.tensor([0, 4, 8, 12, 16], dtype=torch.int32)
    slots = 6  # pieces_per_rank(5, 2)
    starts = [[0, 4, 8, 12] + [16, 16], [2, 6, 10, 14] + [16, 16]]
    lens = [[2, 2, 2, 2, 0, 0], [2, 2, 2, 2, 0, 0]]
    assert len(starts[0]) == slots
    plan = torch.tensor([*cu.tolist(), *sum(starts, []), *sum(lens, []), -(TAG + world)], dtype=torch.int32)
    q, k, v, _ = packed_case(0, 16, 4, 2, 8)
    local = [cpcompile.shard(t, strategy=STRATEGY, group=group, seq_dim=0, cu_seqlens=plan) for t in (q, k, v)]
    be = cpcompile.backend(strategy=STRATEGY, comm="selective", group=group, inner="aot_eager")
    torch._dynamo.reset()
    fn = torch.compile(_attn((-1, 0), 4), backend=be, fullgraph=True)
    try:
        fn(*local, plan)
    except RuntimeError as e:
        failed = "comm='selective'" in str(e) and "max_q" in str(e)
    else:
        failed = False
    return {("too small",): {"check did not fail": (0.0 if failed else 1.0, 0.0)}}


def _sweep(rank, world_all, world):
    group = dist.new_group(list(range(world)))
    if rank >= world:
        return {}
    results = {}
    results |= _run(group, world, (-1, 0), torch.float64, short=True)
    results |= _run(group, world, (-1, -1), torch.float64, short=True)
    results |= _run(group, world, (-1, 0), torch.float64, short=False)
    if world == 2:
        results |= _run(group, world, (3, 0), torch.float64, short=True)
        results |= _run(group, world, (-1, 0), torch.float32, short=True)
        results |= _too_small(group, world)
    return results


@pytest.fixture(scope="module")
def ranks4():
    pool = RankPool(4)
    yield pool
    pool.close()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_selective_parity(ranks4, world):
    _assert_reports(ranks4.run(_sweep, world, timeout=600))

"""comm="selective" (thd_balanced and thd, each rank receives only the K/V its documents read): parity fwd+bwd with
per-document SDPA at cp 2, 3 and 4, in one pool of 4 ranks (cp < 4 runs on a subgroup of the first cp ranks).

Each configuration is compiled ONCE and fed several batches of different documents under error_on_recompile, and
the backend is called exactly once (a compile counter): the plan and the exchange's slots change every batch,
the shapes never do. max_q = 6 < T/cp = 8 makes the slots smaller than a rank's tokens (C = 6); max_q = 64 gives
C = T/cp with documents longer than a rank. Output and q/k/v gradients of every batch against one process
(fp64 reference), fp64 and fp32; MLA head dims and the lse at cp 2. A batch whose plan needs more than C tokens from one peer fails on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.attention.varlen import AuxRequest, varlen_attn

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


def _run(group, world, window, dtype, short, strategy=STRATEGY) -> dict:
    """One compiled varlen_attn fed every batch of `_batches` (cu_seqlens padded to one length): per batch, per
    tensor (error, allowed); and the number of backend calls."""
    be = cpcompile.backend(strategy=strategy, comm="selective", group=group, inner="aot_eager")
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
                dict(zip(keys, (q, k, v, dout))), strategy=strategy, group=group, seq_dim=0, seq_keys=keys,
                cu_seqlens=cu,
            )  # fmt: skip
            plan = batch.get("cu_seqlens", cu)  # thd_balanced: the plan; thd: the offsets as given
            leaves = [batch[n].detach().to(dtype).requires_grad_() for n in keys[:3]]
            out = fn(*leaves, plan)
            out.backward(batch["dout"].to(dtype))
            exact = doc_reference(q, k, v, dout, cu, causal, torch.float64, ref_window)
            report = {}
            for tensor, got, ref in zip(("out", "dq", "dk", "dv"), [out.detach()] + [t.grad for t in leaves], exact):
                local_ref = cpcompile.shard(ref, strategy=strategy, group=group, seq_dim=0, cu_seqlens=plan)
                report[tensor] = (max_err(got, local_ref), allowed)
            results[(strategy, world, window, str(dtype), short, i)] = report
    results[(strategy, world, window, str(dtype), short, "compiles")] = {
        "backend calls - 1": (len(compiles) - 1.0, 0.0)
    }
    return results


def _doc_lse(q, k, cu, causal) -> torch.Tensor:
    """(Hq, T) fp64 logsumexp of each token's scores over its document's keys (GQA: q head h reads kv head h // g)."""
    g = q.shape[1] // k.shape[1]
    scores = torch.einsum("thd,shd->hts", q, k.repeat_interleave(g, 1)) / q.shape[-1] ** 0.5
    pos = torch.arange(q.shape[0])
    doc = torch.searchsorted(cu.long(), pos, right=True)
    keep = doc[:, None] == doc[None, :]
    if causal:
        keep &= pos[None, :] <= pos[:, None]
    return scores.masked_fill(~keep, float("-inf")).logsumexp(-1)


def _mla_and_lse(group, world) -> dict:
    """v's head dim differs from q/k's (MLA: K and V side by side in the slots), and the graph reads the lse."""
    lengths = [5, 1, 6, 3, 1]
    cu = cu_of(lengths)
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(16, h, 8, generator=g, dtype=torch.float64) for h in (4, 2))
    v, dout = (torch.randn(16, h, 4, generator=g, dtype=torch.float64) for h in (2, 4))
    be = cpcompile.backend(strategy=STRATEGY, comm="selective", group=group, inner="aot_eager")

    def fn(q, k, v, cu):
        out, lse = varlen_attn(q, k, v, cu, cu, 6, 6, window_size=(-1, 0), return_aux=AuxRequest(lse=True), **GQA)
        return out, lse

    torch._dynamo.reset()
    plan = cpcompile.plan_documents(cu, strategy=STRATEGY, group=group)
    shard = lambda t: cpcompile.shard(t, strategy=STRATEGY, group=group, seq_dim=0, cu_seqlens=plan)  # noqa: E731
    leaves = [shard(t).requires_grad_() for t in (q, k, v)]
    out, lse = torch.compile(fn, backend=be, fullgraph=True)(*leaves, plan)
    out.backward(shard(dout))
    exact = doc_reference(q, k, v, dout, cu, True, torch.float64)
    report = {n: (max_err(got, shard(ref)), FLOORS[torch.float64]) for n, got, ref in zip(
        ("out", "dq", "dk", "dv"), [out.detach()] + [t.grad for t in leaves], exact)}  # fmt: skip
    ref_lse = shard(_doc_lse(q, k, cu, True).T).T
    eps = torch.finfo(torch.float32).eps  # varlen_attn's lse is fp32 whatever the inputs
    report["lse"] = (max_err(lse, ref_lse), 4 * eps * ref_lse.abs().max().item())
    return {("mla and lse",): report}


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
    results |= _run(group, world, (-1, 0), torch.float64, short=True, strategy="thd")
    results |= _run(group, world, (-1, -1), torch.float64, short=False, strategy="thd")
    results |= _run(group, world, (-1, -1), torch.float64, short=True, strategy="thd")  # the key slice both ways
    if world == 2:
        results |= _run(group, world, (3, 0), torch.float64, short=True)
        # thd's key slice under a window narrower than max_doc: held tokens before it fold to nothing
        results |= _run(group, world, (3, 0), torch.float64, short=False, strategy="thd")
        results |= _run(group, world, (-1, 0), torch.float32, short=True)
        results |= _mla_and_lse(group, world)
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

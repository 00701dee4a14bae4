"""comm="ring" (with its deferred merge too, and the all-gather's regather option) against single-process attention at cp 2, 3 and 4: every
layout, GQA and MHA, causal and full, fp64 and bf16 (under the rounding-aware rule), packed documents under
causal sliding windows shorter than a rank's piece, between, and longer than every document, and a small transformer
trained over the ring with per-block activation checkpointing; thd under a tight max_q/max_k, causal and full (the ring
skips the steps out of reach). One spawn per cp: every case of a cp runs in it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cpcompile
from cpcompile.testing.distributed import run_ranks
from cpcompile.testing.training import train
from tests.support.parity import bf16_rule, cp_attention, max_err, reference, sdpa_case
from tests.support.roundings import dense_partials, roundings
from tests.support.thd_parity import MAX_DOC, compare_packed
from tests.support.training import CFG, _assert_matches, _batches

SHAPES = {"gqa": (2, 4, 2, 48, 8), "mha": (1, 2, 2, 48, 8)}
DOCS = {"thd": [5, 1, 20, 3, 7, 12, 24], "thd_zigzag": [24, 48]}  # totals divide by 2cp for cp 2, 3, 4


def _dense(strategy, causal, dtype, shape, comm, options) -> dict:
    """Per tensor (error, allowed) of one dense case; bf16 allows the roundings the comm's blocks make."""
    q, k, v, dout = sdpa_case(0, *shape)
    exact = reference(q, k, v, dout, causal, torch.float64)
    low = reference(q, k, v, dout, causal, dtype) if dtype == torch.bfloat16 else exact
    be = cpcompile.backend(strategy=strategy, comm=comm, inner="aot_eager", **options)
    got = cp_attention(q, k, v, dout, strategy=strategy, causal=causal, dtype=dtype, backend=be)
    cp = torch.distributed.get_world_size()
    partials = dense_partials(strategy, comm, cp, causal, shape[1], shape[2])
    shard = lambda t: cpcompile.shard(t, strategy=strategy, seq_dim=2)  # noqa: E731
    report = {}
    for name, g, e, lo in zip(("out", "dq", "dk", "dv"), got, exact, low):
        err = max_err(g, shard(e))
        report[name] = (err, bf16_rule(err, max_err(shard(lo), shard(e)), dtype, roundings(partials[name])))
    return report


def _cases(world: int) -> list[tuple]:
    """Every layout under the ring, causal and full, GQA and MHA, fp64 and bf16, regather of both regions, packed
    sliding windows, spread
    over cp 2, 3 and 4 so that each spawn compiles few cases (CI has 2 cores)."""
    if world == 2:  # + the checkpointed transformer trained over the ring
        return [
            ("dense", "ring", "flat", False, "gqa", "fp64"),
            ("dense", "ring", "zigzag", True, "mha", "bf16"),
            ("packed", "ring", "thd", False),
            ("packed", "ring", "thd", True, (40, 0)),  # longer than every document (but max_doc 64): band blocks
            ("packed", "ring", "thd_zigzag", True, (5, 0)),  # shorter than a chunk (6, 12)
            ("dense", "deferred", "zigzag", True, "gqa", "bf16"),
        ]
    if world == 3:
        return [
            ("dense", "ring", "zigzag", True, "gqa", "fp64"),
            ("packed", "ring", "thd_zigzag", True),
            ("dense", "regather", "flat", True, "gqa", "fp64"),
            ("packed", "regather", "thd_zigzag", True),
            # full, documents <= 24: rank 1 reads keys [1, 71), documents reaching both ends of that slice
            ("packed", "regather", "thd", False, None, 24, (1, 24, 22, 24, 1)),
            ("dense", "deferred", "zigzag", True, "gqa", "fp64"),  # cp 3: steps over the back chunk only
            ("packed", "deferred", "thd", True, None, 24),  # documents <= 24 = a piece: steps 0 and 1, home by 2
            ("packed", "ring", "thd", True, (30, 0)),  # between a rank's piece (24) and two: every step
            ("packed", "ring", "thd_zigzag", True, (13, 0)),  # longer than every chunk (4, 8), not a document
        ]
    return [
        ("dense", "ring", "flat", True, "gqa", "fp64"),
        ("dense", "ring", "zigzag", False, "gqa", "fp64"),
        ("packed", "ring", "thd", True),
        ("packed", "ring", "thd_zigzag", False),
        ("packed", "ring", "thd", True, (5, 0)),  # shorter than a rank's piece (18): steps 0 and 1, home by 3
        ("packed", "ring", "thd", True, None, 24),  # documents <= 24 (pieces of 18): steps 0..2, home by 2
        ("packed", "ring", "thd", False, None, 18, (5, 1, 18, 3, 7, 12, 18, 8)),  # full, docs <= 18: steps 0, 1, 3
        ("dense", "deferred", "flat", False, "mha", "fp64"),
        ("packed", "deferred", "thd_zigzag", True, (5, 0)),
    ]


def _run(case) -> dict:
    kind, comm, strategy, causal, *rest = case
    options = {"regather": True} if comm == "regather" else {"deferred_merge": True} if comm == "deferred" else {}
    comm = {"regather": "all_gather", "deferred": "ring"}.get(comm, comm)
    if kind == "dense":
        shape, dtype = rest
        dtype = torch.bfloat16 if dtype == "bf16" else torch.float64
        return _dense(strategy, causal, dtype, SHAPES[shape], comm, options)
    be = cpcompile.backend(strategy=strategy, comm=comm, inner="aot_eager", **options)
    window = rest[0] if rest else None  # a causal sliding window (w, 0): layouts/packed_band.py's blocks
    max_doc = rest[1] if len(rest) > 1 else MAX_DOC  # varlen_attn's max_q/max_k: thd's far steps skipped
    docs = list(rest[2]) if len(rest) > 2 else DOCS[strategy]
    return compare_packed(strategy, causal, torch.float64, docs, backend=be, window=window, max_doc=max_doc)


def _sweep(rank, world):
    results = {case: _run(case) for case in _cases(world)}
    cfg = dataclasses.replace(CFG, checkpoint="non_reentrant")
    training = train(cfg, _batches(), strategy="zigzag", comm="ring") if world == 2 else None
    return results, training


def _failures(per_rank) -> list[str]:
    failures = []
    for rank, (results, _) in enumerate(per_rank):
        for case, report in results.items():
            for tensor, (err, allowed) in report.items():
                if not err <= allowed:
                    failures.append(f"rank {rank} {case} {tensor}: error {err:.3g} > allowed {allowed:.3g}")
    return failures


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_and_regather_parity(world):
    per_rank = run_ranks(_sweep, world, timeout=600)
    assert not _failures(per_rank), "\n".join(_failures(per_rank))
    if per_rank[0][1] is not None:  # the checkpointed transformer trained over the ring matches one process
        _assert_matches([training for _, training in per_rank], "aot_eager")

"""Ranks that disagree get one clear error on every rank, within seconds, never a hang or garbage: plans are
compared through the store at compile time (passes/agree.py), packed metadata is checked at run time on
every rank (regions/guards.py). Also: the batch size is no CP dim, so it may change between calls."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn

import cpcompile
from cpcompile.testing.distributed import run_ranks
from cpcompile.testing.model import TinyConfig, TinyLlama
from tests.support.parity import max_err


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _dropout(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)


def _outcome(fn, *args, **backend_kwargs) -> str:
    """ "ok" or the error message of compiling and running `fn` under a fresh cpcompile backend."""
    torch._dynamo.reset()
    be = cpcompile.backend(inner="aot_eager", **backend_kwargs)
    try:
        torch.compile(fn, backend=be, fullgraph=True)(*args)
        return "ok"
    except Exception as e:  # Dynamo wraps backend errors: report the CPCompileError (or cpcompile assert) inside
        chain, err = [], e
        while err is not None:
            chain.append(err)
            err = err.__cause__ or err.__context__
        ours = [x for x in chain if isinstance(x, cpcompile.CPCompileError)]
        ours = ours or [x for x in chain if isinstance(x, RuntimeError) and "cpcompile:" in str(x)]
        err = (ours or chain)[0]
        return f"{type(err).__name__}: {err}"


def _qkv(s=8, b=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, 2, s, 4, generator=g, dtype=dtype) for _ in range(3)]


def _divergent(rank, world):
    """Each case: (what differs) -> the outcome on this rank, and how long it took."""
    cases = {
        "dtype": lambda: _outcome(_sdpa, *_qkv(dtype=torch.float32 if rank == 0 else torch.float64)),
        "strategy": lambda: _outcome(_sdpa, *_qkv(), strategy="flat" if rank == 0 else "zigzag"),
        "comm": lambda: _outcome(_sdpa, *_qkv(), comm="all_gather" if rank == 0 else "a2a"),
        "length": lambda: _outcome(_sdpa, *_qkv(s=8 if rank == 0 else 16)),
        "batch": lambda: _outcome(_sdpa, *_qkv(b=1 if rank == 0 else 2)),
        "refused": lambda: _outcome(_sdpa if rank == 0 else _dropout, *_qkv()),
        "same": lambda: _outcome(_sdpa, *_qkv()),
    }
    out = {}
    for name, case in cases.items():
        start = time.time()
        out[name] = (case(), time.time() - start)
    return out


def test_divergent_ranks_fail_on_every_rank_within_seconds():
    results = run_ranks(_divergent, 2, timeout=300)
    for rank, cases in enumerate(results):
        for name, (outcome, seconds) in cases.items():
            if name == "same":
                assert outcome == "ok", (rank, outcome)
                continue
            assert outcome.startswith("CPCompileError"), (rank, name, outcome)
            assert seconds < 30, (rank, name, seconds)
            if name == "refused":
                expected = "dropout_p=0.1" if rank == 1 else "CP rank 1 refused graph"
            else:
                expected = "CP ranks planned graph"
            assert expected in outcome, (rank, name, outcome)


def _attn(q, k, v, cu):
    return varlen_attn(q, k, v, cu, cu, 12, 12, window_size=(-1, 0))


def _packed(rank, world):
    """Local packed q/k/v built directly (bypassing shard(), whose host checks would refuse these)."""
    q = torch.randn(8, 2, 4, generator=torch.Generator().manual_seed(rank))
    good = [0, 3, 12, 16]
    cus = {
        "valid": good,
        "not from 0": [1, 3, 12, 16],
        "ends short": [0, 3, 12, 14],
        "past the end": [0, 3, 12, 20],
        "decreasing": [0, 9, 5, 16],
        "negative": [0, -3, 12, 16],
        "longer than max_q": [0, 1, 14, 16],
        "differs between ranks": good if rank == 0 else [0, 4, 12, 16],
    }
    out = {}
    for name, cu in cus.items():
        for strategy, comm in (("thd", "all_gather"), ("thd", "a2a"), ("thd_zigzag", "all_gather")):
            if strategy == "thd_zigzag" and name == "valid":
                cu = [0, 4, 12, 16]  # thd_zigzag: every document a multiple of 2*cp
            cu_t = torch.tensor(cu, dtype=torch.int32)
            out[(name, strategy, comm)] = _outcome(_attn, q, q, q, cu_t, strategy=strategy, comm=comm)
    return out


def test_bad_packed_metadata_fails_on_every_rank():
    """cu_seqlens that does not start at 0, ends short of / past T, decreases, goes negative, holds a document
    longer than varlen_attn's max_q/max_k, or differs between ranks: the same clear error on every rank."""
    for rank, cases in enumerate(run_ranks(_packed, 2, timeout=300)):
        for (name, strategy, comm), outcome in cases.items():
            if name == "valid":
                assert outcome == "ok", (rank, strategy, comm, outcome)
            elif name == "differs between ranks":
                assert "cu_seqlens differs between CP ranks" in outcome, (rank, strategy, comm, outcome)
            else:
                assert "bad cu_seqlens" in outcome, (rank, name, strategy, comm, outcome)


def _batches(rank, world):
    """One compiled model, batch 2 then 3 then 1 (the last batch of an epoch): logits match one process."""
    torch.manual_seed(0)
    model = TinyLlama(TinyConfig(vocab=64, dim=32, layers=1, heads=4, kv_heads=2, hidden=64)).double()
    be = cpcompile.backend(strategy="zigzag", inner="aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=be)
    errs = []
    for b in (2, 3, 1):
        ids = torch.randint(0, 64, (b, 16), generator=torch.Generator().manual_seed(b))
        pos = torch.arange(16).expand(b, 16)
        local = cpcompile.shard_batch({"input_ids": ids, "position_ids": pos}, strategy="zigzag")
        logits = compiled(local["input_ids"], local["position_ids"])
        full = cpcompile.unshard(logits, strategy="zigzag", seq_dim=1)
        errs.append(max_err(full, model(ids, pos)))
    return errs, len(be.plans)


def test_batch_size_may_change():
    for errs, plans in run_ranks(_batches, 2, timeout=300):
        # compiles: batch 2 (static), batch 3 (Dynamo makes the batch dynamic), batch 1 (Dynamo specialises 1)
        assert max(errs) <= 1e-10 and plans == 3, (errs, plans)

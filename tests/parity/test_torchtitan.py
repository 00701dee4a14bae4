"""torchtitan's Llama3 (debugmodel flavor, its own modules, 2 of its layers) trained with cpcompile on 2 ranks
matches one process: dense causal SDPA with zigzag, packed documents through its VarlenAttention with thd,
thd_zigzag and thd_balanced (new documents every step, no recompile), with padding done by the adapter. Varlen metadata built
from a rank's LOCAL positions fails every rank with an error that says so. One spawn for the whole module."""

from __future__ import annotations

import pytest
import torch

import cpcompile
from cpcompile.integrations.torchtitan import shard_batch
from cpcompile.testing.distributed import run_ranks
from cpcompile.testing.titan_llama import llama3, titan_batches, train_titan
from tests.support.titan import LAYERS, require_torchtitan

require_torchtitan()

WORLD = 2
ROWS, SEQ = 3, 45
"""Odd lengths, so the adapter pads: zigzag rows 45 -> 48, thd 135 -> 136 tokens, thd_zigzag every document."""
MAX_DOCUMENTS = 24
CASES = [  # attention, strategy, documents in the rows
    ("sdpa", "zigzag", False),
    ("varlen", "thd", True),
    ("varlen", "thd_zigzag", True),
    ("varlen", "thd_balanced", True),  # the adapter plans every batch; the plan rides in VarlenMetadata
]


def _batches(documents: bool) -> list[dict]:
    """Batches a, b, a: the documents change every step, and the loss on a must fall."""
    a, b = titan_batches(2, ROWS, SEQ, documents=documents, seed=1)
    return [a, b, a]


def _train(attention, strategy, documents):
    paddings = []
    res = train_titan(
        _batches(documents),
        attention=attention,
        strategy=strategy,
        layers=LAYERS,
        max_documents=MAX_DOCUMENTS if strategy == "thd_zigzag" else None,
        on_step=lambda step, loss, padding: paddings.append(padding),
    )
    return res, paddings


def _local_metadata(rank, world):
    """The mistake, three ways: torchtitan's own get_attention_masks of this rank's LOCAL positions; local
    offsets padded to the right shape (no recompile), the same on every rank; and different on each rank."""
    model = llama3("varlen", LAYERS)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=cpcompile.backend(strategy="thd", inner="aot_eager"), fullgraph=True)
    part = shard_batch(model, **_batches(True)[0], strategy="thd")
    good, local_positions = part.inputs["attention_masks"], part.inputs["positions"]
    n_local, entries = local_positions.numel(), good.cu_seq_q.numel()
    same = cpcompile.pad_cu_seqlens(torch.tensor([0, n_local], dtype=torch.int32), n_local, entries)
    differ = cpcompile.pad_cu_seqlens(torch.tensor([0, 1 + rank, n_local], dtype=torch.int32), n_local, entries)
    mistakes = {
        "get_attention_masks": model.get_attention_masks(local_positions),
        "same local offsets": good._replace(cu_seq_q=same, cu_seq_k=same),
        "different local offsets": good._replace(cu_seq_q=differ, cu_seq_k=differ),
    }
    outcomes = {}
    for name, masks in mistakes.items():
        try:
            compiled(part.inputs["tokens"], local_positions, masks)
            outcomes[name] = "no error"
        except Exception as e:  # BackendCompilerFailed(CPCompileError) or the run-time check's RuntimeError
            outcomes[name] = str(e)
    return outcomes


def _rank(rank, world):
    trained = {strategy: _train(attention, strategy, documents) for attention, strategy, documents in CASES}
    return trained, _local_metadata(rank, world)


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_rank, WORLD, timeout=600)


@pytest.mark.parametrize("attention,strategy,documents", CASES)
def test_training_matches_one_process(ranks, attention, strategy, documents):
    ref = train_titan(_batches(documents), attention=attention, layers=LAYERS)
    assert ref.losses[2] < ref.losses[0], ref.losses  # a broken backward could not pass unnoticed
    for rank, (trained, _) in enumerate(ranks):
        res, paddings = trained[strategy]
        assert res.rewritten == LAYERS, f"rank {rank}: {res.rewritten} sites rewritten (a recompile adds more)"
        assert all(p > 0 for p in paddings), f"rank {rank}: the adapter padded {paddings} tokens"
        for step, (got, want) in enumerate(zip(res.losses, ref.losses)):
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), f"rank {rank} step {step}: {got} vs {want}"
        for name, p in res.params.items():
            err = (p - ref.params[name]).abs().max().item()
            assert err <= 2e-5, f"rank {rank} {name} after {len(res.losses)} steps: max error {err}"


def test_local_metadata_fails_every_rank_clearly(ranks):
    for rank, (_, outcomes) in enumerate(ranks):
        assert "GLOBAL" in outcomes["get_attention_masks"], (rank, outcomes)
        assert "bad cu_seqlens" in outcomes["same local offsets"], (rank, outcomes)
        assert "(the GLOBAL packed length, not a rank's local one)" in outcomes["same local offsets"]
        assert "cu_seqlens differs between CP ranks" in outcomes["different local offsets"], (rank, outcomes)
        assert "GLOBAL cu_seqlens" in outcomes["different local offsets"]

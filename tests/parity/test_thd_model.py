"""Packed documents end to end: a small model calling varlen_attn (logits and parameter grads vs the
single-process per-document run), no recompiles when documents change, unshard, and one Inductor run."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import cpcompile
from cpcompile.testing.distributed import run_ranks
from cpcompile.testing.model import TinyConfig, token_loss_sum
from cpcompile.testing.varlen_model import VarlenTinyLlama, document_position_ids
from tests.support.parity import max_err
from tests.support.thd_parity import compare_packed, cu_of, random_lengths

CFG = TinyConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, hidden=64)
CU_ENTRIES = 12
"""cu_seqlens is padded to this many entries, so its shape never changes between batches."""


def _batch(gen: torch.Generator, lengths: list[int]) -> dict:
    total = sum(lengths)
    cu = cpcompile.pad_cu_seqlens(cu_of(lengths), total, CU_ENTRIES)
    labels = torch.randint(0, CFG.vocab, (total,), generator=gen)
    labels[cu_of(lengths)[1:].long() - 1] = -100  # no next token at a document's end
    return dict(
        input_ids=torch.randint(0, CFG.vocab, (total,), generator=gen),
        position_ids=document_position_ids(cu),
        labels=labels,
        cu_seqlens=cu,
    )


def _model_batches(rank, world, strategy):
    """Three batches with different documents on one compiled model: logits and param-grad parity each time,
    and no recompilation (error_on_recompile) after the first."""
    gen = torch.Generator().manual_seed(5)
    unit = 2 * world if strategy == "thd_zigzag" else 1
    total = 8 * world
    torch.manual_seed(0)
    ref_model = VarlenTinyLlama(CFG, causal=True, max_len=total).double().use_per_document_sdpa()
    cp_model = copy.deepcopy(ref_model).use_per_document_sdpa(False)
    be = cpcompile.backend(strategy=strategy, inner="aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(cp_model, backend=be, fullgraph=True)
    errors = []
    for step in range(3):
        batch = _batch(gen, random_lengths(gen, total, unit))
        ref_model.zero_grad()
        cp_model.zero_grad()
        ref_logits = ref_model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])
        token_loss_sum(ref_logits[None], batch["labels"][None]).backward()
        local = cpcompile.shard_batch(batch, strategy=strategy, seq_dim=0)
        assert local["cu_seqlens"] is batch["cu_seqlens"]
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            logits = compiled(local["input_ids"], local["position_ids"], local["cu_seqlens"])
        token_loss_sum(logits[None], local["labels"][None]).backward()
        full = cpcompile.unshard(logits.detach(), strategy=strategy, seq_dim=0, cu_seqlens=batch["cu_seqlens"])
        errors.append((f"{strategy} step {step} logits", max_err(full, ref_logits.detach())))
        for name, p in cp_model.named_parameters():
            grad = p.grad.clone()
            dist.all_reduce(grad)  # each rank holds the gradient of its own tokens' loss
            errors.append(
                (f"{strategy} step {step} grad {name}", max_err(grad, dict(ref_model.named_parameters())[name].grad))
            )
    assert len(be.plans) == CFG.layers, f"{len(be.plans)} sites rewritten: the model was recompiled"
    return errors


def _dynamic_cu_length(rank, world):
    """cu_seqlens whose length changes every batch, marked dynamic: one compile for all batches."""
    gen = torch.Generator().manual_seed(9)
    be = cpcompile.backend(strategy="thd", inner="aot_eager")
    from tests.support.thd_parity import causal_attn, doc_reference, packed_case

    torch._dynamo.reset()
    fn = torch.compile(causal_attn, backend=be, fullgraph=True)
    errors = []
    for step, total in enumerate((4 * world, 4 * world, 4 * world)):
        cu = cu_of(random_lengths(gen, total))
        q, k, v, _ = packed_case(step, total, 4, 2, 8)
        torch._dynamo.mark_dynamic(cu, 0)
        local = [cpcompile.shard(t, strategy="thd", seq_dim=0, cu_seqlens=cu) for t in (q, k, v)]
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            out = fn(*local, cu)
        ref = doc_reference(q, k, v, torch.zeros_like(q), cu, True, torch.float64)[0]
        errors.append(
            (
                f"dynamic cu step {step} ({cu.numel()} entries)",
                max_err(out, cpcompile.shard(ref, strategy="thd", seq_dim=0, cu_seqlens=cu)),
            )
        )
    assert len(be.plans) == 1, f"{len(be.plans)} compiles for 3 batches"
    return errors


def _unshard_grad(rank, world):
    """unshard is the inverse of shard and its backward keeps this rank's slice of the gradient."""
    errors = []
    for strategy, lengths in (("thd", [1, 2 * world - 1, 2 * world]), ("thd_zigzag", [2 * world, 4 * world])):
        cu = cu_of(lengths)
        x = torch.arange(float(sum(lengths))).view(-1, 1).repeat(1, 3)
        w = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
        local = cpcompile.shard(x, strategy=strategy, seq_dim=0, cu_seqlens=cu).requires_grad_()
        full = cpcompile.unshard(local, strategy=strategy, seq_dim=0, cu_seqlens=cu)
        (full * w).sum().backward()
        errors.append((f"{strategy} unshard", max_err(full, x)))
        errors.append(
            (
                f"{strategy} unshard grad",
                max_err(local.grad, cpcompile.shard(w, strategy=strategy, seq_dim=0, cu_seqlens=cu)),
            )
        )
    return errors


def _inductor(rank, world):
    """One end-to-end Inductor run per layout (fp32): the region compiles and stays correct."""
    backend = lambda s: cpcompile.backend(strategy=s, inner="inductor")  # noqa: E731
    reports = {}
    for strategy, lengths in (("thd", [3, 1, 4 * world - 4]), ("thd_zigzag", [2 * world, 4 * world])):
        reports[strategy] = compare_packed(strategy, True, torch.float32, lengths, backend=backend(strategy))
    return reports


def _all(rank, world):
    errors = _model_batches(rank, world, "thd") + _model_batches(rank, world, "thd_zigzag")
    return errors + _dynamic_cu_length(rank, world) + _unshard_grad(rank, world), _inductor(rank, world)


def test_thd_model_recompiles_unshard_inductor():
    failures = []
    for rank, (errors, reports) in enumerate(run_ranks(_all, 2, timeout=900)):
        failures += [f"rank {rank} {what}: error {e:.3g}" for what, e in errors if not e <= 1e-9]
        for strategy, report in reports.items():
            failures += [
                f"rank {rank} inductor {strategy} {t}: {e:.3g} > {a:.3g}" for t, (e, a) in report.items() if not e <= a
            ]
    assert not failures, "\n".join(failures)

"""HF packed and padded batches as packed documents (shard_batch(..., hf_packing=True), strategy thd_balanced) with
attn_implementation="cpcompile", on 2 gloo ranks against the same model on one process with HF's sdpa attention
(which reads the documents from the restarting position_ids, or applies the padding mask): the model's own loss,
every parameter gradient, and the logits of every real token.

Batches: DataCollatorWithFlattening's own output (position_ids restarting per document; with its flash-attention
kwargs cu_seq_lens_q/max_length_q for Qwen3), Gemma 3 with its sliding window inside documents, and a left-padded
batch of two rows (Llama)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cpcompile
from cpcompile.testing.distributed import RankPool

pytest.importorskip("transformers")

from tests.support.hf_zoo import VOCAB, build  # noqa: E402

LENGTHS = [7, 13, 5, 7]  # 32 tokens: documents of any length, thd_balanced cuts them for 2 ranks
TOL = 2e-5  # relative to the largest reference value: HF's loss runs in fp32 (logits.float())


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-6)).item()


def _flattened(flash_kwargs: bool) -> dict:
    from transformers import DataCollatorWithFlattening

    g = torch.Generator().manual_seed(1)
    features = [{"input_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist()} for n in LENGTHS]
    batch = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=flash_kwargs)(features)
    return dict(batch)


def _left_padded() -> dict:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, VOCAB, (2, 16), generator=g)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :5] = 0  # row 0: 5 tokens of left padding
    ids[0, :5] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _reference(name: str, full: dict):
    model = build(name, "sdpa")
    ref_batch = {k: v for k, v in full.items() if not k.startswith(("cu_seq_lens", "max_length"))}
    out = model(**ref_batch, use_cache=False)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _compare(rank, world, name, kind):
    torch.set_default_dtype(torch.float32)
    full = _left_padded() if kind == "padded" else _flattened(kind == "flash_kwargs")
    ref, ref_grads = _reference(name, full)
    real = full.get("attention_mask", torch.ones_like(full["input_ids"])).reshape(1, -1)
    local = cpcompile.shard_batch(full, strategy="thd_balanced", hf_packing=True, hf_loss="causal_lm")
    plan = local["cu_seq_lens_q"]
    model = build(name, "cpcompile")
    be = cpcompile.backend(strategy="thd_balanced", inner="eager")
    torch._dynamo.reset()
    out = torch.compile(model, backend=be, fullgraph=True)(**local, use_cache=False)
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    shard = lambda t: cpcompile.shard(t, strategy="thd_balanced", seq_dim=1, cu_seqlens=plan)  # noqa: E731
    keep = shard(real).bool()
    logits = shard(ref.logits.detach().reshape(1, -1, ref.logits.shape[-1]))
    errors = {"loss": _rel(loss, ref.loss.detach()), "logits": _rel(out.logits.detach()[keep], logits[keep])}
    for n, p in model.named_parameters():
        dist.all_reduce(p.grad)
        errors[n] = _rel(p.grad, ref_grads[n])
    return errors, sorted({(p.layout, p.window) for p in be.plans}, key=str)


@pytest.fixture(scope="module")
def ranks2():
    pool = RankPool(2)
    yield pool
    pool.close()


@pytest.mark.parametrize(
    "name,kind",
    [("llama", "positions"), ("qwen3", "flash_kwargs"), ("gemma3", "positions"), ("llama", "padded")],
)
def test_hf_packed_and_padded_batches_2_ranks(ranks2, name, kind):
    for rank, (errors, plans) in enumerate(ranks2.run(_compare, name, kind, timeout=600)):
        assert all(layout == "thd_balanced" for layout, _ in plans), (rank, plans)
        if name == "gemma3":  # the sliding layer's window runs inside each document
            assert any(window != (-1, -1) for _, window in plans), (rank, plans)
        bad = {n: e for n, e in errors.items() if not e <= TOL}
        assert not bad, f"rank {rank} {name} {kind}: {bad}"

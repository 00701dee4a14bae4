"""CPTrainer (cpcompile/integrations/hf_trainer.py): a Hugging Face Trainer run on 2 gloo CP ranks trains like
the plain Trainer on one process (losses and weights after a few steps), and HF padding-free batches are
refused before training."""

from __future__ import annotations

import os

import pytest
import torch

from cpcompile.testing.distributed import run_ranks

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

STEPS, ROWS, SEQ = 3, 2, 32


def _model():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="cpcompile")


def _dataset():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (ROWS, SEQ), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _args(out: str):
    # one batch is the whole dataset, so the sampler's order cannot matter; plain SGD: weight error tracks
    # gradient error
    return transformers.TrainingArguments(
        output_dir=out, max_steps=STEPS, per_device_train_batch_size=ROWS, learning_rate=0.1, optim="sgd",
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True,
    )  # fmt: skip


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _cp_rank(rank, world, out):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    from cpcompile.integrations.hf_trainer import CPTrainer

    model = _model()
    trainer = CPTrainer(model=model, args=_args(f"{out}/{rank}"), train_dataset=_dataset(),
                        data_collator=transformers.default_data_collator, cp_strategy="zigzag",
                        cp_inner="aot_eager")  # fmt: skip
    trainer.train()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return {"losses": _losses(trainer), "params": params, "plans": len(trainer.cp_backend.plans)}


def test_cp_trainer_matches_one_process(tmp_path):
    results = run_ranks(_cp_rank, 2, str(tmp_path), timeout=600)
    model = _model()
    ref = transformers.Trainer(model=model, args=_args(str(tmp_path / "ref")), train_dataset=_dataset(),
                               data_collator=transformers.default_data_collator)  # fmt: skip
    ref.train()
    ref_losses = _losses(ref)
    assert len(ref_losses) == STEPS
    for r in results:
        assert r["plans"] == 2  # both layers' attention rewritten
        assert max(abs(a - b) for a, b in zip(r["losses"], ref_losses)) < 1e-4, (r["losses"], ref_losses)
        assert len(r["losses"]) == STEPS
        err = max((r["params"][k] - p.detach()).abs().max().item() for k, p in model.named_parameters())
        assert err < 1e-5, err
    assert ref_losses[-1] < ref_losses[0]  # it trains


def test_padding_free_batches_are_refused():
    from cpcompile import CPCompileError
    from cpcompile.integrations.hf_trainer import CPCollator

    flatten = transformers.DataCollatorWithFlattening()
    collator = CPCollator(flatten, strategy="zigzag")
    features = [{"input_ids": [1, 2, 3, 4]}, {"input_ids": [5, 6, 7, 8]}]
    with pytest.raises(CPCompileError, match="padding-free") as refused:
        collator(features)
    assert "hf_packing=True" in str(refused.value) and "varlen_attn" not in str(refused.value)  # the guide's recipe

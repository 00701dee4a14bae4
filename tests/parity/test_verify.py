"""cpcompile.verify on 2 gloo ranks: it passes on correct models (dense TinyLlama with a user loss, packed documents
under thd_balanced with no loss at all, HF's Llama with its own loss) and FAILS, naming the tensor, on a model
whose token mixing the token guard cannot see (a cumsum over the tokens marked token-local)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import cpcompile
from cpcompile.testing.distributed import RankPool
from cpcompile.testing.model import TinyConfig, TinyLlama, token_loss_sum
from cpcompile.testing.training import make_batches
from cpcompile.testing.varlen_model import VarlenTinyLlama, document_position_ids
from cpcompile.token_local import clear_token_local_marks

CFG = TinyConfig(layers=1, dim=32, hidden=64)
SEQ = 16

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def pool():
    p = RankPool(2)
    yield p
    p.close()


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A running sum over the tokens: wrong on a rank's own tokens, and the mark below hides it from the guard."""
    return x + 0.1 * x.cumsum(1)


class MixedLlama(TinyLlama):
    def forward(self, input_ids, position_ids):
        x = _mix(self.embed(input_ids))
        for block in self.blocks:
            x = block(x, position_ids)
        return self.head(self.norm(x))


def _forward(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(batch["input_ids"], batch["position_ids"])


def _dense(rank, world, model_cls, strategy, dtype=torch.float32):
    torch.manual_seed(0)
    model = model_cls(CFG).to(dtype)
    if model_cls is MixedLlama:
        cpcompile.mark_token_local(_mix)
    batch = make_batches(CFG, 1, 2, SEQ)[0]
    count = int((batch["labels"] != -100).sum())
    try:
        report = cpcompile.verify(
            model, batch, backend=cpcompile.backend(strategy=strategy, inner="eager"), forward=_forward,
            loss_fn=lambda logits, b: token_loss_sum(logits, b["labels"]) / count, show=False,
        )  # fmt: skip
    finally:
        clear_token_local_marks()
    untouched = all(p.grad is None for p in model.parameters())
    return report, str(report), untouched


def test_verify_passes_on_a_correct_model(pool):
    for report, text, untouched in pool.run(_dense, TinyLlama, "zigzag"):
        assert report.passed, text
        assert untouched  # the user's model gets no gradients
        names = {r.name for r in report.rows}
        assert {"logits", "loss", "grad head.weight", "grad blocks.0.attn.q.weight"} <= names
        assert report.worst.error <= 5e-5
        assert text.startswith("cpcompile.verify: PASS, strategy=zigzag")
        assert "1 attention sites rewritten" in text


def test_verify_bf16_by_the_rounding_rule(pool):
    for report, text, _ in pool.run(_dense, TinyLlama, "zigzag", torch.bfloat16):
        assert report.passed, text
        assert report.dtype == torch.bfloat16 and "bfloat16" in text.splitlines()[0]
        assert all(r.allowed >= 2e-3 for r in report.rows)  # 2 x the one-process bf16 error + the floor


def test_verify_fails_on_token_mixing_the_guard_cannot_see(pool):
    reports = pool.run(_dense, MixedLlama, "flat")
    for report, text, _ in reports:
        assert not report.passed, text
        assert report.worst.error > 1e-2, text
        assert "FAIL" in text and "logits" in {r.name for r in report.failures()}
    assert reports[0][1] == reports[1][1]  # every rank reports the same


def _packed(rank, world):
    torch.manual_seed(0)
    model = VarlenTinyLlama(CFG, max_len=32)
    g = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 5, 17, 20, 32], dtype=torch.int32)
    batch = {"input_ids": torch.randint(0, CFG.vocab, (32,), generator=g), "cu_seqlens": cu}
    batch["position_ids"] = document_position_ids(cu)

    be = cpcompile.backend(strategy="thd_balanced", inner="aot_eager")
    return cpcompile.verify(model, batch, backend=be, forward=_packed_forward, seq_dim=0, show=False)


def _packed_forward(model: nn.Module, batch: dict) -> torch.Tensor:
    if isinstance(model, VarlenTinyLlama):  # the one-process copy: varlen_attn has no CPU kernel, run SDPA
        model.use_per_document_sdpa()
    return model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])


def test_verify_packed_documents_without_a_loss(pool):
    for report in pool.run(_packed):
        assert report.passed, str(report)
        assert "loss" in {r.name for r in report.rows}  # the logits' fixed random weighting


def _hf(rank, world):
    from cpcompile.testing.hf_llama import hf_llama

    torch.manual_seed(0)
    model = hf_llama(CFG)
    ids = torch.randint(0, CFG.vocab, (2, SEQ), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids, "use_cache": False}
    report = cpcompile.verify(model, batch, backend=cpcompile.backend(strategy="zigzag", inner="eager"),
                              hf_loss="causal_lm", show=rank == 0)  # fmt: skip
    return report


def test_verify_hf_model_with_its_own_loss(pool):
    pytest.importorskip("transformers")
    for report in pool.run(_hf):
        assert report.passed, str(report)
        assert {"logits", "loss"} <= {r.name for r in report.rows}

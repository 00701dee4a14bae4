"""The torchtitan adapter refuses what would be silently wrong or recompile: FlexAttention, a strategy that does
not fit the model's attention, positions that are not the global ones, positions past RoPE's cache."""

from __future__ import annotations

import sys

import pytest
import torch

from cpcompile import CPCompileError
from cpcompile.integrations import torchtitan as titan
from cpcompile.testing.titan_llama import llama3
from tests.support.fake_pg import fake_group
from tests.support.titan import require_torchtitan

require_torchtitan()

TOKENS = torch.randint(0, 2048, (2, 16))
LABELS = TOKENS.roll(-1, 1)


@pytest.fixture(scope="module")
def models():
    return {kind: llama3(kind, layers=1) for kind in ("sdpa", "varlen")}


def test_flex_attention_refused():
    from torchtitan.models.llama3 import llama3_configs

    config = llama3_configs["debugmodel"](attn_backend="flex")  # torchtitan's default
    config.layers = config.layers[:1]
    with pytest.raises(CPCompileError, match="FlexAttention.*attn_backend='varlen'"):
        titan.check_model(config.build())


@pytest.mark.parametrize("kind,strategy", [("sdpa", "thd"), ("varlen", "zigzag"), ("varlen", "flat")])
def test_strategy_must_fit_the_attention(models, kind, strategy):
    with fake_group(0, 2), pytest.raises(CPCompileError, match=f"strategy '{strategy}' does not fit.*{kind}"):
        titan.shard_batch(models[kind], TOKENS, LABELS, strategy=strategy)


def test_compiled_model_is_checked_too(models):
    compiled = torch.compile(models["varlen"])
    assert titan.check_model(compiled) == "varlen"
    with fake_group(0, 2), pytest.raises(CPCompileError, match="does not fit"):
        titan.shard_batch(compiled, TOKENS, LABELS, strategy="zigzag")


@pytest.mark.parametrize(
    "positions", [torch.arange(8).expand(2, 8), torch.arange(16.0).expand(2, 16), -torch.arange(16).expand(2, 16)]
)
def test_positions_must_be_the_global_ones(models, positions):
    with fake_group(0, 2), pytest.raises(CPCompileError, match="positions must be the GLOBAL per-token positions"):
        titan.shard_batch(models["varlen"], TOKENS, LABELS, positions, strategy="thd")


def test_positions_past_the_rope_cache(models):
    limit = models["sdpa"].config.max_seq_len
    positions = torch.arange(16).expand(2, 16) + limit - 8
    with fake_group(0, 2), pytest.raises(CPCompileError, match=f"past the model's RoPE cache of max_seq_len={limit}"):
        titan.shard_batch(models["sdpa"], TOKENS, LABELS, positions, strategy="zigzag")


def test_unknown_strategy(models):
    with fake_group(0, 2), pytest.raises(CPCompileError, match="unknown strategy 'ring'"):
        titan.shard_batch(models["sdpa"], TOKENS, LABELS, strategy="ring")


def test_without_torchtitan(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchtitan.models.common.attention", None)  # import fails
    with pytest.raises(CPCompileError, match="needs torchtitan"):
        titan.check_model(torch.nn.Linear(2, 2))


def test_positions_omitted_are_refused(models):
    """Without positions torchtitan's RoPE reads its cache from 0 to the rank's LOCAL length: refused by the token
    guard, naming the line and the fix (was error 6.8e-3 unchecked)."""
    import cpcompile

    with fake_group(0, 2), pytest.raises(Exception) as excinfo:
        torch._dynamo.reset()
        compiled = torch.compile(models["sdpa"], backend=cpcompile.backend(strategy="zigzag", inner="eager"))
        compiled(cpcompile.shard(TOKENS, strategy="zigzag", seq_dim=1))
    error = excinfo.value
    while error is not None and not isinstance(error, CPCompileError):
        error = error.__cause__ or error.__context__
    assert error is not None, excinfo.value
    msg = str(error)
    assert "LOCAL sequence length" in msg and "torchtitan: pass positions=" in msg and "/torchtitan/" in msg, msg

"""Hugging Face models under CP: what cpcompile refuses, each with one CPCompileError naming the fix (one process,
fake CP group). The run-time token checks (padding, packed positions) are in tests/parity/test_hf_zoo.py."""

from __future__ import annotations

import pytest
import torch

import cpcompile
from cpcompile import CPCompileError
from tests.support.fake_pg import fake_group

pytest.importorskip("transformers")

from tests.support.hf_zoo import batch, build  # noqa: E402


def _cp_error(excinfo) -> str:
    err = excinfo.value
    while err is not None and not isinstance(err, CPCompileError):
        err = err.__cause__ or err.__context__
    assert err is not None, f"no CPCompileError in {excinfo.value!r}"
    return str(err)


def _compile_hf(model, strategy="zigzag", **inputs):
    be = cpcompile.backend(strategy=strategy, inner="eager")
    torch._dynamo.reset()
    with pytest.raises(Exception) as excinfo:
        torch.compile(model, backend=be, fullgraph=True)(**inputs)
    return _cp_error(excinfo)


def _local(name="llama", **kw):
    return cpcompile.shard_batch(batch(name, 2, 16), strategy="zigzag", **kw)


def test_sdpa_in_the_training_configuration_names_cpcompile():
    """HF's "sdpa" under torch.compile with use_cache=False builds a 4-D mask (its packed-sequence check cannot be
    skipped while tracing): refused, with attn_implementation="cpcompile" as the fix."""
    with fake_group(0, 2):
        msg = _compile_hf(build("llama", "sdpa"), **_local(), use_cache=False)
    assert "an explicit attn_mask tensor cannot be sharded" in msg, msg
    assert 'use attn_implementation="cpcompile"' in msg and "use_cache=False" in msg, msg


def test_positions_made_inside_the_model_are_refused():
    """Without position_ids HF makes 0..L-1 from each rank's local length: wrong on every rank but one."""
    with fake_group(0, 2):
        local = _local(position_ids=False)
        assert "position_ids" not in local
        msg = _compile_hf(build("llama", "cpcompile"), **local, use_cache=False)
    assert "position ids are computed inside the model from the local length" in msg, msg
    assert "cpcompile.shard_batch creates them" in msg, msg


def test_unsharded_attention_mask_is_refused():
    with fake_group(0, 2):
        local = _local()
        local["attention_mask"] = torch.ones(2, 16, dtype=torch.long)  # the global mask, not this rank's share
        msg = _compile_hf(build("llama", "cpcompile"), **local, use_cache=False)
    assert "padding mask (attention_mask) has shape (2, 16), but this rank's queries have 8 tokens" in msg, msg


def test_attention_dropout_in_training_is_refused():
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        attention_dropout=0.1, attn_implementation="cpcompile",
    )  # fmt: skip
    with fake_group(0, 2):
        msg = _compile_hf(transformers.LlamaForCausalLM(cfg).train(), **_local(), use_cache=False)
    assert "dropout_p=0.1" in msg and "model.eval()" in msg, msg


def test_attention_sinks_not_one_per_query_head_are_refused():
    def sunk(q, k, v, sinks):
        return cpcompile.attention(q, k, v, is_causal=True, sinks=sinks)

    q, kv = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    be = cpcompile.backend(strategy="zigzag", inner="eager")
    with fake_group(0, 2), pytest.raises(Exception) as excinfo:
        torch._dynamo.reset()
        torch.compile(sunk, backend=be, fullgraph=True)(q, kv, kv, torch.zeros(2))
    assert "its attention sinks have shape (2,); they must be one logit a query head, (4,)" in str(excinfo.value)


def test_hf_eager_sinks_are_gpt_oss_eager_attention():
    """Without compile, attn_implementation="cpcompile" with s_aux is GPT-OSS's own eager attention."""
    pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from cpcompile.integrations.hf import cpcompile_attention

    module = build("gpt_oss", "cpcompile").model.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 8, 16, dtype=torch.float64, generator=g)
    kv = torch.randn(1, 2, 8, 16, dtype=torch.float64, generator=g)
    with torch.no_grad():
        module.sinks.copy_(torch.randn(4, generator=g))
    mask = torch.ones(8, 8, dtype=torch.bool).tril()[None, None]
    got, _ = cpcompile_attention(module, q, kv, kv, mask, scaling=0.25, s_aux=module.sinks)
    additive = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    ref, _ = eager_attention_forward(module, q, kv, kv, additive, scaling=0.25)
    torch.testing.assert_close(got, ref)


def test_softcap_without_a_softcap_kernel_is_one_error():
    def capped(q, k, v):
        return cpcompile.attention(q, k, v, is_causal=True, softcap=30.0)

    q, kv = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    be = cpcompile.backend(strategy="zigzag", kernel="cpu_flash", inner="eager")
    with fake_group(0, 2), pytest.raises(Exception) as excinfo:
        torch._dynamo.reset()
        torch.compile(capped, backend=be, fullgraph=True)(q, kv, kv)
    msg = _cp_error(excinfo)
    assert "its scores are softcapped (softcap=30.0" in msg and "it takes no softcapped scores" in msg, msg
    assert "'flex_softcap' (FlexAttention" in msg and "use kernel='auto'" in msg, msg


def test_window_that_excludes_the_token_itself_is_refused():
    def bad(q, k, v):
        return cpcompile.attention(q, k, v, window=(-2, 0))

    q = torch.randn(1, 2, 8, 16)
    be = cpcompile.backend(strategy="flat", inner="eager")
    with fake_group(0, 2), pytest.raises(Exception) as excinfo:
        torch._dynamo.reset()
        torch.compile(bad, backend=be, fullgraph=True)(q, q, q)
    assert "has a side below -1" in _cp_error(excinfo)


def test_mask_patterns_cpcompile_cannot_express_stay_explicit_and_are_refused():
    """An image-token style overlay (or_mask_function) keeps HF's 4-D mask: a single process runs it as sdpa does,
    CP refuses the mask with the HF-specific reason."""
    from transformers.masking_utils import create_causal_mask

    from cpcompile.integrations.hf import cpcompile_attention

    model = build("llama", "cpcompile")
    attn = model.model.layers[0].self_attn

    def prefix(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx < 2  # every token also sees the first two

    def forward(ids, pos):
        embeds = model.model.embed_tokens(ids)
        mask = create_causal_mask(model.config, embeds, None, None, pos, or_mask_function=prefix)
        q = attn.q_proj(embeds).view(2, 8, 4, 16).transpose(1, 2)
        kv = attn.k_proj(embeds).view(2, 8, 2, 16).transpose(1, 2)
        return cpcompile_attention(attn, q, kv, kv, mask)[0], mask

    with fake_group(0, 2):
        local = _local()
        _, mask = torch.compile(forward, backend="eager", fullgraph=True)(local["input_ids"], local["position_ids"])
        assert isinstance(mask, torch.Tensor) and mask.dim() == 4  # HF's own mask, not the 2-D padding marker
        msg = _compile_hf(lambda **kw: forward(**kw)[0], ids=local["input_ids"], pos=local["position_ids"])
    assert "an explicit attn_mask tensor cannot be sharded" in msg and "mask pattern is one cpcompile" in msg, msg

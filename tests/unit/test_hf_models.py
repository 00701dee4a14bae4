"""What attn_implementation="cpcompile" prepares on a Hugging Face model when it is built (integrations/hf_models.py):
a hybrid's token mixers declared, transformers' output-capturing hooks installed once, and a MoE's aux loss whose
value without CP is transformers' own (the CP parity: tests/parity/test_hf_zoo.py and test_mixers.py)."""

from __future__ import annotations

import pytest
import torch

import cpcompile
from cpcompile.integrations import hf_moe
from cpcompile.mixers import HF_MIXERS, restore_hf_mixers

transformers = pytest.importorskip("transformers")


def _hf_aux_loss():
    import transformers.models.qwen3_moe.modeling_qwen3_moe as modeling

    return hf_moe.original(modeling.__name__) or modeling.load_balancing_loss_func


@pytest.mark.parametrize("masked", [False, True])
def test_the_aux_loss_without_cp_is_transformers_own(masked):
    """cpcompile's load_balancing_loss_func (counts from the top-k hits, the routed rows summed, no histc) against
    transformers' on 3 layers' router logits of 2 x 7 tokens, 5 experts, top 2; with an attention mask that pads."""
    g = torch.Generator().manual_seed(0)
    gates = tuple(torch.randn(14, 5, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.ones(2, 7, dtype=torch.long)
    if masked:
        mask[1, 4:] = 0
    mask = mask if masked else None
    want = _hf_aux_loss()(gates, 5, 2, mask)
    got = hf_moe.load_balancing_loss_func(gates, 5, 2, mask)
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-6, atol=0)
    (g_want,) = torch.autograd.grad(want, gates[1])
    (g_got,) = torch.autograd.grad(got, gates[1])
    torch.testing.assert_close(g_got.double(), g_want.double(), rtol=1e-5, atol=1e-9)


def _qwen3_moe(attn: str, **extra):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=32, hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2, **extra,
    )  # fmt: skip
    cfg._attn_implementation = attn
    return transformers.Qwen3MoeForCausalLM(cfg)


def _capture_hooks(model) -> int:
    return sum(1 for m in model.modules() for h in m._forward_hooks.values() if "output_capturing" in h.__qualname__)


def test_capture_hooks_are_installed_once_when_the_model_is_built():
    """transformers installs them on the first call asking for router logits, under a threading.Lock that Dynamo
    cannot enter; a "cpcompile" model has them from the start, once each (not again on the first call), and records
    one router logits tensor a layer, as the same model on "sdpa" does."""
    torch.manual_seed(0)
    model = _qwen3_moe("cpcompile")
    hooks = _capture_hooks(model)
    assert hooks > 0 and _capture_hooks(_qwen3_moe("sdpa")) == 0
    ids = torch.randint(0, 32, (2, 6))
    out = model(input_ids=ids, output_router_logits=True, use_cache=False)
    assert _capture_hooks(model) == hooks and len(out.router_logits) == 2
    torch.manual_seed(0)
    plain = _qwen3_moe("sdpa")
    ref = plain(input_ids=ids, output_router_logits=True, use_cache=False)
    assert len(ref.router_logits) == 2
    torch.testing.assert_close(out.aux_loss, ref.aux_loss)


def test_a_hybrid_declares_its_mixers_when_built_with_cpcompile():
    """Out of the box: building Qwen3-Next with attn_implementation="cpcompile" declares its modeling module's conv
    and gated delta rule (hf_token_mixers' defaults, comm="a2a"), "sdpa" does not, set_attn_implementation does;
    a declaration the user made (comm="state") is kept by a later build; restore_hf_mixers undoes them."""
    import transformers.models.qwen3_next.modeling_qwen3_next as modeling

    def config():
        return transformers.Qwen3NextConfig(
            vocab_size=32, hidden_size=16, intermediate_size=16, moe_intermediate_size=8,
            shared_expert_intermediate_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=4,
            linear_value_head_dim=4, num_experts=2, num_experts_per_tok=1,
            layer_types=["linear_attention", "full_attention"],
        )  # fmt: skip

    names = [n for n in HF_MIXERS if hasattr(modeling, n)]
    restore_hf_mixers(transformers.Qwen3NextForCausalLM)
    own = {n: getattr(modeling, n) for n in names}

    def declared() -> list[str]:
        return [n for n in names if getattr(modeling, n) is not own[n]]

    cfg = config()
    cfg._attn_implementation = "sdpa"
    model = transformers.Qwen3NextForCausalLM(cfg)
    assert declared() == []
    model.set_attn_implementation("cpcompile")
    assert declared() == ["causal_conv1d_fn", "torch_chunk_gated_delta_rule"], declared()
    assert restore_hf_mixers(model) == [f"{modeling.__name__}.{n}" for n in names]
    assert declared() == []
    cfg = config()
    cfg._attn_implementation = "cpcompile"
    model = transformers.Qwen3NextForCausalLM(cfg)
    assert len(declared()) == 2
    cpcompile.hf_token_mixers(model, comm="state")
    state = modeling.torch_chunk_gated_delta_rule
    transformers.Qwen3NextForCausalLM(cfg)  # another "cpcompile" model keeps the user's comm
    assert modeling.torch_chunk_gated_delta_rule is state
    restore_hf_mixers(model)
    assert declared() == []


def _nested(attn: str):
    """A decorated model (capture_outputs) around another one (LlamaModel), as composite models are built."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.utils.output_capturing import capture_outputs

    class Outer(transformers.LlamaPreTrainedModel):
        _can_record_outputs = {"hidden_states": LlamaDecoderLayer}

        def __init__(self, config):
            super().__init__(config)
            self.inner = transformers.LlamaModel(config)
            self.post_init()

        @capture_outputs
        def forward(self, input_ids, **kwargs):
            return self.inner(input_ids=input_ids, **kwargs)

    cfg = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1,
    )  # fmt: skip
    cfg._attn_implementation = attn
    return Outer(cfg)


def test_a_decorated_model_inside_another_has_its_hooks_once():
    """The inner model is built (and prepared) first; the outer one's install installs the inner one's hooks again,
    so cpcompile takes its own back first: every module ends with the hooks transformers' first call on the outer
    model installs on an "sdpa" model, no more."""
    from transformers.utils.output_capturing import maybe_install_capturing_hooks

    ours = _nested("cpcompile")
    theirs = _nested("sdpa")
    maybe_install_capturing_hooks(theirs)

    def hooks(model) -> dict[str, int]:
        return {name: len(m._forward_hooks) for name, m in model.named_modules() if m._forward_hooks}

    assert hooks(ours) == hooks(theirs) and hooks(theirs), (hooks(ours), hooks(theirs))

"""Tiny random Hugging Face models for the HF zoo tests: one builder per architecture, the same weights for any
attn_implementation (the reference runs HF's own "eager" attention, CP runs "cpcompile")."""

from __future__ import annotations

import torch

import cpcompile  # noqa: F401  (registers attn_implementation="cpcompile")

WINDOW = 5
"""The sliding windows of the windowed models: shorter than a zigzag chunk at cp=2 (8 tokens) and spanning
chunks at cp=4 (4 tokens), so windows cut blocks both ways."""
VOCAB = 128


def _llama_sizes(**extra) -> dict:
    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return {**sizes, **extra}


def _config(name: str):
    import transformers as T

    if name == "llama":
        return T.LlamaForCausalLM, T.LlamaConfig(**_llama_sizes())
    if name == "qwen2":  # layer 0 full attention, layer 1 sliding (max_window_layers=1)
        cfg = _llama_sizes(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
        return T.Qwen2ForCausalLM, T.Qwen2Config(**cfg)
    if name == "qwen3":
        return T.Qwen3ForCausalLM, T.Qwen3Config(**_llama_sizes(head_dim=16))
    if name == "mistral":
        return T.MistralForCausalLM, T.MistralConfig(**_llama_sizes(sliding_window=None))
    if name == "mistral_sw":
        return T.MistralForCausalLM, T.MistralConfig(**_llama_sizes(sliding_window=WINDOW))
    if name == "gemma2":  # softcapped scores (50), sliding and full layers, final logit softcapping
        return T.Gemma2ForCausalLM, T.Gemma2Config(**_llama_sizes(head_dim=16, sliding_window=WINDOW))
    if name == "gemma3":
        layers = ["sliding_attention", "full_attention"]
        cfg = _llama_sizes(head_dim=16, sliding_window=WINDOW, layer_types=layers)
        return T.Gemma3ForCausalLM, T.Gemma3TextConfig(**cfg)
    if name == "gpt_oss":  # MoE (4 experts, top 2), a sliding and a full layer, attention sinks on both
        cfg = _llama_sizes(head_dim=16, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
        cfg.update(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        return T.GptOssForCausalLM, T.GptOssConfig(**cfg)
    if name == "phi3":
        return T.Phi3ForCausalLM, T.Phi3Config(**_llama_sizes(resid_pdrop=0.0, embd_pdrop=0.0))
    if name == "gpt_neox":
        cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
        return T.GPTNeoXForCausalLM, T.GPTNeoXConfig(**cfg, attention_dropout=0.0, hidden_dropout=0.0)
    if name == "gpt2":
        drop = dict(attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
        ids = dict(bos_token_id=1, eos_token_id=2)
        return T.GPT2LMHeadModel, T.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, **ids, **drop
        )
    if name == "olmo2":
        return T.Olmo2ForCausalLM, T.Olmo2Config(**_llama_sizes())
    if name == "qwen3_moe":  # every layer sparse: 4 experts, top 2 (the router's topk over the (B*L, E) logits)
        cfg = _llama_sizes(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        return T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig(**cfg, decoder_sparse_step=1, mlp_only_layers=[])
    if name == "mixtral":
        cfg = _llama_sizes(num_local_experts=4, num_experts_per_tok=2)
        return T.MixtralForCausalLM, T.MixtralConfig(**cfg)
    if name == "deepseek_v3":  # MLA (q/kv LoRA ranks, a RoPE part of the head), layer 0 dense, layer 1 MoE
        cfg = _llama_sizes(
            q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32,
            first_k_dense_replace=1, n_shared_experts=1, num_key_value_heads=4,
        )  # fmt: skip
        return T.DeepseekV3ForCausalLM, T.DeepseekV3Config(**cfg)
    if name == "llama4":  # MoE every layer (4 experts, top 1, sigmoid router, shared expert), a RoPE and a NoPE
        cfg = _llama_sizes(  # layer (no temperature tuning: it builds positions from the LOCAL length, refused)
            head_dim=16, intermediate_size=32, intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1,
            no_rope_layers=[1, 0], attn_temperature_tuning=False, layer_types=["full_attention"] * 2,
            attention_chunk_size=None,
        )  # fmt: skip
        return T.Llama4ForCausalLM, T.Llama4TextConfig(**cfg)
    if name == "modernbert":  # layer 0 global, layer 1 a bidirectional window of WINDOW tokens each side
        cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
        drop = dict(attention_dropout=0.0, embedding_dropout=0.0, mlp_dropout=0.0)
        ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
        extra = dict(local_attention=2 * WINDOW, global_attn_every_n_layers=2, max_position_embeddings=64)
        return T.ModernBertForMaskedLM, T.ModernBertConfig(**cfg, **drop, **ids, **extra)
    if name == "bert":
        drop = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
        return T.BertForMaskedLM, T.BertConfig(**cfg, max_position_embeddings=64, **drop)
    raise KeyError(name)


MOE = ("qwen3_moe", "mixtral", "deepseek_v3", "llama4")
"""Mixture-of-experts models (DeepSeek-V3 with MLA): the token guard follows their routing unmarked."""
CAUSAL = (
    "llama", "qwen2", "qwen3", "mistral", "mistral_sw", "gemma2", "gemma3", "gpt_oss", "phi3", "gpt_neox", "gpt2",
    "olmo2", *MOE,
)  # fmt: skip
MASKED = ("bert", "modernbert")
"""Masked LMs (bidirectional attention); the rest are causal."""
MODELS = (*CAUSAL, *MASKED)
RUNS: dict[str, tuple[tuple[str, str, int], ...]] = {name: (("zigzag", "all_gather", 2),) for name in MODELS}
"""What tests/parity/test_hf_zoo.py runs each model under: (strategy, comm, ranks); README's table reads it too."""
for _name in ("gemma3", "bert"):  # a2a at 4 ranks: gemma3 has a sliding and a full layer
    RUNS[_name] += (("zigzag", "a2a", 4),)
for _name in ("gemma3", "gpt_oss"):  # windows (and sinks) under the ring
    RUNS[_name] += (("zigzag", "ring", 2),)


def features(name: str) -> list[str]:
    """What a zoo model's attention asks of CP, read off its config (README's table)."""
    _, cfg = _config(name)
    out = ["causal" if name in CAUSAL else "bidirectional"]
    if getattr(cfg, "sliding_window", None) and (getattr(cfg, "use_sliding_window", True) is not False):
        out.append("sliding windows")
    if getattr(cfg, "attn_logit_softcapping", None):
        out.append("softcapped scores")
    if name == "gpt_oss":
        out.append("attention sinks")
    if any(getattr(cfg, a, 0) for a in ("num_local_experts", "num_experts", "n_routed_experts")):
        out.append("MoE")
    if name == "deepseek_v3":
        out.append("MLA")
    if getattr(cfg, "num_key_value_heads", None) not in (None, getattr(cfg, "num_attention_heads", None)):
        out.append("GQA")
    return out


def _gpt_oss_moe(cfg) -> None:
    """GPT-OSS's experts on HF's batched_mm implementation (its default loops over the experts a batch hits, a
    data-dependent graph break). Its MoE block is not marked: the token guard follows the router's top-k over the
    experts and the experts' weight gather."""
    cfg._experts_implementation = "batched_mm"


def build(name: str, attn_implementation: str, seed: int = 0, dtype: torch.dtype = torch.float64, **config):
    """The tiny model `name` with seeded random weights, in `dtype`, in training mode (all dropout is 0);
    `config`: attributes of its config to change."""
    cls, cfg = _config(name)
    for key, value in config.items():
        setattr(cfg, key, value)
    cfg._attn_implementation = attn_implementation
    if name == "gpt_oss":
        _gpt_oss_moe(cfg)
    if name in MOE:  # HF's grouped experts (torch._grouped_mm) take fp32/bf16/fp16 only
        dtype = torch.float32
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype).train()
    if name == "gpt2":  # HF finds no loss_type for GPT2LMHeadModel and logs a warning, which fullgraph cannot trace
        model.loss_type = "ForCausalLM"
    return model


def batch(name: str, batch_size: int, seq: int, seed: int = 1) -> dict:
    """input_ids and labels as a user passes them to an HF model: causal LMs labels = input_ids (the model shifts),
    a masked LM labels at 15% of the tokens, -100 elsewhere; some causal labels ignored (-100) as well."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch_size, seq), generator=g)
    if name in CAUSAL:
        labels = ids.clone()
        labels[torch.rand(batch_size, seq, generator=g) < 0.1] = -100
    else:
        labels = torch.where(torch.rand(batch_size, seq, generator=g) < 0.15, ids, torch.full_like(ids, -100))
        labels[:, 0] = ids[:, 0]  # every rank holds at least one target at cp <= 4
    return {"input_ids": ids, "labels": labels}

"""A tiny Hugging Face Llama (transformers' LlamaForCausalLM, random init: nothing is downloaded) for the demo,
with attn_implementation="cpcompile" (registered by `import cpcompile`), HF's training configuration
(use_cache=False) included. Needs transformers."""

from __future__ import annotations

import torch
import torch.nn as nn

from .model import TinyConfig


def hf_llama(cfg: TinyConfig) -> nn.Module:
    """LlamaForCausalLM with TinyLlama's sizes (cpcompile attention, GQA, RoPE from position_ids)."""
    try:
        import transformers

        import cpcompile  # noqa: F401  (attn_implementation="cpcompile")
    except ImportError as e:
        raise ImportError("the Hugging Face model needs transformers: pip install transformers") from e
    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab,
        hidden_size=cfg.dim,
        intermediate_size=cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        attn_implementation="cpcompile",
    )
    return transformers.LlamaForCausalLM(config)


def hf_logits(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """The logits for this rank's tokens at their GLOBAL position_ids, as in training (use_cache=False)."""
    return model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits

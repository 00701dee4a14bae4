"""A tiny Hugging Face Llama (transformers' LlamaForCausalLM, random init: nothing is downloaded) for the demo,
with attn_implementation="sdpa", so its attention is the SDPA call cpcompile rewrites. Needs transformers."""

from __future__ import annotations

import torch
import torch.nn as nn

from .model import TinyConfig


def hf_llama(cfg: TinyConfig) -> nn.Module:
    """LlamaForCausalLM with TinyLlama's sizes (SDPA attention, GQA, RoPE from position_ids)."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError("the Hugging Face model needs transformers: pip install transformers") from e
    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab,
        hidden_size=cfg.dim,
        intermediate_size=cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def hf_logits(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """The logits for this rank's tokens at their GLOBAL position_ids. use_cache=True: with use_cache=False,
    transformers 5.24 handed SDPA an explicit causal mask tensor here, which cpcompile refuses (a mask cannot be
    sharded); with it, SDPA gets is_causal=True, which cpcompile rewrites."""
    return model(input_ids=input_ids, position_ids=position_ids, use_cache=True).logits

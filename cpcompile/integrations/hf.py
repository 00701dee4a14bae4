"""Hugging Face transformers: `attn_implementation="cpcompile"`, registered through HF's own interfaces.

Under torch.compile HF's "sdpa" implementation builds a 4-D mask whenever it cannot prove it unneeded, and while
tracing it never can (its packed-sequence check on position_ids is data-dependent): every SDPA call then gets an
explicit mask, which cannot be sharded over CP ranks. "cpcompile" follows the contract of HF's flash-attention
implementations instead: the attention call itself carries what the mask would (`is_causal`, `sliding_window`,
`softcap`, `scaling`, `dropout`), and the mask function hands over only the 2-D padding mask.

- attention (`cpcompile_attention`): under torch.compile, one `cpcompile::attention` call (attention_op.py),
  which the pass rewrites into a CP region; windows, softcap, the padding mask and the position ids travel with
  it, so the planner validates them (and a run-time check that every rank holds real tokens at their global
  positions replaces HF's packed-sequence and padding masks, which CP cannot apply). Eagerly (no compile: a
  reference run, generation) it is exactly HF's sdpa attention (the math path for softcap).
- mask (`cpcompile_mask`): eagerly HF's own `sdpa_mask`; under torch.compile the 2-D padding mask (or None) for
  the causal, bidirectional and sliding-window patterns, and HF's 4-D mask for any other pattern (chunked
  attention, image-token overlays, custom mask functions), which a single process runs as sdpa does and CP
  refuses with one clear error (an explicit mask cannot be sharded).
Refused with one CPCompileError: attention sinks (`s_aux`), position biases (under torch.compile through
refusal.py, so that the backend raises it rather than Dynamo wrapping it).
"""

from __future__ import annotations

import types

import torch

from ..attention_op import attention
from ..eager_guard import cp_call_in_progress, eager_attention_error
from ..errors import CPCompileError
from ..refusal import refused

NAME = "cpcompile"
"""The `attn_implementation` name."""


def _module_name(module: torch.nn.Module) -> str:
    layer = getattr(module, "layer_idx", None)
    return f"{type(module).__name__}" + (f" (layer {layer})" if layer is not None else "")


def hf_window(sliding_window: int | None, is_causal: bool, key_length: int) -> tuple[int, int]:
    """The `sliding_window` HF's attention call gets as a (left, right) window, as HF's flash path maps it
    (`(w - 1, w - 1)`, causal cutting the right): causal sees the token and the w - 1 before it (HF's mask
    `kv > q - w`); bidirectional every token within distance w - 1 (ModernBERT passes its config's window + 1,
    and HF's sdpa mask is `|q - kv| <= config.sliding_window`)."""
    if sliding_window is None or key_length <= sliding_window:
        return (-1, -1)  # the window cannot bind (HF's flash path skips it the same way)
    w = int(sliding_window)
    return (w - 1, 0) if is_causal else (w - 1, w - 1)


def _refuse(module: torch.nn.Module, rule: str, fix: str) -> CPCompileError:
    return CPCompileError(
        f'cpcompile cannot run the attention of {_module_name(module)} (attn_implementation="cpcompile"): {rule}. '
        f"Fix: {fix}"
    )


def cpcompile_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF's attention-interface signature: q (B, Hq, Lq, D), k/v (B, Hkv, Lk, D) -> ((B, Lq, Hq, D), None)."""
    refusal = None
    if s_aux is not None:
        refusal = _refuse(
            module,
            "the model uses attention sinks (s_aux), which no cpcompile attention kernel implements",
            'use attn_implementation="eager" without CP',
        )
    elif kwargs.get("position_bias") is not None:
        refusal = _refuse(
            module,
            "the model adds a position bias to the scores (a per-pair tensor, not shardable)",
            "train it without CP",
        )
    if refusal is not None and not torch.compiler.is_compiling():
        raise refusal
    if refusal is not None:  # raised by the backend (refusal.py): Dynamo would wrap a raise here as "Unsupported"
        return refused(query, str(refusal)).transpose(1, 2).contiguous(), None
    is_causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    if not torch.compiler.is_compiling():
        return _eager(module, query, key, value, attention_mask, dropout, scaling, is_causal, softcap, **kwargs)
    if attention_mask is not None and attention_mask.dim() == 4:
        # a pattern only HF's 4-D mask holds (cpcompile_mask): SDPA with it, as HF's sdpa does; CP refuses the mask
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=False,
            enable_gqa=query.shape[1] != key.shape[1],
        )  # fmt: skip
        return out.transpose(1, 2).contiguous(), None
    window = hf_window(sliding_window, is_causal, key.shape[-2])
    out = attention(
        query,
        key,
        value,
        is_causal=is_causal,
        scale=scaling,
        window=window,
        softcap=float(softcap) if softcap else 0.0,
        dropout_p=dropout,
        padding_mask=attention_mask,
        position_ids=position_ids,
    )
    return out.transpose(1, 2).contiguous(), None


def _eager(module, query, key, value, attention_mask, dropout, scaling, is_causal, softcap, **kwargs):
    """No compile: HF's sdpa attention on HF's own mask (cpcompile_mask gave sdpa_mask's), softcap on the math path."""
    if not softcap:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if cp_call_in_progress():
        raise eager_attention_error('attn_implementation="cpcompile" attention')
    lq, lk = query.shape[-2], key.shape[-2]
    mask = attention_mask
    if mask is None and is_causal and lq > 1:
        mask = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(lk - lq)
    groups = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.tanh((query @ k.transpose(-1, -2)) * scale / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask.bool(), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    return (probs @ v).transpose(1, 2).contiguous(), None


def _known_pattern(mask_function, kwargs: dict) -> bool:
    """Whether the mask is causal, bidirectional or sliding-window (with HF's packed-sequence overlay): the
    patterns the attention call expresses itself. Custom overlays (or/and_mask_function: image tokens) make HF
    set use_vmap; blockwise overlays are or_masks; chunked attention is a config field."""
    from transformers import masking_utils as mu

    if kwargs.get("use_vmap"):
        return False
    if getattr(kwargs.get("config"), "attention_chunk_size", None) is not None:
        return False
    if mask_function in (mu.causal_mask_function, mu.bidirectional_mask_function):
        return True
    if not isinstance(mask_function, types.FunctionType):  # (Dynamo: getattr with a default misreads closures)
        return False
    return mask_function.__module__ == mu.__name__ and mask_function.__qualname__ == "and_masks.<locals>.and_mask"


def cpcompile_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
):
    """HF's mask-interface signature. Eagerly: HF's sdpa_mask (4-D bool or None). Under torch.compile: the 2-D
    padding mask of the keys (or None) for the patterns the attention call carries, else sdpa_mask's 4-D mask."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    mask_function = causal_mask_function if mask_function is None else mask_function
    if torch.compiler.is_compiling() and _known_pattern(mask_function, kwargs):
        return None if attention_mask is None else attention_mask[:, -kv_length:]
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        **kwargs,
    )


def register() -> None:
    """Register "cpcompile" in HF's AttentionInterface and AttentionMaskInterface (idempotent).

    HF's mask creation runs its packed-sequence detection (a cumsum over the position ids) before it calls any
    mask function, and under tracing it cannot skip it. Its result only ever reaches a mask: ours drops it (the
    position ids are checked at run time instead), any other becomes an explicit 4-D mask, which the planner
    refuses. So the token guard is told it is token-local rather than refusing dead code."""
    from transformers import masking_utils
    from transformers.modeling_utils import AttentionInterface

    from ..token_local import mark_builtin_token_local

    AttentionInterface.register(NAME, cpcompile_attention)
    masking_utils.AttentionMaskInterface.register(NAME, cpcompile_mask)
    if hasattr(masking_utils, "find_packed_sequence_indices"):
        mark_builtin_token_local(masking_utils.find_packed_sequence_indices)

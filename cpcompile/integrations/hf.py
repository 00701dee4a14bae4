"""Hugging Face transformers: `attn_implementation="cpcompile"`, registered through HF's own interfaces.

Under torch.compile HF's "sdpa" implementation builds a 4-D mask whenever it cannot prove it unneeded, and while
tracing it never can (its packed-sequence check on position_ids is data-dependent): every SDPA call then gets an
explicit mask, which cannot be sharded over CP ranks. "cpcompile" follows the contract of HF's flash-attention
implementations instead: the attention call itself carries what the mask would (`is_causal`, `sliding_window`,
`softcap`, `scaling`, `dropout`, and GPT-OSS's attention sinks `s_aux`), and the mask function hands over only the
2-D padding mask.

- attention (`cpcompile_attention`): under torch.compile, one `cpcompile::attention` call (attention_op.py),
  which the pass rewrites into a CP region; windows, softcap, the padding mask and the position ids travel with
  it, so the planner validates them (and a run-time check that every rank holds real tokens at their global
  positions replaces HF's packed-sequence and padding masks, which CP cannot apply). Eagerly (no compile: a
  reference run, generation) it is exactly HF's sdpa attention (the math path for softcap).
- mask (`cpcompile_mask`): eagerly HF's own `sdpa_mask`; under torch.compile the 2-D padding mask (or None) for
  the causal, bidirectional and sliding-window patterns, and HF's 4-D mask for any other pattern (chunked
  attention, image-token overlays, custom mask functions), which a single process runs as sdpa does and CP
  refuses with one clear error (an explicit mask cannot be sharded).
Refused with one CPCompileError: position biases (under torch.compile through refusal.py, so that the backend
raises it rather than Dynamo wrapping it).
"""

from __future__ import annotations

import types

import torch

from ..attention_op import attention
from ..compat.varlen_gqa import VARLEN_GQA_KWARGS
from ..eager_guard import cp_call_in_progress, eager_attention_error
from ..errors import CPCompileError
from ..refusal import refused
from . import hf_models
from .hf_models import NAME


def _module_name(module: torch.nn.Module) -> str:
    layer = getattr(module, "layer_idx", None)
    return f"{type(module).__name__}" + (f" (layer {layer})" if layer is not None else "")


def hf_window(sliding_window: int | None, is_causal: bool, key_length: int | None) -> tuple[int, int]:
    """The `sliding_window` HF's attention call gets as a (left, right) window, as HF's flash path maps it
    (`(w - 1, w - 1)`, causal cutting the right): causal sees the token and the w - 1 before it (HF's mask
    `kv > q - w`); bidirectional every token within distance w - 1 (ModernBERT passes its config's window + 1,
    and HF's sdpa mask is `|q - kv| <= config.sliding_window`). `key_length`: drop a window that cannot bind
    at this many keys (HF's flash path does); None: keep it."""
    if sliding_window is None or (key_length is not None and key_length <= sliding_window):
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
    if kwargs.get("position_bias") is not None:
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
        return _eager(module, query, key, value, attention_mask, dropout, scaling, is_causal, softcap, s_aux, **kwargs)
    if attention_mask is not None and attention_mask.dim() == 4:
        # a pattern only HF's 4-D mask holds (cpcompile_mask): SDPA with it, as HF's sdpa does; CP refuses the mask
        if s_aux is not None:  # (and the token guard the math path's scores)
            return _eager(module, query, key, value, attention_mask, dropout, scaling, is_causal, softcap, s_aux)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=False,
            enable_gqa=query.shape[1] != key.shape[1],
        )  # fmt: skip
        return out.transpose(1, 2).contiguous(), None
    # never dropped for the LOCAL key length: a window that reaches past the GLOBAL sequence the planner drops
    window = hf_window(sliding_window, is_causal, None)
    if kwargs.get("cu_seq_lens_q") is not None:  # packed documents (shard_batch(hf_packing=True), a collator)
        return _packed(module, query, key, value, window, is_causal, scaling, softcap, s_aux, dropout, kwargs)
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
        sinks=s_aux,
    )
    return out.transpose(1, 2).contiguous(), None


def _packed(module, query, key, value, window, is_causal, scaling, softcap, s_aux, dropout, kwargs):
    """HF's flash-attention kwargs (cu_seq_lens_q/k, max_length_q/k) over one packed row: varlen_attn, which the
    pass runs on the packed layouts (thd_balanced, thd, thd_zigzag). q (1, Hq, T, D) -> ((1, T, Hq, D), None)."""
    from torch.nn.attention.varlen import varlen_attn

    gqa = VARLEN_GQA_KWARGS  # torch 2.11's varlen_attn has no enable_gqa
    if softcap or s_aux is not None or dropout:
        what = "softcapped scores" if softcap else "attention sinks" if s_aux is not None else "attention dropout"
        raise _refuse(
            module,
            f"packed documents run on varlen_attn, which takes no {what}",
            "train this model on unpacked batches (strategy='flat' or 'zigzag')",
        )
    if query.shape[0] != 1:
        raise _refuse(
            module,
            f"cu_seq_lens_q describes one packed row, but the batch has {query.shape[0]} rows",
            "pack the batch into one row (cpcompile.shard_batch(..., hf_packing=True) does)",
        )
    cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs.get("cu_seq_lens_k", kwargs["cu_seq_lens_q"])
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k", kwargs.get("max_length_q"))
    left, right = window
    window_size = (left, 0) if is_causal else (left, right)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    out = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scaling, window_size=window_size, **gqa)
    return out.unsqueeze(0), None


def _eager(module, query, key, value, attention_mask, dropout, scaling, is_causal, softcap, s_aux, **kwargs):
    """No compile: HF's sdpa attention on HF's own mask (cpcompile_mask gave sdpa_mask's); softcap and sinks (a
    sink column in the softmax, dropped after it: GPT-OSS's eager attention) on the math path."""
    if not softcap and s_aux is None:
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
    scores = (query @ k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask.bool(), float("-inf"))
    if s_aux is not None:
        column = s_aux.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, column], -1), dim=-1, dtype=torch.float32)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    probs = probs.to(query.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    return (probs @ v).transpose(1, 2).contiguous(), None


_MASKING_UTILS: list = [None]
"""transformers.masking_utils, bound by register() (the mask functions are only called after it)."""
_AND_MASK_CODE: list = [None]
"""The code of HF's and_masks closures, bound by register(): compared by identity, which every supported
torch's Dynamo traces (torch 2.11 cannot compare a closure's __module__ or trace an import from transformers)."""


def _known_pattern(mask_function, kwargs: dict) -> bool:
    """Whether the mask is causal, bidirectional or sliding-window (with HF's packed-sequence overlay): the
    patterns the attention call expresses itself. Custom overlays (or/and_mask_function: image tokens) make HF
    set use_vmap; blockwise overlays are or_masks; chunked attention is a config field."""
    mu = _MASKING_UTILS[0]  # bound by register(): torch 2.11's Dynamo cannot trace an import from transformers
    if kwargs.get("use_vmap"):
        return False
    if getattr(kwargs.get("config"), "attention_chunk_size", None) is not None:
        return False
    if mask_function in (mu.causal_mask_function, mu.bidirectional_mask_function):
        return True
    if not isinstance(mask_function, types.FunctionType):  # (Dynamo: getattr with a default misreads closures)
        return False
    return mask_function.__code__ is _AND_MASK_CODE[0]  # an and_masks(...) closure (HF's sliding-window masks)


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
    mu = _MASKING_UTILS[0]
    mask_function = mu.causal_mask_function if mask_function is None else mask_function
    if torch.compiler.is_compiling() and _known_pattern(mask_function, kwargs):
        return None if attention_mask is None else attention_mask[:, -kv_length:]
    return mu.sdpa_mask(
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

    _MASKING_UTILS[0] = masking_utils
    _AND_MASK_CODE[0] = masking_utils.and_masks().__code__
    AttentionInterface.register(NAME, cpcompile_attention)
    masking_utils.AttentionMaskInterface.register(NAME, cpcompile_mask)
    if hasattr(masking_utils, "find_packed_sequence_indices"):
        mark_builtin_token_local(masking_utils.find_packed_sequence_indices)
    _declare_experts_token_local()
    hf_models.install()  # models built with "cpcompile": mixers declared, capture hooks, the MoE aux loss


def _declare_experts_token_local() -> None:
    """HF's MoE experts (transformers.integrations.moe) sort the rank's (token, expert) pairs by expert, run each
    expert on its rows (grouped_mm with offsets from a histogram of the pairs) and put the rows back in token
    order: a permutation of this rank's own rows and its inverse, so token-local as a whole, which the guard's
    per-op rules cannot see (the sort and the histogram run over the tokens). Declared here, once."""
    from ..token_local import mark_builtin_token_local

    try:
        from transformers.integrations import moe
    except ImportError:
        return
    for name in ("grouped_mm_experts_forward", "batched_mm_experts_forward"):
        if hasattr(moe, name):
            mark_builtin_token_local(getattr(moe, name))

"""`cpcompile::attention`: one op for the attention SDPA cannot express, which the pass rewrites like SDPA.

SDPA takes no sliding window and no softcap, and a mask tensor cannot be sharded. Models that need those (Hugging
Face's `attn_implementation="cpcompile"`, or any model through `cpcompile.attention`) call this op instead: it
carries the window, the softcap and the token metadata CP must check (a 2-D padding mask, the position ids) as
arguments the planner can read and validate. Dynamo records it as one node; the pass turns it into a CP region
(families/sdpa/match.py). Anywhere else (eager, another backend, a single process) it is CompositeImplicitAutograd:
SDPA with the equivalent mask (or the softcapped math), so autograd and every compiler take it as they are.

Semantics, per batch row, for q rows i of Lq and keys j of Lk (aligned bottom-right: the queries are the LAST Lq
tokens, as with a KV cache; Lq == Lk under CP): key j is visible to row i iff
  - causal: j - i - (Lk - Lq) <= 0, and a window (left, right): -left <= j - i - (Lk - Lq) <= right (-1:
    unbounded; causal forces right = 0);
  - padding_mask (B, >= Lk; its last Lk entries), nonzero = a real token: only real keys are visible;
  - position_ids (B or 1, Lq), with no padding mask and Lq == Lk: positions that do not step by one start a new
    document (Hugging Face's packed sequences), and keys of other documents are not visible.
Scores are `scale * q.k` (default 1/sqrt(D)), then `softcap * tanh(score / softcap)` when softcap > 0. `sinks`
(Hq,), GPT-OSS's attention sinks: one more logit per head in every row's softmax denominator, a key of score
sinks[h] (as it is: not scaled, capped or masked) and value zero. GQA follows the head counts. Under CP the
planner refuses what a CP region cannot run, and a run-time check makes sure the padding mask is all ones and
the position ids are the tokens' global positions (regions/guards.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .eager_guard import cp_call_in_progress, eager_attention_error

SCHEMA = (
    "attention(Tensor query, Tensor key, Tensor value, Tensor? padding_mask=None, Tensor? position_ids=None, "
    "bool is_causal=False, float? scale=None, int window_left=-1, int window_right=-1, float softcap=0.0, "
    "float dropout_p=0.0, Tensor? sinks=None) -> Tensor"
)

_lib = torch.library.Library("cpcompile", "FRAGMENT")
_lib.define(SCHEMA)


def _documents(position_ids: torch.Tensor) -> torch.Tensor:
    """Per token, the index of its document: a new one wherever positions do not step by one (HF's packing)."""
    first = position_ids[..., :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def visible(
    lq: int,
    lk: int,
    *,
    is_causal: bool,
    window: tuple[int, int],
    padding_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor | None:
    """The bool mask (batch or 1, 1, Lq, Lk) of visible keys (True = attend), or None when every key is."""
    left, right = window
    right = 0 if is_causal else right
    mask = None
    if left >= 0 or right >= 0:
        rel = torch.arange(lk, device=device)[None, :] - torch.arange(lq, device=device)[:, None] - (lk - lq)
        band = torch.ones(lq, lk, dtype=torch.bool, device=device)
        if right >= 0:
            band &= rel <= right
        if left >= 0:
            band &= rel >= -left
        mask = band[None, None]
    extra = None
    if padding_mask is not None:  # HF's convention: the mask's last lk entries are the keys' (past + current)
        extra = padding_mask[..., -lk:].bool()[:, None, None, :]
    elif position_ids is not None and lq == lk:
        docs = _documents(position_ids.reshape(-1, lq))
        extra = (docs[:, :, None] == docs[:, None, :])[:, None]
    if extra is not None:
        mask = extra if mask is None else mask & extra
    return mask


def _math(q, k, v, mask, scale, softcap, dropout_p, sinks=None):
    """Math attention for what no fused SDPA kernel takes (tanh-softcapped scores, sinks): scores and softmax in
    at least fp32; a sink is one more term of every row's denominator."""
    acc = torch.promote_types(q.dtype, torch.float32)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        total = torch.logaddexp(torch.logsumexp(scores, dim=-1), sinks.to(acc).view(-1, 1))
        probs = torch.exp(scores - total.unsqueeze(-1))
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    return (probs.to(v.dtype) @ v).to(q.dtype)


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    padding_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    if (  # only a call that computes (the test of compat/eager_attention.guarded_sdpa, inline for the same reason)
        not torch.compiler.is_compiling()
        and type(query) is torch.Tensor
        and query.device.type != "meta"
        and cp_call_in_progress()
    ):
        raise eager_attention_error("cpcompile.attention")
    if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        raise ValueError(
            f"cpcompile.attention: its attention sinks have shape {tuple(sinks.shape)}; they must be one logit a "
            f"query head, ({query.shape[1]},)"
        )
    lq, lk = query.shape[-2], key.shape[-2]
    scale = 1 / math.sqrt(query.shape[-1]) if scale is None else scale
    only_causal = (window_left, window_right) == (-1, -1) and padding_mask is None and position_ids is None
    if softcap == 0 and sinks is None and is_causal and only_causal and lq == lk:
        return F.scaled_dot_product_attention(
            query,
            key,
            value,
            dropout_p=dropout_p,
            is_causal=True,
            scale=scale,
            enable_gqa=query.shape[1] != key.shape[1],
        )
    mask = visible(
        lq,
        lk,
        is_causal=is_causal,
        window=(window_left, window_right),
        padding_mask=padding_mask,
        position_ids=position_ids,
        device=query.device,
    )
    if softcap > 0 or sinks is not None:
        return _math(query, key, value, mask, scale, softcap, dropout_p, sinks)
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=query.shape[1] != key.shape[1]
    )


_lib.impl("attention", _attention, "CompositeImplicitAutograd")

OP = torch.ops.cpcompile.attention
TARGETS = frozenset({OP, OP.default})
"""The node targets the matcher recognises (Dynamo records the packet, aot_autograd the overload)."""


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    padding_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA-shaped attention (q (B, Hq, L, D), k/v (B, Hkv, L, D[v]) -> (B, Hq, L, Dv)) with what SDPA lacks: a
    sliding `window` (left, right) (-1: unbounded; e.g. (w - 1, 0) with is_causal: the token and the w - 1 before
    it), tanh `softcap` of the scores, attention `sinks` (Hq,: one learned logit a head in every row's softmax
    denominator, GPT-OSS), and the token metadata CP checks. The cpcompile backend rewrites it into a CP region;
    elsewhere it is SDPA with the equivalent mask (module docstring)."""
    left, right = window
    return OP(query, key, value, padding_mask, position_ids, is_causal, scale, left, right, softcap, dropout_p, sinks)

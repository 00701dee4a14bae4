"""torchtitan under cpcompile: shard a torchtitan batch for its decoder models (Llama3 and the other `Decoder`s).

torchtitan's own CP takes FlexAttention only, so packed documents (its VarlenAttention) have no CP there. Under
cpcompile they do, but the batch must be what the rewritten attention expects, and getting that wrong by hand
is silent: RoPE needs the GLOBAL positions (with `positions=None` it uses each rank's local 0..L/cp-1), and the
varlen metadata must describe the GLOBAL packed buffer (torchtitan's `get_attention_masks` on a rank's local
positions builds local offsets; the run-time packed check then fails every rank). `shard_batch` builds all of
it from the global batch, on the host, in the data pipeline:

    batch = shard_batch(model, tokens, labels, positions, strategy="thd", mesh=mesh)
    logits = compiled(**batch.inputs)          # tokens=, positions=, attention_masks=
    loss = token_loss_sum(logits, batch.labels) / batch.num_tokens

Packed documents: cu_seqlens is padded to a fixed length and max_q/max_k are a fixed bound, so new documents
never recompile. torchtitan is imported only when a function here needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CPCompileError
from ..layouts import LAYOUTS, THD_LAYOUTS
from ..mesh import resolve_group
from ..sharding import plan_documents, shard
from .rows import check_strategy, pack_rows

ATTENTION_STRATEGIES = {"sdpa": tuple(LAYOUTS), "varlen": tuple(THD_LAYOUTS)}
"""torchtitan inner attention -> the strategies that rewrite it: ScaledDotProductAttention (causal over each
row) takes the chunk layouts, VarlenAttention (packed documents) the packed ones."""


@dataclass
class TitanBatch:
    """This rank's part: `model(**inputs)`, the loss on `labels`, normalised by the global `num_tokens`."""

    inputs: dict[str, Any]
    labels: torch.Tensor
    num_tokens: int
    padding: int


def _torchtitan_attention_classes() -> dict[str, type]:
    try:
        from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention
    except ImportError as e:
        raise CPCompileError(
            f"cpcompile.integrations.torchtitan needs torchtitan (import failed: {e}). Fix: pip install torchtitan; "
            "on a machine without a GPU it also needs triton, which torchtitan's expert-parallel module imports."
        ) from e
    return {"sdpa": ScaledDotProductAttention, "varlen": VarlenAttention, "flex": FlexAttention}


def check_model(model: torch.nn.Module) -> str:
    """The torchtitan inner attention every layer of `model` uses (compiled or not): "sdpa" or "varlen".

    FlexAttention (torchtitan's default, attn_backend="flex"), a mix of kinds, or none raise CPCompileError.
    Nothing of torchtitan's is marked token-local: the token guard follows its RoPE cache lookup
    (`rope_cache[positions]`, a gather at token positions) and refuses the prefix slice it takes without
    positions (`rope_cache[0:seqlen]`, positions of the LOCAL length)."""
    model = getattr(model, "_orig_mod", model)
    classes = _torchtitan_attention_classes()
    found = {kind for m in model.modules() for kind, cls in classes.items() if isinstance(m, cls)}
    if "flex" in found:
        raise CPCompileError(
            "the model uses torchtitan's FlexAttention (attn_backend='flex', torchtitan's default), which cpcompile "
            "does not rewrite (its token guard refuses flex_attention). Fix: build the model with "
            "attn_backend='varlen' for packed documents (strategy 'thd' or 'thd_zigzag'), or set every layer's "
            "attention.inner_attention = ScaledDotProductAttention.Config() for causal attention over each row "
            "(strategy 'flat' or 'zigzag')."
        )
    if len(found) != 1:
        raise CPCompileError(
            f"expected one torchtitan inner attention (ScaledDotProductAttention or VarlenAttention) in the model, "
            f"found {sorted(found) or 'none'}. Fix: pass the torchtitan Decoder (e.g. Llama3Model) whose layers "
            "all use one of them."
        )
    return found.pop()


def varlen_metadata(cu_seqlens: torch.Tensor, max_seqlen: int):
    """torchtitan's VarlenMetadata for the GLOBAL offsets: what VarlenAttention reads from attention_masks."""
    from torchtitan.models.common.attention import VarlenMetadata

    return VarlenMetadata(cu_seq_q=cu_seqlens, cu_seq_k=cu_seqlens, max_q=max_seqlen, max_k=max_seqlen)


def _check_rope(model: torch.nn.Module, positions: torch.Tensor) -> None:
    """RoPE gathers its cache at each position; torchtitan checks the bound only outside torch.compile."""
    config = getattr(getattr(model, "_orig_mod", model), "config", None)
    try:
        limit = config.max_seq_len
    except (AttributeError, ValueError):
        return
    top = int(positions.max()) if positions.numel() else 0
    if top >= limit:
        raise CPCompileError(
            f"positions reach {top}, past the model's RoPE cache of max_seq_len={limit} (torchtitan does not check "
            "it under torch.compile). Fix: pass per-document positions below max_seq_len, or raise it."
        )


def shard_batch(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    positions: torch.Tensor | None = None,
    *,
    strategy: str,
    mesh=None,
    group=None,
    max_documents: int | None = None,
    ignore_index: int = -100,
    pad_id: int = 0,
) -> TitanBatch:
    """This rank's part of a GLOBAL torchtitan batch (tokens, labels and positions (batch, seq); positions None:
    0..seq-1 per row), for `model` compiled with cpcompile.backend(strategy=strategy, ...).

    The strategy must fit the model's attention: ScaledDotProductAttention takes "flat" / "zigzag" (causal over
    each row; it ignores documents), VarlenAttention "thd" / "thd_zigzag" / "thd_balanced" (causal within each
    document, where positions reset to 0 or a row starts). Padding and offsets: integrations.rows.pack_rows.
    inputs holds tokens=, the GLOBAL positions of this rank's tokens, and attention_masks= (packed: VarlenMetadata
    of the GLOBAL offsets, thd_balanced's with this batch's plan, the same on every rank; SDPA: None)."""
    check_strategy(strategy)
    kind = check_model(model)
    if strategy not in ATTENTION_STRATEGIES[kind]:
        raise CPCompileError(
            f"strategy {strategy!r} does not fit the model's torchtitan {kind} attention, which takes "
            f"{' or '.join(map(repr, ATTENTION_STRATEGIES[kind]))}. Fix: use one of those, here and in "
            "cpcompile.backend(strategy=...)."
        )
    cp = resolve_group(mesh, group)
    full = pack_rows(
        tokens,
        labels,
        positions,
        strategy=strategy,
        cp=cp.size,
        max_documents=max_documents,
        ignore_index=ignore_index,
        pad_id=pad_id,
    )
    _check_rope(model, full.positions)
    cu = full.cu_seqlens  # thd_balanced: the offsets and this batch's plan, made once, for shard and the model
    cu = None if cu is None else plan_documents(cu, strategy=strategy, mesh=mesh, group=group)
    local = [
        shard(t, strategy=strategy, seq_dim=1, mesh=mesh, group=group, cu_seqlens=cu)
        for t in (full.tokens, full.labels, full.positions)
    ]
    masks = None
    if cu is not None:
        masks = varlen_metadata(cu.to(tokens.device), full.max_seqlen)
    inputs = {"tokens": local[0], "positions": local[2], "attention_masks": masks}
    return TitanBatch(inputs=inputs, labels=local[1], num_tokens=full.num_tokens, padding=full.padding)


__all__ = [
    "ATTENTION_STRATEGIES",
    "TitanBatch",
    "check_model",
    "shard_batch",
    "varlen_metadata",
]

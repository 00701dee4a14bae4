"""shard_batch: shard every per-token entry of a batch dict, pass known metadata through, refuse the unknown."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from ..errors import CPCompileError
from ..layouts import THD_LAYOUTS
from .api import is_packed, shard
from .conventions import with_hf_labels, with_position_ids
from .hf_packing import flash_kwargs, hf_documents
from .packed import plan_documents

SEQUENCE_KEYS = frozenset(
    {
        "input_ids",
        "labels",
        "position_ids",
        "loss_mask",
        "attention_mask",
        "token_type_ids",
        "inputs_embeds",
        "target_ids",
        "shift_labels",
    }
)
"""Batch entries that carry the sequence dim and are sharded like the tokens."""

METADATA_KEYS = frozenset({"num_items_in_batch", "cu_seqlens", "max_seqlen", "use_cache", "return_dict"})
"""Tensor batch entries that are not per-token and pass through unchanged."""


def shard_batch(
    batch: Mapping[str, object],
    *,
    strategy: str,
    mesh=None,
    group=None,
    seq_dim: int = 1,
    seq_keys: Iterable[str] = (),
    passthrough_keys: Iterable[str] = (),
    cu_seqlens: torch.Tensor | None = None,
    position_ids: bool = True,
    hf_loss: str | None = None,
    ignore_index: int = -100,
    hf_packing: bool = False,
) -> dict[str, object]:
    """Shard every per-token tensor of a batch; pass metadata and non-tensors through; refuse the unknown.

    Per-token keys: SEQUENCE_KEYS plus `seq_keys`. Passed through: METADATA_KEYS plus `passthrough_keys`,
    0-dim tensors and non-tensors. Any other tensor raises, since guessing wrong silently corrupts training.
    Packed documents ("thd", "thd_zigzag", "thd_balanced"): the layout follows cu_seqlens= or else
    batch["cu_seqlens"]. thd / thd_zigzag keep batch["cu_seqlens"] unchanged (the model gets the GLOBAL
    offsets); thd_balanced plans the batch once (plan_documents) and returns the plan as batch["cu_seqlens"]
    (added when the batch had none), which the model must get in place of the offsets.

    Made from the global batch before sharding (sharding/conventions.py): position_ids when the batch has none
    (`position_ids=False`: never; per document for packed layouts), and for Hugging Face's own `labels=` loss
    (`hf_loss`): "causal_lm" adds `shift_labels` (the global labels shifted by one, so the model shifts nothing)
    and both "causal_lm" and "masked_lm" add `num_items_in_batch` (the global count of targets != ignore_index),
    so each rank's `model(**batch).loss` is its share of the global mean: sum it (and the gradients) over ranks.

    `hf_packing=True` (a packed strategy, thd_balanced for documents of any length): HF's packed or padded batch
    (restarting position_ids, a padding attention_mask, or a collator's cu_seq_lens_q) becomes one packed row of
    documents (sharding/hf_packing.py); the model gets HF's flash-attention kwargs (cu_seq_lens_q/k: the offsets,
    or thd_balanced's plan; max_length_q/k) and attn_implementation="cpcompile" runs varlen_attn on them.
    """
    flash: dict = {}
    if hf_packing:
        if strategy not in THD_LAYOUTS:
            raise CPCompileError(
                f"shard_batch(hf_packing=True, strategy={strategy!r}): packed documents need a packed layout. "
                f"Fix: strategy='thd_balanced' (documents of any length) or one of {sorted(THD_LAYOUTS)}."
            )
        if hf_loss is not None:  # shifted per row, before the rows are packed into one
            batch, hf_loss = with_hf_labels(dict(batch), seq_dim, hf_loss, ignore_index), None
        batch, cu_seqlens = hf_documents(dict(batch), seq_dim, SEQUENCE_KEYS | set(seq_keys))
        offsets = cu_seqlens
    if strategy in THD_LAYOUTS and cu_seqlens is None:
        cu_seqlens = batch.get("cu_seqlens")
    if not isinstance(seq_dim, int) or seq_dim < 0:
        raise CPCompileError(
            f"shard_batch(seq_dim={seq_dim!r}): the batch's tensors have different ranks (input_ids (batch, seq), "
            "inputs_embeds (batch, seq, hidden)), so a negative dim would name a different dim in each. "
            "Fix: pass the non-negative index of the sequence dim (1 for (batch, seq, ...), 0 for packed tokens)."
        )
    packed = is_packed(strategy, cu_seqlens, "shard_batch")
    if position_ids and (not packed or isinstance(cu_seqlens, torch.Tensor)):  # from the offsets, before any plan
        batch = with_position_ids(dict(batch), seq_dim, cu_seqlens if packed else None)
    if packed and THD_LAYOUTS[strategy].carries_plan:
        cu_seqlens = plan_documents(cu_seqlens, strategy=strategy, mesh=mesh, group=group)  # once for every key
        if not hf_packing:
            batch = {**batch, "cu_seqlens": cu_seqlens}
    if hf_packing:
        flash = flash_kwargs(cu_seqlens, offsets)
    if hf_loss is not None:
        batch = with_hf_labels(dict(batch), seq_dim, hf_loss, ignore_index)
    seq = SEQUENCE_KEYS | set(seq_keys)
    meta = METADATA_KEYS | set(passthrough_keys)
    out: dict[str, object] = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or key in meta or (value.dim() == 0 and key not in seq):
            out[key] = value
        elif key in seq:
            if value.dim() <= seq_dim:
                raise CPCompileError(
                    f"batch[{key!r}] has shape {tuple(value.shape)}, with no sequence dim {seq_dim}. "
                    "Fix: pass seq_dim= to match the batch layout."
                )
            out[key] = shard(value, strategy=strategy, seq_dim=seq_dim, mesh=mesh, group=group, cu_seqlens=cu_seqlens)
        else:
            raise CPCompileError(
                f"shard_batch does not know whether batch[{key!r}] (shape {tuple(value.shape)}) is per-token. "
                f"Fix: name it in seq_keys=[{key!r}] to shard it or passthrough_keys=[{key!r}] to keep it whole."
            )
    return {**out, **flash}

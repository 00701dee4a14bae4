"""Batch conventions shard_batch applies to the GLOBAL batch before it shards: what a model needs that only the
whole sequence can give (sharding.batch).

- position ids: a model left without them makes 0..L-1 from each rank's local length (HF does): wrong on every
  rank but one. They are made here from the global sequence (per document for packed layouts: restarting at each
  cu_seqlens offset) and then sharded like the tokens.
- labels for Hugging Face's own loss: a causal LM shifts `labels` by one inside the model, which under CP shifts
  within each rank's shard (and the token guard refuses it). HF takes `shift_labels` already shifted: made here
  by shifting the GLOBAL labels (exactly as HF does, ignore_index at the end), so no shift happens in the model.
  `num_items_in_batch`, the global count of real targets, makes HF's loss each rank's share of the global mean
  (its sum over the rank's tokens / the global count): summed over ranks it is the single-process loss, and the
  parameter gradients summed over ranks are the single-process gradients.
"""

from __future__ import annotations

import torch

from ..errors import CPCompileError

HF_LOSSES = ("causal_lm", "masked_lm")
TOKEN_KEYS = ("input_ids", "inputs_embeds")
"""Entries whose shape gives the positions' (batch, sequence) shape, the first one present."""


def document_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Per token of a packed buffer, its position inside its document."""
    tokens = torch.arange(total, device=cu_seqlens.device)
    cu = cu_seqlens.long()
    doc = torch.searchsorted(cu, tokens, right=True) - 1
    return tokens - cu[doc.clamp(max=cu.numel() - 1)]


def with_position_ids(batch: dict, seq_dim: int, cu_seqlens: torch.Tensor | None) -> dict:
    """`batch` with global position_ids added when it has none (and has a token entry to shape them after)."""
    if "position_ids" in batch:
        return batch
    ref = next((batch[k] for k in TOKEN_KEYS if isinstance(batch.get(k), torch.Tensor)), None)
    if ref is None or ref.dim() <= seq_dim:
        return batch
    length = ref.shape[seq_dim]
    flat = torch.arange(length, device=ref.device) if cu_seqlens is None else document_positions(cu_seqlens, length)
    shape = tuple(ref.shape[: seq_dim + 1])
    positions = flat.to(ref.device).reshape((1,) * seq_dim + (length,)).expand(shape)
    return {**batch, "position_ids": positions}


def _shift(labels: torch.Tensor, seq_dim: int, ignore_index: int) -> torch.Tensor:
    """labels[t + 1] at t along seq_dim, ignore_index at the end (HF's ForCausalLMLoss shift, done globally)."""
    end = torch.full_like(labels.narrow(seq_dim, 0, 1), ignore_index)
    return torch.cat([labels.narrow(seq_dim, 1, labels.shape[seq_dim] - 1), end], dim=seq_dim)


def with_hf_labels(batch: dict, seq_dim: int, hf_loss: str, ignore_index: int) -> dict:
    """`batch` with `shift_labels` (causal_lm) and `num_items_in_batch` for HF's own loss under CP."""
    if hf_loss not in HF_LOSSES:
        raise CPCompileError(f"shard_batch(hf_loss={hf_loss!r}): unknown. Fix: use one of {list(HF_LOSSES)} or None.")
    labels = batch.get("labels")
    if not isinstance(labels, torch.Tensor) or labels.dim() <= seq_dim:
        raise CPCompileError(
            f"shard_batch(hf_loss={hf_loss!r}) needs batch['labels'] with the sequence on dim {seq_dim}, got "
            f"{None if labels is None else tuple(getattr(labels, 'shape', ()))}. Fix: put the unshifted token labels "
            "in the batch (HF's convention: labels = input_ids, ignore_index where no loss)."
        )
    out = dict(batch)
    targets = labels
    if hf_loss == "causal_lm":
        if "shift_labels" in batch:
            raise CPCompileError(
                "shard_batch(hf_loss='causal_lm') makes shift_labels from labels, but the batch has shift_labels "
                "already. Fix: pass one of them (drop hf_loss= to shard your own shift_labels as they are)."
            )
        targets = out["shift_labels"] = _shift(labels, seq_dim, ignore_index)
    if "num_items_in_batch" not in out:
        out["num_items_in_batch"] = (targets != ignore_index).sum()
    return out

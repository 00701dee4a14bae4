"""Hugging Face's packed and padded batches as packed documents (shard_batch(..., hf_packing=True)), on the host.

HF marks documents three ways, none of which CP can apply inside the model (a rank sees only its tokens):
- a collator's flash-attention kwargs `cu_seq_lens_q/k` and `max_length_q/k` (DataCollatorWithFlattening with
  return_flash_attn_kwargs=True): the GLOBAL offsets as they are;
- `position_ids` restarting per document (DataCollatorWithFlattening, TRL's padding_free): a new document wherever
  the positions do not step by one (HF's own rule), and at every row start;
- a padding `attention_mask` (B, L): each row's runs of real tokens and of padding become documents of one packed
  row of B * L tokens (padding attends only to padding; its labels carry no loss), and the mask is dropped.
The batch then becomes one packed row (1, T) whose GLOBAL cu_seqlens shard_batch lays out with a packed strategy;
the model gets them as HF's own flash-attention kwargs, which attn_implementation="cpcompile" turns into varlen_attn.
"""

from __future__ import annotations

import torch

from ..errors import CPCompileError

FLASH_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""HF's flash-attention kwargs for packed documents (transformers.modeling_flash_attention_utils)."""


def _flat(x: torch.Tensor) -> torch.Tensor:
    """(B, L, ...) -> (1, B * L, ...): rows one after another."""
    return x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:])


def _starts(ids: torch.Tensor) -> torch.Tensor:
    """cu_seqlens (int32) of the runs of equal values of a 1-D tensor."""
    change = torch.ones_like(ids, dtype=torch.bool)
    change[1:] = ids[1:] != ids[:-1]
    starts = change.nonzero().flatten()
    return torch.cat([starts, torch.tensor([ids.numel()], device=ids.device)]).to(torch.int32)


def hf_documents(batch: dict, seq_dim: int, seq_keys: frozenset) -> tuple[dict, torch.Tensor]:
    """(the batch as one packed row without its padding mask or flash kwargs, the GLOBAL cu_seqlens)."""
    if seq_dim != 1:
        raise CPCompileError(
            f"shard_batch(hf_packing=True, seq_dim={seq_dim}): HF batches are (batch, seq, ...). Fix: seq_dim=1."
        )
    out = {k: v for k, v in batch.items() if k not in FLASH_KEYS}
    cu = batch.get("cu_seq_lens_q")
    if cu is not None:
        if not torch.equal(cu, batch.get("cu_seq_lens_k", cu)):
            raise CPCompileError(
                "shard_batch(hf_packing=True): cu_seq_lens_q and cu_seq_lens_k differ; CP packs self-attention "
                "only. Fix: pass the same offsets for both (HF's collators do)."
            )
        return out, cu.to(torch.int32)
    mask = out.pop("attention_mask", None)
    ref = out.get("input_ids", out.get("inputs_embeds"))
    if ref is None:
        raise CPCompileError("shard_batch(hf_packing=True) needs input_ids or inputs_embeds. Fix: pass the tokens.")
    rows, length = ref.shape[0], ref.shape[1]
    row = torch.arange(rows, device=ref.device).repeat_interleave(length)
    if mask is not None and not bool(mask.bool().all()):
        if "position_ids" not in out:  # HF's positions without ids: 0..L-1 per row, padding included
            out["position_ids"] = torch.arange(length, device=ref.device).expand(rows, length)
        doc = row * 2 + mask.bool().reshape(-1).long()  # runs of real tokens and of padding, per row
    elif "position_ids" in out:
        pos = out["position_ids"].reshape(-1)
        new = torch.ones_like(pos, dtype=torch.bool)
        new[1:] = (pos[1:] - pos[:-1] != 1) | (row[1:] != row[:-1])
        doc = new.long().cumsum(0)
    else:
        raise CPCompileError(
            "shard_batch(hf_packing=True): the batch marks no documents (no cu_seq_lens_q, no position_ids, no "
            "attention_mask with padding). Fix: pass the collator's position_ids (DataCollatorWithFlattening) or "
            "drop hf_packing for one unpacked sequence."
        )
    packed = {
        k: _flat(v) if isinstance(v, torch.Tensor) and k in seq_keys and v.dim() > 1 else v for k, v in out.items()
    }
    return packed, _starts(doc)


def flash_kwargs(cu_for_model: torch.Tensor, offsets: torch.Tensor) -> dict:
    """HF's flash-attention kwargs for the model: the offsets (or thd_balanced's plan) and the longest document."""
    longest = int((offsets[1:] - offsets[:-1]).max()) if offsets.numel() > 1 else 0
    return {
        "cu_seq_lens_q": cu_for_model,
        "cu_seq_lens_k": cu_for_model,
        "max_length_q": longest,
        "max_length_k": longest,
    }

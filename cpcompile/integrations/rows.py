"""A (batch, seq) batch with per-document positions, made ready for a layout on cp ranks, on the host: rows
padded for the chunk layouts; for packed documents, the rows flattened into one packed buffer with its global
document offsets, padded so that its shapes never change with the documents. The framework adapters
(integrations/torchtitan.py) and the demo's packed-documents run share it; nothing here imports a framework.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import CPCompileError
from ..layouts import LAYOUTS, THD_LAYOUTS, get_layout, get_packed_layout
from ..sharding import pad_cu_seqlens, pad_documents


@dataclass
class GlobalBatch:
    """The padded global batch every rank starts from (before sharding)."""

    tokens: torch.Tensor
    """(B, L') for the chunk layouts; (1, T) for packed documents: the rows flattened into one packed buffer
    (what a model that reshapes (B, L) to B*L packed tokens sees, e.g. torchtitan's VarlenAttention)."""
    labels: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor | None
    """packed: global document offsets into the flattened buffer, padded to max_documents + 2 entries."""
    max_seqlen: int | None
    """packed: max_q/max_k, a bound fixed by the shapes (not the batch's longest document)."""
    padding: int
    """tokens of padding added (pad_id, position 0, label ignore_index)."""
    num_tokens: int
    """labels that count (not ignore_index), over the whole global batch: divide the summed loss by it."""


def document_offsets(positions: torch.Tensor) -> torch.Tensor:
    """Global cu_seqlens (int32) of the (B, L) rows flattened into one buffer: a document starts wherever a
    position is 0 and at every row start (rows never attend to each other, as in torchtitan's masks)."""
    b, length = positions.shape
    starts = positions == 0
    starts[:, 0] = True
    flat = torch.nonzero(starts.flatten()).flatten()
    return torch.cat((flat, flat.new_tensor([b * length]))).to(torch.int32)


def check_strategy(strategy: str) -> None:
    if strategy not in (*LAYOUTS, *THD_LAYOUTS):
        raise CPCompileError(f"unknown strategy {strategy!r}. Fix: use one of {sorted((*LAYOUTS, *THD_LAYOUTS))}.")


def _check_inputs(tokens, labels, positions, strategy: str) -> torch.Tensor:
    check_strategy(strategy)
    if tokens.dim() != 2 or labels.shape != tokens.shape:
        raise CPCompileError(
            f"torchtitan batches are (batch, seq): got tokens {tuple(tokens.shape)} and labels "
            f"{tuple(labels.shape)}. Fix: pass the GLOBAL (unsharded) tokens and labels, both (batch, seq)."
        )
    if positions is None:
        return torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    if positions.shape != tokens.shape or positions.is_floating_point() or bool((positions < 0).any()):
        raise CPCompileError(
            f"positions must be the GLOBAL per-token positions, non-negative integers shaped like tokens "
            f"{tuple(tokens.shape)}; got {positions.dtype} {tuple(positions.shape)}. Fix: pass the batch's "
            "positions before sharding (0 where a packed document starts), or None for 0..seq-1 in every row."
        )
    return positions


def _pad_end(x: torch.Tensor, extra: int, value: int) -> torch.Tensor:
    return F.pad(x, (0, extra), value=value) if extra else x


def pack_rows(
    tokens: torch.Tensor,
    labels: torch.Tensor,
    positions: torch.Tensor | None = None,
    *,
    strategy: str,
    cp: int,
    max_documents: int | None = None,
    ignore_index: int = -100,
    pad_id: int = 0,
) -> GlobalBatch:
    """Pad the GLOBAL batch for `strategy` on `cp` ranks and, for packed documents, build its global offsets.

    flat / zigzag: each row is padded at its end to the layout's multiple (cp, 2*cp). thd / thd_zigzag /
    thd_balanced: the rows are flattened into one packed buffer (1, B*L); thd and thd_balanced pad it to a
    multiple of cp (one more document; thd_balanced's plan is made from these offsets by plan_documents),
    thd_zigzag pads every document to a multiple of 2*cp and the buffer to a length fixed by `max_documents`.
    cu_seqlens always has max_documents + 2 entries (default max_documents for thd: B*L, every token could
    start a document; thd_zigzag needs it given, as it sizes the padded buffer), so neither its shape nor the
    packed length changes between batches of one shape: no recompiles. Padding tokens are `pad_id` at position 0
    with label `ignore_index`; under causal attention no real token sees them.
    """
    positions = _check_inputs(tokens, labels, positions, strategy)
    num_tokens = int((labels != ignore_index).sum())
    rows, length = tokens.shape
    if strategy in LAYOUTS:
        extra = -length % get_layout(strategy).required_multiple(cp)
        padded = [_pad_end(t, extra, v) for t, v in ((tokens, pad_id), (labels, ignore_index), (positions, 0))]
        return GlobalBatch(*padded, cu_seqlens=None, max_seqlen=None, padding=extra * rows, num_tokens=num_tokens)
    total = rows * length
    cu = document_offsets(positions)
    flat = [t.reshape(1, total) for t in (tokens, labels, positions)]
    docs = cu.numel() - 1
    any_length = get_packed_layout(strategy).doc_multiple_per_cp == 0  # thd, thd_balanced
    if max_documents is None and any_length:
        max_documents = total
    if not isinstance(max_documents, int) or max_documents < 1:
        raise CPCompileError(
            f"strategy {strategy!r} needs max_documents=, the most documents a batch can hold (got "
            f"{max_documents!r}): it pads every document to a multiple of 2*cp={2 * cp} and the packed buffer to a "
            "length fixed by it, so batches never recompile. Fix: pass max_documents=<an upper bound>."
        )
    if docs > max_documents:
        raise CPCompileError(
            f"this batch holds {docs} documents (rows and position resets), more than max_documents="
            f"{max_documents}. Fix: pass a larger max_documents (a new value recompiles once)."
        )
    if any_length:
        fixed = total + (-total % get_packed_layout(strategy).required_multiple(cp))
        max_seqlen = max(length, fixed - total)
    else:
        multiple = get_packed_layout(strategy).doc_multiple_per_cp * cp
        padded_docs = [pad_documents(t, cu, multiple, dim=1, value=v) for t, v in zip(flat, (pad_id, ignore_index, 0))]
        flat, cu = [t for t, _ in padded_docs], padded_docs[0][1]
        row = length + (-length % multiple)
        fixed = total + max_documents * (multiple - 1)
        fixed += -fixed % multiple
        max_seqlen = max(row, fixed - (total + (-total % multiple)))
    extra = fixed - flat[0].shape[1]
    flat = [_pad_end(t, extra, v) for t, v in zip(flat, (pad_id, ignore_index, 0))]
    cu = pad_cu_seqlens(cu, fixed, max_documents + 2)
    return GlobalBatch(*flat, cu_seqlens=cu, max_seqlen=max_seqlen, padding=fixed - total, num_tokens=num_tokens)


__all__ = ["GlobalBatch", "check_strategy", "document_offsets", "pack_rows"]

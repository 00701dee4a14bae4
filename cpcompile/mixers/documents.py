"""Packed documents under state passing: where one chunk's documents start, from the GLOBAL offsets (pure index
math on the device that holds them, static shapes, no host sync: the regions trace it into the graph).

A declared mixer that takes documents (`token_mixer(..., documents="cu_seqlens")`, flash-linear-attention's
convention: batch 1, offsets of its own input, one initial and one final state a document) resets its state and
its conv window at every document start INSIDE its input. State passing hands it one chunk at a time, so what
crosses a chunk edge is the region's to cut:
- a conv's halo (the `context` tokens before the chunk) is put in front of the chunk with the offsets moved by
  the same amount (`chunk_offsets(..., lead=context)`): halo tokens of an earlier document are another document
  of the mixer's input, which its own reset keeps out of the chunk's outputs;
- a linear recurrence gets the initial state [0 | I] (the chunk's transition) only for the document that began
  BEFORE the chunk and runs into it (`carried`), zeros for every other one, so only that first segment reads the
  incoming state (a chunk that begins at a document start reads none), and the state it passes on is the final
  state of the document holding its last token (`containing`): [B | M] when that is the same document, else
  [B | 0] (its state-carrying part zero: it does not depend on the incoming state).
Empty documents (repeated offsets, e.g. cpcompile.pad_cu_seqlens's padding, or documents outside the chunk, moved
to its edges) reach the mixer as zero-length documents: it must accept them, as fla's functions do.
"""

from __future__ import annotations

import torch


def chunk_offsets(cu: torch.Tensor, start: int, length: int, lead: int = 0) -> torch.Tensor:
    """The offsets, as the mixer's input sees them, of the GLOBAL tokens [start - lead, start + length) (a chunk
    with `lead` tokens put before it): every offset moved by start - lead and clamped into the input; the first is
    0, so tokens before the sequence's first (a halo's zeros before chunk 0) join the first document, as zero
    padding."""
    local = (cu - (start - lead)).clamp(0, length + lead)
    return torch.cat([torch.zeros_like(local[:1]), local[1:]])


def carried(cu: torch.Tensor, start: int) -> torch.Tensor:
    """(documents,) bool: the document that began before token `start` and holds it (none where a document
    starts at `start`, or at start 0)."""
    return (cu[:-1] < start) & (cu[1:] > start)


def containing(cu: torch.Tensor, position: int) -> torch.Tensor:
    """(1,) int64: the index of the document holding token `position` (a non-empty one)."""
    return ((cu[:-1] <= position) & (cu[1:] > position)).long().argmax().reshape(1)

"""Which tensors hold a rank's tokens, and where: the marks the token guard reads for a graph with no attention.

A graph with an attention site tells the guard its local length (the site's q); a graph without one (a separate
compiled loss, the part of a model after a graph break) does not, and a cumsum or conv over tokens there would run
silently on this rank's tokens alone. So the tensors that hold tokens say so themselves, by a mark kept beside them
(a weak map: the mark dies with the tensor, nothing is stored on it, Dynamo sees nothing):

- `cpcompile.shard` / `shard_batch` mark what they return: the token dim, the layout and the CP size;
- a graph the backend compiled marks its outputs that hold tokens (the guard's tags of its outputs) every time it
  runs, so the next graph of the same frame after a graph break, or another compiled function fed those outputs,
  knows where their tokens are (a few weak-map writes a call: about a microsecond each, no device work).

The guard reads the marks of a graph's inputs at compile time (Dynamo keeps a weak reference to each real input).
This module imports only torch: sharding writes marks, the guard and the backend read them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

OUTPUTS_META = "cpcompile_token_outputs"
"""GraphModule.meta key: (index, parts) of the graph's outputs that hold tokens, written by the guard
(guard/check.py), read by the backend, which marks them when the compiled graph runs (marking_outputs)."""

Parts = tuple[tuple[int, int, int], ...]
"""The token axis as the guard's tag parts (dim, lo, hi): guard/tags.py's Seq, without importing the guard."""


@dataclass(frozen=True)
class TokenMark:
    """Where a tensor holds this rank's tokens (`parts`), and the sharding that put them there: the layout
    (`strategy`) and the CP size (`world`), or None for tokens handed on by a compiled graph (same as its input)."""

    parts: Parts
    strategy: str | None = None
    world: int | None = None

    @property
    def length(self) -> int:
        """The local token count (the product of the parts' token factors)."""
        count = 1
        for _, lo, hi in self.parts:
            count *= hi // lo
        return count


_MARKS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def mark_sharded(t: torch.Tensor, seq_dim: int, strategy: str, world: int) -> torch.Tensor:
    """Mark `t` (what shard returned) as this rank's tokens on `seq_dim`, sharded by `strategy` over `world`."""
    _MARKS[t] = TokenMark(((seq_dim, 1, t.shape[seq_dim]),), strategy, world)
    return t


def token_mark(t: object) -> TokenMark | None:
    """The mark of `t`, if it still fits its shape (a tensor resized in place has lost it)."""
    if not isinstance(t, torch.Tensor):
        return None
    mark = _MARKS.get(t)
    if mark is None:
        return None
    for dim, lo, hi in mark.parts:
        if dim >= t.dim() or hi > t.shape[dim] or t.shape[dim] % hi or hi % lo:
            return None
    return mark


def marking_outputs(fn: Callable, outputs: Sequence[tuple[int, Parts]]) -> Callable:
    """`fn` (a compiled graph), marking after each call its outputs at the given indices as holding tokens on the
    given parts (what the guard found for them): the next graph fed them knows where their tokens are."""
    if not outputs:
        return fn
    marks = [(i, TokenMark(parts)) for i, parts in outputs]

    def run(*args):
        out = fn(*args)
        for i, mark in marks:
            value = out[i]
            if isinstance(value, torch.Tensor):
                _MARKS[value] = mark
        return out

    run.__wrapped__ = fn  # type: ignore[attr-defined]
    return run

"""The executor ops' block encodings: layouts' blocks in, flat int lists out (custom ops take int lists), and back.

Dense blocks (layouts.Block) travel as six ints each (their windows, if any, as two more ints each in a list of
their own), varlen blocks (layouts.thd.VarlenBlock) as nine ints
each plus one ranges tensor. Each encoder sits beside its decoder, so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from ..layouts.block import NO_WINDOW

BlockTuple = tuple[int, int, int, int, int, bool]
"""A decoded dense block: (q_start, q_len, source, kv_start, kv_len, causal)."""

DENSE_FIELDS = 6
VARLEN_FIELDS = 9


def encode_dense(blocks: Iterable) -> list[int]:
    """Six ints per layouts.Block: q_start, q_len, source, kv_start, kv_len, causal."""
    return [i for b in blocks for i in (b.q_start, b.q_len, b.source, b.kv_start, b.kv_len, int(b.causal))]


def decode_dense(ints: Sequence[int]) -> list[BlockTuple]:
    """Inverse of encode_dense."""
    fields = [ints[i : i + DENSE_FIELDS] for i in range(0, len(ints), DENSE_FIELDS)]
    return [(a, b, c, d, e, bool(f)) for a, b, c, d, e, f in fields]


def encode_windows(blocks: Sequence) -> list[int] | None:
    """Two ints per layouts.Block, its window's left and right (-1, -1: none), or None when no block has one:
    the executor then gets no windows argument at all, so graphs without windows stay as they were."""
    if all(b.window is None for b in blocks):
        return None
    return [i for b in blocks for i in (b.window or NO_WINDOW)]


def decode_windows(ints: Sequence[int] | None, count: int) -> list[tuple[int, int] | None]:
    """Inverse of encode_windows: per block its window, or None."""
    if ints is None:
        return [None] * count
    pairs = [(ints[i], ints[i + 1]) for i in range(0, len(ints), 2)]
    return [None if w == NO_WINDOW else w for w in pairs]


class VarlenSpec(NamedTuple):
    """A decoded varlen block (its ranges travel separately, as a tensor)."""

    source: int
    causal: bool
    max_q: int
    max_k: int
    window: tuple[int, int]
    covers_rows: bool
    covers_keys: bool
    square: bool = False

    def kernel_kwargs(self) -> dict:
        """The provider's keyword arguments: `window` only with a window (providers without sliding windows
        keep their plain signature), `tiled` only when the block covers every row and every key (its ranges
        then tile both buffers: cu_seqlens without gap sequences), `square` only when every range is square
        and masked (causal or windowed: without a band the anchor means nothing)."""
        kwargs = {} if self.window == NO_WINDOW else {"window": self.window}
        if self.covers_rows and self.covers_keys:
            kwargs["tiled"] = True
        if self.square and (self.causal or self.window != NO_WINDOW):
            kwargs["square"] = True
        return kwargs


def encode_varlen(blocks: Iterable) -> list[int]:
    """Nine ints per layouts.thd.VarlenBlock: source, causal, max_q, max_k, window left, window right (-1 =
    unbounded), covers rows, covers keys, square."""
    flags = lambda b: (b.covers_rows, b.covers_keys, b.square)  # noqa: E731
    return [i for b in blocks for i in (b.source, int(b.causal), b.max_q, b.max_k, *b.window, *map(int, flags(b)))]


def decode_varlen(ints: Sequence[int]) -> list[VarlenSpec]:
    """Inverse of encode_varlen."""
    fields = [ints[i : i + VARLEN_FIELDS] for i in range(0, len(ints), VARLEN_FIELDS)]
    return [
        VarlenSpec(s, bool(c), mq, mk, (left, right), bool(r), bool(k), bool(sq))
        for s, c, mq, mk, left, right, r, k, sq in fields
    ]

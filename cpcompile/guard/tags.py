"""What a value carries under CP, and how the token axis moves through shapes.

`Seq(parts)`: the value holds this rank's tokens along one axis. The axis may be a whole dim (`(B, L, D)`: dim 1),
part of a dim that merges it with others (`(B*L, D)` after a flatten: dim 0 holds batch x tokens), or be spread
over several dims after a split. Each `Part(dim, lo, hi)` says dim `dim`'s index is `a*hi + t*lo + b` with the
token factor `t` in `[0, hi/lo)`; parts are ordered from the most significant token factor to the least. A
reshape keeps the row-major flat index, so the axis is followed through any view as a stride in that index.

`Share(op)`: a per-rank reduction over tokens (op: "sum", "avg", "max", "min"): each rank holds its share of a
value only the ranks together hold.

`Local(what)`: a value made from the LOCAL sequence length (an arange over it, a buffer sliced to it): the same on
every rank, wrong on every rank but one when used as positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Part:
    dim: int
    lo: int
    hi: int


@dataclass(frozen=True)
class Seq:
    parts: tuple[Part, ...]

    @property
    def dims(self) -> set[int]:
        return {p.dim for p in self.parts}

    def moved(self, mapping: dict[int, int]) -> Seq | None:
        """The same axis with dims renumbered (a dim missing from `mapping`: None, the axis is lost)."""
        if any(p.dim not in mapping for p in self.parts):
            return None
        return Seq(tuple(Part(mapping[p.dim], p.lo, p.hi) for p in self.parts))

    def describe(self) -> str:
        if len(self.parts) == 1 and self.parts[0].lo == 1:
            return f"tokens on dim {self.parts[0].dim}"
        return "tokens on dims " + ", ".join(str(p.dim) for p in self.parts) + " (merged with other dims)"


@dataclass(frozen=True)
class Share:
    op: str

    def describe(self) -> str:
        return f"a per-rank partial {self.op} over tokens"


@dataclass(frozen=True)
class Local:
    what: str

    def describe(self) -> str:
        return f"made from the local sequence length ({self.what})"


def whole(dim: int, size: int) -> Seq:
    """Tokens on all of `dim` (size L)."""
    return Seq((Part(dim, 1, size),))


def _inner(shape, d: int) -> int:
    return math.prod(shape[d + 1 :])


def to_flat(tag: Seq, shape) -> tuple[int, int] | None:
    """(stride of the token axis in the row-major flat index, token count), or None when the parts are not one
    run of the flat index (split dims later permuted apart)."""
    parts = tag.parts
    for k, p in enumerate(parts):
        if p.dim != parts[0].dim + k or p.hi % p.lo:
            return None
        if k > 0 and p.hi != shape[p.dim]:
            return None
        if k < len(parts) - 1 and p.lo != 1:
            return None
    tokens = math.prod(p.hi // p.lo for p in parts)
    return parts[-1].lo * _inner(shape, parts[-1].dim), tokens


def from_flat(stride: int, tokens: int, shape) -> Seq | None:
    """The parts of a token axis at `stride` in the flat index of `shape` (None: the axis does not fall on dim
    boundaries there, as after a reshape that cuts a token's row in two)."""
    lo_t, hi_t = stride, stride * tokens
    parts = []
    for d, n in enumerate(shape):
        if n == 1:
            continue
        lo_d, hi_d = _inner(shape, d), _inner(shape, d) * n
        lo, hi = max(lo_d, lo_t), min(hi_d, hi_t)
        if lo >= hi:
            continue
        if lo % lo_d or hi % lo_d:
            return None
        parts.append(Part(d, lo // lo_d, hi // lo_d))
    if not parts or math.prod(p.hi // p.lo for p in parts) != tokens:
        return None
    return Seq(tuple(parts))


def reshaped(tag: Seq, before, after) -> Seq | None:
    """The token axis after a view/reshape from `before` to `after` (same element count)."""
    flat = to_flat(tag, before)
    return None if flat is None else from_flat(*flat, after)


def aligned(a: Seq | None, b: Seq | None) -> bool:
    return a is None or b is None or a == b

"""Where a rank's chunks sit in the chain of a chunk layout's chunks (pure index math, the same on every rank).

State passing reads, for each chunk, what the chunk before it in SEQUENCE order leaves behind: a conv's last
`context` tokens (the halo), a linear recurrence's state. Under flat, chunk c is rank c's, so that is the previous
rank. Under a layout whose ranks own several chunks (zigzag: rank r owns chunks r and 2cp-1-r of 2cp) each of a
rank's chunks is a piece of the chain of its own: its predecessor may be another rank's chunk, or this rank's
(zigzag's chunks cp-1 and cp, both rank cp-1's).

`halo_routes`: the sends that hand every chunk its predecessor's tail. Every rank must issue the same collectives,
so the sends go by rank offset: one shift (comm.pending's one-split all-to-all) per offset any rank needs, each
carrying as many tails as the busiest pair of that offset (padding for a rank with fewer: one of its own tails,
never zeros, state_region._sends says why). Flat: offset 1.
Zigzag: offsets 1 and cp-1 (rank r - 1's first chunk for chunk r, rank r + 1's second chunk for chunk 2cp-1-r);
at cp 2 both are offset 1, one shift carrying one tail each way.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layouts import ChunkLayout


def chunk_owners(layout: ChunkLayout, cp: int) -> list[tuple[int, int]]:
    """For each global chunk, in sequence order: (the rank that owns it, its local slot there)."""
    owners = [(0, 0)] * layout.num_chunks(cp)
    for p in range(cp):
        for slot, c in enumerate(layout.rank_chunks(p, cp)):
            owners[c] = (p, slot)
    return owners


@dataclass(frozen=True)
class HaloSource:
    """Where one local chunk's halo comes from: "zero" (the sequence's first chunk: the conv's zero padding),
    "local" (`index`: the local slot of the chunk before it) or "recv" (`index`: which shift, `position`: which of
    the tails it carries)."""

    kind: str
    index: int = 0
    position: int = 0


@dataclass(frozen=True)
class HaloRoutes:
    """A rank's halo plan: per shift its offset and the local slots whose tails it sends (None: padding),
    and per local slot where its halo comes from."""

    sends: tuple[tuple[int, tuple[int | None, ...]], ...]
    sources: tuple[HaloSource, ...]


def _pair_chunks(layout: ChunkLayout, cp: int) -> dict[tuple[int, int], list[int]]:
    """(sender, receiver) -> the sender's chunks whose successor the receiver owns, in sequence order."""
    owners = chunk_owners(layout, cp)
    pairs: dict[tuple[int, int], list[int]] = {}
    for c in range(len(owners) - 1):
        src, dst = owners[c][0], owners[c + 1][0]
        if src != dst:
            pairs.setdefault((src, dst), []).append(c)
    return pairs


def halo_routes(layout: ChunkLayout, cp: int, rank: int) -> HaloRoutes:
    """Rank `rank`'s sends and halo sources under `layout` on `cp` ranks."""
    owners = chunk_owners(layout, cp)
    pairs = _pair_chunks(layout, cp)
    width: dict[int, int] = {}  # offset -> the most tails one pair of that offset exchanges
    for (src, dst), chunks in pairs.items():
        offset = (dst - src) % cp
        width[offset] = max(width.get(offset, 0), len(chunks))
    offsets = sorted(width)
    sends = []
    for offset in offsets:
        chunks = pairs.get((rank, (rank + offset) % cp), [])
        slots: list[int | None] = [owners[c][1] for c in chunks]
        sends.append((offset, tuple(slots + [None] * (width[offset] - len(slots)))))
    sources = []
    for c in layout.rank_chunks(rank, cp):
        if c == 0:
            sources.append(HaloSource("zero"))
            continue
        src, slot = owners[c - 1]
        if src == rank:
            sources.append(HaloSource("local", slot))
            continue
        offset = (rank - src) % cp
        sources.append(HaloSource("recv", offsets.index(offset), pairs[src, rank].index(c - 1)))
    return HaloRoutes(tuple(sends), tuple(sources))


def tails_received(layout: ChunkLayout, cp: int) -> int:
    """The tails every rank receives (padding included): the sum of the shifts' widths, the same on every rank."""
    return sum(len(slots) for _, slots in halo_routes(layout, cp, 0).sends)

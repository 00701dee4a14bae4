"""WireShape: what a comm's `wire_bytes` reads of a site, declared once and read by name.

Every comm's registry entry has `wire_bytes(shape: WireShape) -> (bytes one rank sends per forward, per
backward)` (its region module writes it); the cost model builds the shape of a planned site (its family's
costing: cost/shape.py). `format_bytes` writes a byte count as explain() and the comms' notes print it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WireShape:
    """One rank's share of an attention site, as the collectives see it."""

    tokens: int
    """Local tokens a rank (packed: the rank's packed length)."""
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    world: int
    elt: int
    """Bytes of one element of q/k/v (the activations' dtype)."""
    acc_elt: int
    """Bytes of one element of the accumulation dtype (fp32 partial gradients)."""
    lse: bool = False
    """Whether the lse travels (a packed site whose graph reads it, under a comm that sends it on demand)."""
    max_doc: int | None = None
    """Packed sites: varlen_attn's max_q/max_k (the longest document), when static."""
    dense_mask: tuple[str, bool, tuple[int, int] | None] | None = None
    """Dense sites: (layout, causal, window), for comms whose traffic depends on the mask (the ring's steps)."""
    packed_mask: tuple[str, bool, tuple[int, int]] | None = None
    """Packed sites: (layout, causal, window as planned), for comms whose traffic depends on the window (the ring
    visits fewer steps under a causal sliding window: comms/ring/schedule.packed_visited_steps)."""
    levels: tuple[int, int] | None = None
    """A 2-D CP mesh's (inter, intra) sizes (world = inter * intra), for comms that run a level each."""


@dataclass(frozen=True)
class LevelBytes:
    """What one rank sends on one level of a 2-D CP mesh (a comm's `level_bytes`): the mesh dim, the collective
    that runs on it, bytes per forward and per backward."""

    dim: str
    comm: str
    fwd: int
    bwd: int


def format_bytes(n: float) -> str:
    """`n` bytes in the largest unit under it, three significant digits (e.g. "4.1 KB")."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"

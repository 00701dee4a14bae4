"""How a family's site becomes the cost model's SiteShape (cost/shape.py): the shapes, element sizes, mask and world
of one rank, and the family's costing. Each costed family's `cost_shape` (Family.cost_shape) calls `site_shape` with
its own Costing (its package's costing.py) and extras."""

from __future__ import annotations

from ..cost import Costing, SiteShape
from ..precision import acc_dtype
from .site import AttentionSite


def site_shape(site: AttentionSite, costing: Costing, causal: bool, world: int, seq_dim: int, **extra) -> SiteShape:
    """The SiteShape of `site`, counted by `costing`, whose q holds the tokens on `seq_dim` (SDPA q (B, H, L, D): 2;
    varlen q (T, H, D): 0, no batch dim); a dynamic batch is costed as 1."""
    q, k, v = site.q_shape, site.k_shape, site.v_shape
    batched = seq_dim > 0
    return SiteShape(
        costing=costing,
        batch=q[0] if batched and isinstance(q[0], int) else 1,
        tokens=q[seq_dim],
        q_heads=q[1],
        kv_heads=k[1],
        head_dim=q[-1],
        v_head_dim=v[-1],
        elt=site.dtype.itemsize,
        acc_elt=acc_dtype(site.dtype).itemsize,
        causal=causal,
        world=world,
        **extra,
    )

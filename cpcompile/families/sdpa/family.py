"""The sdpa family: scaled_dot_product_attention and cpcompile.attention over one dense sequence per batch row,
q/k/v (B, H, L, D) sharded on L by a chunk layout (flat, zigzag)."""

from __future__ import annotations

from ...cost import SiteShape
from ...layouts import LAYOUTS
from ...layouts.block import NO_WINDOW
from ..cost_shape import site_shape
from ..family import Family
from ..plans import CPPlan
from .call import DenseCall
from .costing import DENSE
from .match import match_sdpa
from .plan import SEQ_DIM, plan_dense_site


def cost_shape(plan: CPPlan, world: int) -> SiteShape:
    """The plan's SiteShape at `world` ranks: its window, and a 2-D mesh's levels at the plan's own world."""
    levels = plan.group.level_sizes if world == plan.group.size else None
    return site_shape(plan.site, DENSE, plan.causal, world, SEQ_DIM, window=plan.window or NO_WINDOW, levels=levels)


SDPA = Family(
    name="sdpa",
    title="SDPA",
    match=match_sdpa,
    plan=plan_dense_site,
    call=DenseCall,
    seq_dim=SEQ_DIM,
    out_seq_dims=(SEQ_DIM,),
    cost_shape=cost_shape,
    recommend_layouts=lambda: tuple(LAYOUTS),
)

"""The varlen family: torch.nn.attention.varlen.varlen_attn over packed documents, q/k/v (T, H, D) sharded on T
by a packed layout (thd, thd_zigzag, thd_balanced), the GLOBAL cu_seqlens a region input."""

from __future__ import annotations

from ...cost import SiteShape
from ...layouts import THD_LAYOUTS
from ..cost_shape import site_shape
from ..family import Family
from .call import VarlenCall
from .checks import check_packed
from .costing import PACKED
from .match import match_varlen
from .plan import SEQ_DIM, plan_varlen_site
from .plan_type import VarlenPlan


def cost_shape(plan: VarlenPlan, world: int) -> SiteShape:
    """The plan's SiteShape at `world` ranks: its window, max_doc, whether the lse is read, a 2-D mesh's levels."""
    levels = plan.group.level_sizes if world == plan.group.size else None
    extra = dict(window=plan.window, max_doc=plan.max_doc, return_lse=plan.return_lse, levels=levels)
    return site_shape(plan.site, PACKED, plan.causal, world, SEQ_DIM, **extra)


VARLEN = Family(
    name="varlen",
    title="varlen_attn",
    match=match_varlen,
    plan=plan_varlen_site,
    call=VarlenCall,
    seq_dim=SEQ_DIM,
    out_seq_dims=(SEQ_DIM, 1),  # (out (T, H, Dv), lse (H, T))
    offset_fields=("cu_seqlens",),
    insert_checks=check_packed,
    cost_shape=cost_shape,
    recommend_layouts=lambda: [name for name, lay in THD_LAYOUTS.items() if not lay.carries_plan],
)  # a layout with a per-batch plan (thd_balanced) is not costed

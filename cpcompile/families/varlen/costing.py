"""How the cost model counts a varlen site (its SiteShape's costing): packed documents, so a site is costed over
documents: the example batch's where explain() has one, else the densest packing the call's static bounds allow
(`assumed_documents`: documents of max_q/max_k tokens; the planner sees no document). A layout with a per-batch
plan (thd_balanced) is costed with the plan `prepare` makes of them. Each rank's blocks are the comm's varlen
region's `rank_blocks` over those documents (layouts.thd.VarlenBlock), counted as the varlen kernels launch them;
the wire sees the longest document, the window and whether the lse travels."""

from __future__ import annotations

import torch

from ...comm.entry import Region
from ...comm.wire import WireShape
from ...cost import SiteShape
from ...cost.work import CallWork, varlen_work
from ...layouts.thd import get_packed_layout


def assumed_documents(total: int, max_doc: int | None) -> torch.Tensor:
    """cu_seqlens of documents of `max_doc` tokens filling `total` (the last one shorter): what the planner
    costs packed sites with, knowing only the bounds."""
    size = total if max_doc is None else max(1, min(max_doc, total))
    cuts = list(range(0, total, size)) + [total]
    return torch.tensor(cuts, dtype=torch.int64)


class PackedCosting:
    """The varlen family's Costing (cost/shape.py)."""

    family = "varlen"
    kernels = "varlen"

    def documents(self, shape: SiteShape, layout: str, cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, str]:
        packed, total = get_packed_layout(layout), shape.tokens * shape.world
        if cu_seqlens is None:
            cu_seqlens = assumed_documents(total, shape.max_doc)
            described = f"assumed: documents of {int((cu_seqlens[1:] - cu_seqlens[:-1]).max())} tokens"
            if packed.carries_plan:  # thd_balanced: the plan shard_batch would make of them
                cu_seqlens = packed.prepare(cu_seqlens, total, shape.world)
        else:
            offsets = packed.offsets(cu_seqlens, shape.world) if packed.is_plan(cu_seqlens) else cu_seqlens
            described = f"this batch's {offsets.numel() - 1} documents"
        return cu_seqlens.long().cpu(), described

    def wire(self, shape: SiteShape, layout: str, lse_on_demand: bool) -> WireShape:
        return shape.wire_shape(
            lse=shape.return_lse and lse_on_demand,
            max_doc=shape.max_doc,
            packed_mask=(layout, shape.causal, shape.window),
        )

    def rank_work(
        self, shape: SiteShape, layout: str, region: Region, rank: int, documents: torch.Tensor, **levels
    ) -> tuple[int, CallWork]:
        blocks = region.rank_blocks(
            layout, shape.causal, rank, shape.world, shape.tokens, documents, shape.max_doc, shape.window, **levels
        )
        total = CallWork()
        for block in blocks:
            total = total + varlen_work(block)
        return len(blocks), total


PACKED = PackedCosting()

"""How the cost model counts an sdpa site (its SiteShape's costing): one dense sequence a batch row, no documents;
each rank's blocks are the comm's sdpa region's `rank_blocks` (layouts.Block), counted as the executor batches
them into kernel calls; the wire sees the layout, the mask and the window (the ring's steps depend on them)."""

from __future__ import annotations

import torch

from ...comm.entry import Region
from ...comm.wire import WireShape
from ...cost import SiteShape
from ...cost.work import CallWork, dense_work


class DenseCosting:
    """The sdpa family's Costing (cost/shape.py)."""

    family = "sdpa"
    kernels = "dense"

    def documents(self, shape: SiteShape, layout: str, cu_seqlens: torch.Tensor | None) -> tuple[None, str]:
        return None, ""

    def wire(self, shape: SiteShape, layout: str, lse_on_demand: bool) -> WireShape:
        return shape.wire_shape(dense_mask=(layout, shape.causal, shape.block_window))

    def rank_work(
        self, shape: SiteShape, layout: str, region: Region, rank: int, documents: None, **levels
    ) -> tuple[int, CallWork]:
        blocks = region.rank_blocks(layout, shape.causal, rank, shape.world, shape.tokens, shape.block_window, **levels)
        return len(blocks), dense_work(blocks, shape.batch)


DENSE = DenseCosting()

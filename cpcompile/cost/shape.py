"""What the cost model reads of a site: SiteShape (one rank's shapes, the mask, the world) and the Costing its
family supplies with it (how that family's sites are counted), so cost/model.py never asks which family a site is.

A family's package builds both (Family.cost_shape): the sdpa family's costing counts dense blocks over one
sequence a batch row, the varlen family's packed blocks over documents. A new family costs its sites by handing
its own Costing here; nothing in cost/ names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..comm.entry import Region
from ..comm.wire import WireShape
from ..layouts.block import NO_WINDOW
from .work import CallWork


class Costing(Protocol):
    """How the cost model counts one attention family's sites (a family's package supplies it: SiteShape.costing)."""

    family: str
    """The family's name: the key of each comm's region whose blocks it counts (Comm.regions)."""
    kernels: str
    """Whose rates time its kernel calls when the kernel has no measurement of its own: "dense" or "varlen"
    (cost/rates.PROXY)."""

    def documents(self, shape: SiteShape, layout: str, cu_seqlens: torch.Tensor | None) -> tuple:
        """(the documents the site is costed with, or None; how explain() names them, "" without documents):
        `cu_seqlens` when given (GLOBAL offsets, or a layout's per-batch plan), else what the shape assumes."""
        ...

    def wire(self, shape: SiteShape, layout: str, lse_on_demand: bool) -> WireShape:
        """The site as the comm's wire_bytes reads it (`shape.wire_shape` with this family's fields);
        `lse_on_demand`: the comm sends the lse only when the graph reads it (Capabilities.lse_on_demand)."""
        ...

    def rank_work(
        self, shape: SiteShape, layout: str, region: Region, rank: int, documents: torch.Tensor | None, **levels
    ) -> tuple[int, CallWork]:
        """(blocks, their kernel calls' counts) of rank `rank` under the comm's `region` for this family
        (`region.rank_blocks` in the family's own arguments; `levels`: a 2-D mesh's, for a comm on one)."""
        ...


@dataclass(frozen=True)
class SiteShape:
    """What the cost model needs of a site: this rank's shapes, element sizes, the mask and the CP world, and its
    family's costing."""

    costing: Costing
    """How this site's family is counted (its package's Costing; its `family` names the comm regions)."""
    batch: int
    tokens: int
    """Local tokens a rank (sequence dim of SDPA q; packed length of varlen q)."""
    q_heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    elt: int
    acc_elt: int
    causal: bool
    world: int
    window: tuple[int, int] = NO_WINDOW
    max_doc: int | None = None
    """Packed sites: the longest document a batch may hold (varlen_attn's static max_q / max_k); None: unknown,
    or a site without documents."""
    return_lse: bool = True
    levels: tuple[int, int] | None = None
    """A 2-D CP mesh's (inter, intra) sizes (world = their product; mesh.CPGroup.levels), else None."""

    @property
    def block_window(self) -> tuple[int, int] | None:
        """The window as the layouts' block functions take it (None: no window)."""
        return None if self.window == NO_WINDOW else self.window

    def wire_shape(self, **family_fields) -> WireShape:
        """The WireShape of this site: its shapes and world, with the fields only its family fills (a Costing's
        `wire`: lse, max_doc, dense_mask, packed_mask)."""
        return WireShape(
            self.tokens, self.batch, self.q_heads, self.kv_heads, self.head_dim, self.v_head_dim, self.world,
            self.elt, self.acc_elt, levels=self.levels, **family_fields,
        )  # fmt: skip

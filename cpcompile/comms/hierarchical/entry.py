"""comm="hierarchical"'s registry entry (a 2-D CP mesh: a2a inside a node, the ring across): its regions (sdpa,
varlen under thd), its wire bytes and bytes per level, and its capabilities (levels, heads split over the node's
ranks, the ring's overlap across the nodes)."""

from __future__ import annotations

from ...comm.capabilities import Capabilities
from ...comm.entry import Comm, Region
from ...layouts import THD_LAYOUTS
from . import dense, varlen

HIERARCHICAL = Comm(
    name="hierarchical",
    regions={
        "sdpa": Region(dense.hierarchical_attention, dense.rank_blocks),
        "varlen": Region(varlen.hierarchical_varlen_attention, varlen.rank_blocks),
    },
    wire_bytes=dense.wire_bytes,
    level_bytes=dense.level_bytes,
    # an option on 2-D CP meshes only (its rules refuse a 1-D group): each level costed on its own link
    overhead_as="a2a",  # the same pack and unpack of q/k/v and the output around the exchange
    capabilities=Capabilities(
        packed_layouts=("thd",),
        packed_refusals={
            name: (
                f"comm='hierarchical' runs the packed ring across nodes over each node's tokens, which are one "
                f"contiguous run in global order only under strategy='thd' ({name!r} interleaves the pieces of "
                "every document across a node's ranks)",
                f"use strategy='thd' with comm='hierarchical', or a 1-D comm on the same mesh with {name!r}",
            )
            for name in THD_LAYOUTS
            if name != "thd"
        },
        packed_windows="causal_or_full",
        lse_on_demand=True,
        splits_heads=True,
        overlaps=True,
        levels=True,
    ),
)

"""comm="a2a"'s registry entry (Ulysses): its region for each family it serves (sdpa, varlen, flex), its wire bytes
and its capabilities (thd and thd_balanced, any window, the lse on demand, heads split over the ranks)."""

from __future__ import annotations

from ...comm.capabilities import Capabilities
from ...comm.entry import Comm, Region
from . import dense, flex, varlen

A2A = Comm(
    name="a2a",
    regions={
        "sdpa": Region(dense.a2a_attention, dense.rank_blocks),
        "varlen": Region(varlen.a2a_varlen_attention, varlen.rank_blocks),
        "flex": Region(flex.a2a_flex_attention),
    },
    wire_bytes=dense.wire_bytes,
    capabilities=Capabilities(
        packed_layouts=("thd", "thd_balanced"),
        packed_refusals={
            "thd_zigzag": (
                "comm='a2a' runs the whole sequence on every rank (for H/cp of the heads), so causal work is "
                "balanced with the contiguous layout already; strategy='thd_zigzag' (per-document zigzag) would "
                "only add a reorder of q/k/v and the output after each exchange",
                "use strategy='thd' with comm='a2a' (shard with cpcompile.shard(..., strategy='thd', cu_seqlens=...))",
            )
        },
        packed_windows="any",
        lse_on_demand=True,
        splits_heads=True,
    ),
)

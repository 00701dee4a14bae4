"""comm="all_gather"'s registry entry: its region for each family it serves (sdpa, varlen, flex), its wire bytes
and its capabilities (every packed layout, overlap of the local blocks with the gather, regather)."""

from __future__ import annotations

from ...comm.capabilities import Capabilities
from ...comm.entry import Comm, Region
from . import dense, flex, varlen

ALL_GATHER = Comm(
    name="all_gather",
    regions={
        "sdpa": Region(dense.all_gather_attention, dense.rank_blocks),
        "varlen": Region(varlen.all_gather_varlen_attention, varlen.rank_blocks),
        "flex": Region(flex.all_gather_flex_attention),
    },
    wire_bytes=dense.wire_bytes,
    capabilities=Capabilities(overlaps=True, regathers=True),
)

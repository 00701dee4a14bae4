"""comm="ring"'s registry entry: its region for each family it serves, its wire bytes and its capabilities (the
packed layouts its schedule has steps for, the windows a held chunk allows, the overlap the backend keeps)."""

from __future__ import annotations

from ...comm.capabilities import Capabilities
from ...comm.entry import Comm, Region
from ...layouts import THD_LAYOUTS
from . import dense, memory, varlen

PACKED = ("thd", "thd_zigzag")
"""The packed layouts schedule.py has steps for (none for thd_balanced's per-batch plans yet)."""

RING = Comm(
    name="ring",
    regions={
        "sdpa": Region(dense.ring_attention, dense.rank_blocks, memory.dense_deferred_bytes),
        "varlen": Region(varlen.ring_varlen_attention, varlen.rank_blocks, memory.varlen_deferred_bytes),
    },
    wire_bytes=dense.wire_bytes,
    auto_option=False,
    capabilities=Capabilities(
        packed_layouts=PACKED,
        packed_refusals={
            name: (
                f"comm='ring' has no ring steps for the packed layout {name!r}",
                f"use strategy in {list(PACKED)} with comm='ring', or comm='all_gather'",
            )
            for name in THD_LAYOUTS
            if name not in PACKED
        },
        packed_windows="sliding_causal",  # packed_band.py: exact on every varlen provider
        overlaps=True,  # each step's shift issued before its blocks, waited after (the backend keeps that order)
        defers_merge=True,  # regions/deferred.py
    ),
)

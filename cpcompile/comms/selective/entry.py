"""comm="selective"'s registry entry: its one region (varlen: packed documents), its wire bytes and its capabilities
(thd_balanced and thd; no dense region: one dense sequence is read whole by every rank)."""

from __future__ import annotations

from ...comm.capabilities import Capabilities
from ...comm.entry import Comm, Region
from ...layouts import THD_LAYOUTS
from ..all_gather import varlen as all_gather_varlen
from . import varlen
from .note import batch_note

PACKED = ("thd", "thd_balanced")

SELECTIVE = Comm(
    name="selective",
    regions={"varlen": Region(varlen.selective_varlen_attention, all_gather_varlen.rank_blocks)},
    wire_bytes=varlen.wire_bytes,
    overhead_as="all_gather",  # the same key-buffer copy and fold, plus one index_select of the sent K/V
    batch_note=batch_note,
    capabilities=Capabilities(
        packed_layouts=PACKED,
        packed_refusals={
            name: (
                f"comm='selective' sends each rank the pieces of the documents it holds, and under "
                f"strategy={name!r} every rank holds a piece of every document: there is nothing to leave out",
                "use strategy='thd_balanced' or 'thd' with comm='selective', or comm='all_gather'",
            )
            for name in THD_LAYOUTS
            if name not in PACKED
        },
        dense_features=(),
        dense_refusal=(
            "comm='selective' sends each rank the K/V of the packed documents its queries read (thd_balanced); "
            "one dense sequence is read whole by every rank",
            "use comm='all_gather', 'a2a' or 'ring' for scaled_dot_product_attention / flex_attention",
        ),
    ),
)

"""The comm registry: one entry per `comm=` name, naming its regions and the layouts it takes.

A new comm is one region module (regions/) plus one entry here; the planner, the backend's argument check,
the logs, the cost model behind comm="auto" and explain() (cost/) and the docs read everything else from the
entry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..errors import CPCompileError
from ..layouts import THD_LAYOUTS
from ..layouts.ring import RING_PACKED_LAYOUTS
from ..regions import a2a, a2a_varlen, all_gather, all_gather_varlen, flex, ring, ring_varlen, selective_varlen


@dataclass(frozen=True)
class Comm:
    """How a comm runs attention, for SDPA sites (`region`) and varlen_attn sites (`varlen_region`)."""

    name: str
    region: Callable | None
    """The dense region: (q, k, v, *, layout, causal, scale, kernel, group_name, rank, world) -> out (None: the
    comm takes packed documents only, and the dense planner refuses it)."""
    rank_blocks: Callable | None
    """(layout, causal, rank, world, local_len) -> the dense blocks a rank runs (logs, explain)."""
    wire_bytes: Callable
    """(tokens, batch, q_heads, kv_heads, head_dim, v_head_dim, world, elt, acc_elt, lse, max_doc=None) -> (bytes
    one rank sends per forward, per backward), for the cost model (cost/model.py): every comm has it, since
    kernel="auto" costs the kernel options under a named comm too."""
    auto_option: bool = True
    """Whether comm="auto" considers it. The ring's advantage is overlap and memory, which the cost model (no
    overlap, no memory term) cannot see: it would never pick it for the right reason, so it is only named."""
    varlen_region: Callable | None = None
    """The packed-document region (q, k, v, cu_seqlens, *, ..., max_doc, window) -> varlen_attn's outputs."""
    splits_heads: bool = False
    """Whether the comm gives each rank a share of the heads (then the head counts must split over cp)."""
    varlen_refusals: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    """Packed layouts this comm refuses, each with (rule broken, fix) for the planner's error."""
    varlen_any_window: bool = False
    """Whether the varlen region attends with cp=1's mask (after an exchange), so any flash-attn window works;
    otherwise only causal (left, 0) windows, which every rank's q pieces keep exact by ending their key ranges."""
    varlen_lse_on_demand: bool = False
    """Whether the varlen region takes `return_lse` (the lse costs it a collective, sent only when read)."""
    varlen_rank_blocks: Callable | None = None
    """(layout, causal, rank, world, local_len, cu_seqlens, max_doc, window) -> the varlen blocks a rank runs."""
    varlen_sliding_windows: bool = True
    """Whether the varlen region takes sliding windows (left >= 0) at all; False: only causal and full."""
    regathers: bool = False
    """Whether the regions take `regather` (keep only the local K/V for backward, gather them again there)."""
    overhead_as: str | None = None
    """The comm whose measured region overhead (cost/rates.json) stands in for this one's (None: its own)."""
    dense_refusal: tuple[str, str] | None = None
    """(rule, fix) for SDPA and flex sites when the comm has no dense region."""
    flex_region: Callable | None = None
    """The flex_attention region (q, k, v, score_mod, mask_mod, tables, extras, score_buffers, mask_buffers, *,
    layout, scale, kernel_options, block_size, masked, group_name, rank, world) -> (out, lse, max_scores)."""


COMMS: dict[str, Comm] = {
    "all_gather": Comm(
        name="all_gather",
        region=all_gather.all_gather_attention,
        rank_blocks=all_gather.rank_blocks,
        varlen_region=all_gather_varlen.all_gather_varlen_attention,
        wire_bytes=all_gather.wire_bytes,
        varlen_rank_blocks=all_gather_varlen.rank_blocks,
        regathers=True,
        flex_region=flex.all_gather_flex_attention,
    ),
    "a2a": Comm(
        name="a2a",
        region=a2a.a2a_attention,
        rank_blocks=a2a.rank_blocks,
        varlen_region=a2a_varlen.a2a_varlen_attention,
        splits_heads=True,
        varlen_any_window=True,
        varlen_lse_on_demand=True,
        wire_bytes=a2a.wire_bytes,
        varlen_rank_blocks=a2a_varlen.rank_blocks,
        flex_region=flex.a2a_flex_attention,
        varlen_refusals={
            "thd_zigzag": (
                "comm='a2a' runs the whole sequence on every rank (for H/cp of the heads), so causal work is "
                "balanced with the contiguous layout already; strategy='thd_zigzag' (per-document zigzag) would "
                "only add a reorder of q/k/v and the output after each exchange",
                "use strategy='thd' with comm='a2a' (shard with cpcompile.shard(..., strategy='thd', cu_seqlens=...))",
            )
        },
    ),
    "ring": Comm(
        name="ring",
        region=ring.ring_attention,
        rank_blocks=ring.rank_blocks,
        varlen_region=ring_varlen.ring_varlen_attention,
        wire_bytes=ring.wire_bytes,
        varlen_rank_blocks=ring_varlen.rank_blocks,
        auto_option=False,
        varlen_sliding_windows=False,
        varlen_refusals={
            name: (
                f"comm='ring' has no ring steps for the packed layout {name!r}",
                f"use strategy in {list(RING_PACKED_LAYOUTS)} with comm='ring', or comm='all_gather'",
            )
            for name in THD_LAYOUTS
            if name not in RING_PACKED_LAYOUTS
        },
    ),
    "selective": Comm(
        name="selective",
        region=None,
        rank_blocks=None,
        varlen_region=selective_varlen.selective_varlen_attention,
        wire_bytes=selective_varlen.wire_bytes,
        varlen_rank_blocks=all_gather_varlen.rank_blocks,
        overhead_as="all_gather",  # the same key-buffer copy and fold, plus one index_select of the sent K/V
        dense_refusal=(
            "comm='selective' sends each rank the K/V of the packed documents its queries read (thd_balanced); "
            "one dense sequence is read whole by every rank",
            "use comm='all_gather', 'a2a' or 'ring' for scaled_dot_product_attention / flex_attention",
        ),
        varlen_refusals={
            name: (
                f"comm='selective' sends each rank the pieces of the documents it holds, and under strategy={name!r} "
                "every rank holds a piece of every document: there is nothing to leave out",
                "use strategy='thd_balanced' or 'thd' with comm='selective', or comm='all_gather'",
            )
            for name in THD_LAYOUTS
            if name not in ("thd_balanced", "thd")
        },
    ),
}


def get_comm(name: str) -> Comm:
    """The registry entry of `name`, or a CPCompileError listing the comms."""
    try:
        return COMMS[name]
    except KeyError:
        raise CPCompileError(f"unknown comm {name!r}. Fix: use one of {list(COMMS)}.") from None

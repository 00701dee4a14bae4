"""The comm registry: one entry per `comm=` name, naming its regions, its wire bytes and its capabilities.

A new comm is one package (comms/<name>/, ring's is the pattern) whose entry (comm/entry.Comm) names its region
for each attention family it serves (`regions`, keyed by the family's name), its wire bytes and its
`capabilities` (comm/capabilities.py), plus one line here; the planners, the backend's argument check, the logs,
the cost model behind comm="auto", explain() and the bench read everything else from the entry. The comms not
yet in a package keep their entries below, their regions in regions/.
"""

from __future__ import annotations

from collections.abc import Callable

from ..comms.ring.entry import RING
from ..errors import CPCompileError
from ..kernels import FEATURES
from ..layouts import THD_LAYOUTS
from ..regions import (
    a2a,
    a2a_varlen,
    all_gather,
    all_gather_varlen,
    flex,
    hierarchical,
    hierarchical_varlen,
    selective_varlen,
)
from .capabilities import Capabilities
from .entry import Comm, Region

SELECTIVE_PACKED = ("thd", "thd_balanced")

COMMS: dict[str, Comm] = {
    "all_gather": Comm(
        name="all_gather",
        regions={
            "sdpa": Region(all_gather.all_gather_attention, all_gather.rank_blocks),
            "varlen": Region(all_gather_varlen.all_gather_varlen_attention, all_gather_varlen.rank_blocks),
            "flex": Region(flex.all_gather_flex_attention),
        },
        wire_bytes=all_gather.wire_bytes,
        capabilities=Capabilities(overlaps=True, regathers=True),
    ),
    "a2a": Comm(
        name="a2a",
        regions={
            "sdpa": Region(a2a.a2a_attention, a2a.rank_blocks),
            "varlen": Region(a2a_varlen.a2a_varlen_attention, a2a_varlen.rank_blocks),
            "flex": Region(flex.a2a_flex_attention),
        },
        wire_bytes=a2a.wire_bytes,
        capabilities=Capabilities(
            packed_layouts=("thd", "thd_balanced"),
            packed_refusals={
                "thd_zigzag": (
                    "comm='a2a' runs the whole sequence on every rank (for H/cp of the heads), so causal work is "
                    "balanced with the contiguous layout already; strategy='thd_zigzag' (per-document zigzag) would "
                    "only add a reorder of q/k/v and the output after each exchange",
                    "use strategy='thd' with comm='a2a' (shard with cpcompile.shard(..., strategy='thd', "
                    "cu_seqlens=...))",
                )
            },
            packed_windows="any",
            lse_on_demand=True,
            splits_heads=True,
        ),
    ),
    "ring": RING,  # comms/ring/: the pattern of a comm package
    "selective": Comm(
        name="selective",
        regions={"varlen": Region(selective_varlen.selective_varlen_attention, all_gather_varlen.rank_blocks)},
        wire_bytes=selective_varlen.wire_bytes,
        overhead_as="all_gather",  # the same key-buffer copy and fold, plus one index_select of the sent K/V
        capabilities=Capabilities(
            packed_layouts=SELECTIVE_PACKED,
            packed_refusals={
                name: (
                    f"comm='selective' sends each rank the pieces of the documents it holds, and under "
                    f"strategy={name!r} every rank holds a piece of every document: there is nothing to leave out",
                    "use strategy='thd_balanced' or 'thd' with comm='selective', or comm='all_gather'",
                )
                for name in THD_LAYOUTS
                if name not in SELECTIVE_PACKED
            },
            dense_features=(),
            dense_refusal=(
                "comm='selective' sends each rank the K/V of the packed documents its queries read (thd_balanced); "
                "one dense sequence is read whole by every rank",
                "use comm='all_gather', 'a2a' or 'ring' for scaled_dot_product_attention / flex_attention",
            ),
        ),
    ),
    "hierarchical": Comm(
        name="hierarchical",
        regions={
            "sdpa": Region(hierarchical.hierarchical_attention, hierarchical.rank_blocks),
            "varlen": Region(hierarchical_varlen.hierarchical_varlen_attention, hierarchical_varlen.rank_blocks),
        },
        wire_bytes=hierarchical.wire_bytes,
        level_bytes=hierarchical.level_bytes,
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
    ),
}


def get_comm(name: str) -> Comm:
    """The registry entry of `name`, or a CPCompileError listing the comms."""
    try:
        return COMMS[name]
    except KeyError:
        raise CPCompileError(f"unknown comm {name!r}. Fix: use one of {list(COMMS)}.") from None


def comms_that(takes: Callable[[Comm], bool]) -> list[str]:
    """The names of the comms `takes` accepts, in registry order (the planners' fixes list them)."""
    return [name for name, comm in COMMS.items() if takes(comm)]


def packed_layout_problem(comm: Comm, layout: str) -> tuple[str, str] | None:
    """(rule, fix) when `comm`'s varlen region does not take the packed `layout`: the comm's own words
    (Capabilities.packed_refusals), else the comms that take it."""
    taken = comm.capabilities.packed_layouts
    if layout in taken:
        return None
    if layout in comm.capabilities.packed_refusals:
        return comm.capabilities.packed_refusals[layout]
    known = comms_that(lambda c: c.serves("varlen") and layout in c.capabilities.packed_layouts)
    runs = "its per-batch plan runs" if THD_LAYOUTS[layout].carries_plan else "it runs"
    return (
        f"strategy={layout!r} has no {comm.name!r} region yet ({runs} under {' and '.join(known)} only)",
        f"use comm in {known} with strategy={layout!r}, or strategy={' / '.join(map(repr, taken))} with "
        f"comm={comm.name!r}",
    )


def dense_feature_problem(comm: Comm, features: tuple[str, ...]) -> tuple[str, str] | None:
    """(rule, fix) when `comm`'s dense region builds no blocks for one of the site's `features`."""
    if set(features) <= set(comm.capabilities.dense_features):
        return None
    featured = comms_that(lambda c: c.serves("sdpa") and set(features) <= set(c.capabilities.dense_features))
    return (
        f"its {' and '.join(FEATURES[f] for f in features)} have no blocks under comm={comm.name!r} "
        f"(only {' and '.join(featured)} build windowed and softcapped blocks)",
        "use comm='all_gather' or comm='a2a' for this model",
    )


def refuses_layout(name: str, layout: str) -> bool:
    """Whether comm `name` refuses `layout` by design (a packed layout it does not take, or a dense one without a
    dense region): one CPCompileError, never a run (the bench checks both)."""
    comm = COMMS[name]
    if layout in THD_LAYOUTS:
        return not comm.serves("varlen") or layout not in comm.capabilities.packed_layouts
    return not comm.serves("sdpa")

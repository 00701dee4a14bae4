"""The comm registry: one entry per `comm=` name, each built by its comm's package (comms/<name>/entry.py: its
region for each attention family it serves, its wire bytes and its capabilities, comm/entry.Comm). It lives
beside the packages it lists: comm/ below them holds only what they share.

A new comm is one package plus one line here; the planners, the backend's argument check, the logs, the cost model
behind comm="auto", explain() and the bench read everything else from the entry.
"""

from __future__ import annotations

from collections.abc import Callable

from ..comm.entry import Comm
from ..errors import CPCompileError
from ..kernels import FEATURES
from ..layouts import THD_LAYOUTS
from .a2a.entry import A2A
from .all_gather.entry import ALL_GATHER
from .hierarchical.entry import HIERARCHICAL
from .ring.entry import RING
from .selective.entry import SELECTIVE

COMMS: dict[str, Comm] = {
    comm.name: comm for comm in (ALL_GATHER, A2A, RING, SELECTIVE, HIERARCHICAL)
}  # registry order: comm="auto"'s tie order and the planners' lists of comms


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

"""What a comm's registry entry holds (comms/registry.COMMS): its region for each attention family it serves, its
wire bytes and its capabilities. A comm package (comms/<name>/) builds its own entry from these."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from .capabilities import Capabilities
from .wire import LevelBytes, WireShape


@dataclass(frozen=True)
class Region:
    """One comm's region for one attention family: the function the rewrite calls, taking the family's region
    call (its schema's fields, positionally) and the plan's constants as keywords."""

    attention: Callable
    rank_blocks: Callable | None = None
    """The blocks a rank runs (logs, explain, the cost model): sdpa (layout, causal, rank, world, local_len, window);
    varlen (..., local_len, cu_seqlens, max_doc, window); None where the family is not costed (flex)."""
    deferred_bytes: Callable | None = None
    """(plan) -> (forward, backward) bytes its deferred merge holds beyond the running one (explain()), for a comm
    whose capabilities `defers_merge`."""


@dataclass(frozen=True)
class Comm:
    """How a comm runs attention: its region for each attention family it serves, its wire bytes and its
    capabilities."""

    name: str
    regions: Mapping[str, Region]
    """attention family name (families/registry.py) -> this comm's region for that family; a family it does not
    serve is absent, and that family's planner refuses the comm."""
    wire_bytes: Callable[[WireShape], tuple[int, int]]
    """(a WireShape: comm/wire.py) -> (bytes one rank sends per forward, per backward), for the cost model
    (cost/model.py): every comm has it, since kernel="auto" costs the kernel options under a named comm too."""
    auto_option: bool = True
    """Whether comm="auto" considers it. The ring's advantage is overlap and memory, which the cost model (no
    overlap, no memory term) cannot see: it would never pick it for the right reason, so it is only named, except
    at a point the overlap bench measured (cost/measured.py), where the measured step times rank it."""
    overhead_as: str | None = None
    """The comm whose measured region overhead (cost/rates.json) stands in for this one's (None: its own)."""
    capabilities: Capabilities = field(default_factory=Capabilities)
    """What its regions take (layouts, windows, lse, heads, features, overlap, regather) and why not."""
    level_bytes: Callable[[WireShape], tuple[LevelBytes, ...]] | None = None
    """A comm on a 2-D CP mesh (capabilities.levels): what a rank sends on each level (`wire_bytes` is their sum);
    the cost model and explain() state them."""
    batch_note: Callable[[WireShape, torch.Tensor], str] | None = None
    """explain()'s note on what this comm moves for the example batch at a packed site of this WireShape, given the
    batch's documents as the model receives them (GLOBAL cu_seqlens, or the layout's per-batch plan); None: no
    note (what it sends depends on the shapes alone: the estimate's bytes say it)."""

    def serves(self, family: str) -> bool:
        """Whether it has a region for the attention family `family` (families/registry.py)."""
        return family in self.regions

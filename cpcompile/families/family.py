"""What an attention family is: everything the pass, the token guard, the cost model and explain() need to know
about one kind of attention call, in one object. The registry (families/registry.py) lists them; nothing outside
a family's package switches on its name.

A family's name is also the key of each comm's region for it (comm/entry.Comm.regions) and `AttentionSite.kind`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.fx

if TYPE_CHECKING:
    from ..cost import SiteShape
    from ..graph.bodies import Body
    from ..mesh import CPGroup
    from .plans import CPConfig, CPPlan
    from .site import AttentionSite

RegionChecks = Callable[[list[tuple[torch.fx.Node, "CPPlan"]]], None]


@dataclass(frozen=True)
class Family:
    """One attention family: its matcher, planner, region-call schema, token-guard rule and cost shape."""

    name: str
    """`AttentionSite.kind`, and the key of each comm's region for this family (Comm.regions)."""
    title: str
    """How explain()'s notes name its sites ("SDPA", "varlen_attn")."""
    match: Callable[[torch.fx.Node, Body | None], AttentionSite | None]
    """The site of `node` when it is one of this family's calls, else None (find)."""
    plan: Callable[[AttentionSite, CPConfig, CPGroup], CPPlan]
    """Validate a site of this family and build its plan, or raise one CPCompileError naming the node (plan)."""
    call: type
    """The region call's schema (a NamedTuple): the positional inputs every comm's region of this family takes."""
    seq_dim: int
    """The dim of q (and of the region's output) that holds the tokens (the token guard, the local lengths)."""
    out_seq_dims: tuple[int, ...]
    """The token guard's rule for the region's outputs: the dim holding the tokens of each output in order (a
    region returning one tensor: the first)."""
    offset_fields: tuple[str, ...] = ()
    """Region-call fields holding GLOBAL offsets, never tokens (varlen: cu_seqlens): graph inputs that reach only
    these are not sharded (the token guard)."""
    untokened_fields: tuple[str, ...] = ()
    """Region-call fields that must not hold the sharded tokens (flex: the mods' buffers, indexed by global
    position), and how the token guard names them (`untokened_what`)."""
    untokened_what: str = ""
    insert_checks: RegionChecks | None = None
    """The run-time guards the rewrite inserts once per graph before this family's regions (regions/guards.py)."""
    cost_shape: Callable[[CPPlan, int], SiteShape] | None = None
    """The cost model's SiteShape of a plan at a world size; None: the family is not costed (explain notes it)."""
    uncosted_note: str = ""
    """explain()'s note for a family without a cost shape."""
    recommend_layouts: Callable[[], Sequence[str]] = tuple
    """The layouts explain()'s recommendation costs for this family's sites (costed families)."""
    overlaps: bool = True
    """Whether its regions overlap collectives with blocks in program order where the comm's capabilities say
    so (then the backend keeps Inductor from reordering them: backend.INDUCTOR_OVERLAP_PATCHES)."""
    dtensor_refusal: tuple[str, str] | None = None
    """(rule, fix) for a site of this family on DTensor q/k/v, when its regions take plain tensors only."""
    regather_refusal: tuple[str, str] | None = None
    """(rule, fix) for backend(regather=True), when its regions cannot gather K/V again in backward."""

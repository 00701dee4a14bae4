"""What the planner produces: a CPPlan per attention site, everything its region call needs, as constants."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..comms.registry import get_comm
from ..mesh import CPGroup
from .sdpa.call import DenseCall
from .site import AttentionSite


@dataclass(frozen=True)
class CPConfig:
    """What the user asked for in cpcompile.backend(...): layout, comm, kernel, and the CP group's mesh or
    process group (neither: the default group)."""

    strategy: str
    comm: str
    kernel: str
    mesh: object = None
    group: object = None
    cp_group: CPGroup | None = None
    """A CP group given as it is, not resolved from torch.distributed: explain() plans for a stand-in group of
    `world` ranks this way, without any process group."""
    regather: bool = False
    """all_gather: keep only the local K/V for backward and gather them again there (backend(regather=...))."""
    deferred_merge: bool = False
    """ring: keep every step's partial and merge them once at the end (backend(deferred_merge=...))."""
    mixer_layout: str = "same"
    """Token mixers under zigzag: "same", "auto" or "flat" (mixers/relayout_plan.py; backend(mixer_layout=...))."""
    check_batch: bool = True
    """Check each step's batch against the layout on every rank (regions/batch_check.py; backend(check_batch=...))."""


@dataclass(frozen=True)
class CPPlan:
    """How one site becomes a CP region: everything the region call needs, as constants."""

    site: AttentionSite
    layout: str
    comm: str
    kernel: str
    causal: bool
    scale: float
    group: CPGroup
    dtensor: bool = False
    """q/k/v are DTensors: the region runs on their local shards (comms.dtensor.dtensor_region)."""
    window: tuple[int, int] | None = None
    """A sliding window (left, right) over global positions (cpcompile.attention sites); None: none."""
    softcap: float = 0.0
    """tanh softcapping of the scores (cpcompile.attention sites); 0: none."""
    choice: object = field(default=None, compare=False, repr=False)
    """The cost model's cost.Choice when comm="auto" / kernel="auto" had several options (None: no choice)."""
    regather: bool = False
    """The region gathers K/V again in backward instead of saving them (comms whose capabilities `regathers`)."""
    deferred_merge: bool = False
    """The region merges its steps' partials once at the end (comms whose capabilities `defers_merge`)."""
    sinks: bool = False
    """The site's attention sinks (`site.sinks`, a graph tensor) go to the region (cpcompile.attention sites)."""

    def region_target(self):
        """The comm's region for the site's family (comms/registry.py: Comm.regions)."""
        return get_comm(self.comm).regions[self.site.kind].attention

    def region_call(self) -> DenseCall:
        """The region's positional inputs, by name (graph/region_call.py)."""
        return DenseCall(self.site.query, self.site.key, self.site.value)

    def region_args(self) -> tuple:
        return tuple(self.region_call())

    def region_kwargs(self) -> dict:
        kwargs = self.common_kwargs()
        if self.window is not None:  # only where used: graphs without them stay as they were
            kwargs["window"] = self.window
        if self.softcap:
            kwargs["softcap"] = self.softcap
        if self.regather:
            kwargs["regather"] = True
        if self.deferred_merge:
            kwargs["deferred_merge"] = True
        if self.sinks:
            kwargs["sinks"] = self.site.sinks
        kwargs.update(self.level_kwargs())
        return kwargs

    def level_kwargs(self) -> dict:
        """`levels` for a comm on a 2-D CP mesh: ((inter group, rank, size), (intra group, rank, size))."""
        if not get_comm(self.comm).capabilities.levels:
            return {}
        return {"levels": tuple((lv.name, lv.rank, lv.size) for lv in self.group.levels)}

    def common_kwargs(self) -> dict:
        return dict(
            layout=self.layout,
            causal=self.causal,
            scale=self.scale,
            kernel=self.kernel,
            group_name=self.group.name,
            rank=self.group.rank,
            world=self.group.size,
        )

    def prepare_rewrite(self) -> None:
        """Whatever the region needs changed in the graph before its call replaces the node (nothing here)."""

    def block_count(self) -> int:
        """How many attention blocks this rank runs (what the logs report)."""
        local, rank, world = self.site.q_shape[-2], self.group.rank, self.group.size
        windowed = {} if self.window is None else {"window": self.window}  # (comms without windows refuse them)
        if get_comm(self.comm).capabilities.levels:
            windowed["levels"] = self.group.level_sizes
        blocks = get_comm(self.comm).regions[self.site.kind].rank_blocks
        return len(blocks(self.layout, self.causal, rank, world, local, **windowed))

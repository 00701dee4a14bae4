"""The varlen family's plan: cu_seqlens is a region input, plus the window, the lse and the documents' bound."""

from __future__ import annotations

from dataclasses import dataclass

from ...comms.registry import get_comm
from ...layouts.block import NO_WINDOW
from ..plans import CPPlan
from .call import VarlenCall


@dataclass(frozen=True)
class VarlenPlan(CPPlan):
    """A CPPlan for a varlen site: cu_seqlens is a region input, plus the window and whether lse is read."""

    window: tuple[int, int] = NO_WINDOW
    """Sliding-window limits on top of `causal` ((-1, -1): none; under all_gather only causal (left, 0))."""
    return_lse: bool = True
    """Whether the graph reads the lse output (a2a sends it back only then)."""
    max_doc: int | None = None
    """The call's max_q/max_k (static ints), a bound on every document's length: it bounds the kernels' grids."""

    def region_call(self) -> VarlenCall:
        return VarlenCall(*super().region_call(), cu_seqlens=self.site.cu_seqlens_q)

    def region_kwargs(self) -> dict:
        extra = dict(max_doc=self.max_doc, window=self.window)
        if get_comm(self.comm).capabilities.lse_on_demand:
            extra["return_lse"] = self.return_lse
        if self.regather:  # only where asked: graphs without them stay as they were
            extra["regather"] = True
        if self.deferred_merge:
            extra["deferred_merge"] = True
        return {**self.common_kwargs(), **extra, **self.level_kwargs()}

    def block_count(self) -> int:
        return 1  # every packed region runs one varlen block a rank (layouts.thd)

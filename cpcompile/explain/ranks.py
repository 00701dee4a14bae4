"""explain()'s stand-in for the other CP ranks: the pass's plan and agree steps (passes.PASSES) run against it
instead of the process group's store.

Where the backend's ranks raise at the first refusal, the stand-in records every site's refusal and lets the
plan step go on; its agreement plans each site again for ranks 1..world-1 of the stand-in world (in this
process, nothing sent) and compares the plans as the store would. A site that any rank refuses or plans
differently is dropped from the plans and recorded; then `agree` raises Refused, where explain() stops (the
graph is not rewritten: the token guard checks rewritten graphs only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import CPCompileError, node_origin
from ..families.plans import CPConfig
from ..passes.agree import plan_summary
from ..passes.plan import plan_site
from .report import Refusal

if TYPE_CHECKING:
    from ..families.site import AttentionSite
    from ..passes import PassState


class Refused(Exception):
    """Some site was refused on some rank of the stand-in world (the refusals are recorded): stop the pass."""


class StandInRanks:
    """The ranks of explain()'s stand-in world: `configs[r]` plans as rank r (configs[0] is the pass's own)."""

    def __init__(self, configs: list[CPConfig]) -> None:
        self.configs = configs
        self.refusals: list[tuple[int, Refusal]] = []
        """(the site's index, its refusal), in the order found; `ordered()` sorts them by site."""

    def refused(self, state: PassState, site: AttentionSite, error: CPCompileError) -> None:
        self.refusals.append((_index(state, site.node), Refusal(node_origin(site.node), str(error))))

    def agree(self, state: PassState) -> None:
        kept = []
        for plan in state.plans:
            index = _index(state, plan.site.node)
            problem = self._other_ranks(state.sites[index], plan)
            if problem is None:
                kept.append(plan)
            else:
                self.refusals.append((index, Refusal(node_origin(plan.site.node), problem)))
        state.plans = kept
        if self.refusals:
            raise Refused

    def _other_ranks(self, site: AttentionSite, plan) -> str | None:
        """The refusal of ranks 1..world-1 for `site` (their error, or how their plans differ), or None."""
        try:
            per_rank = [plan] + [plan_site(site, config) for config in self.configs[1:]]
        except CPCompileError as e:
            return str(e)
        summaries = {plan_summary(p) for p in per_rank}
        if len(summaries) > 1:  # the pass's rank agreement would stop the compile
            return "the CP ranks would plan it differently: " + " | ".join(sorted(summaries))
        return None

    def ordered(self) -> list[Refusal]:
        """The refusals in site order (a site is refused once)."""
        return [refusal for _, refusal in sorted(self.refusals, key=lambda found: found[0])]


def _index(state: PassState, node) -> int:
    """The index of the site of `node` (a DTensor site's plan holds a localized copy of its site)."""
    return next(i for i, site in enumerate(state.sites) if site.node is node)

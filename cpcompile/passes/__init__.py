"""The CP pass over one Dynamo graph: find the attention sites, plan every one, then rewrite them.

`run(gm, config)` is the one entry (the backend calls it). PASSES lists the steps in order; each takes the
graph and the PassState the steps hand each other. Every site is planned (and so validated) before any is
rewritten, and all of it happens at compile time, before any collective runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx

from ..errors import CPCompileError
from ..log import log_plans
from ..mesh import CPGroup, resolve_group
from ..mixers import find_mixers, rewrite_mixers
from ..refusal import raise_refusals
from .agree import agree, summarize
from .guard_tokens import refuse_token_mixing
from .match import AttentionSite, find_attention_sites
from .plan import plan_site
from .plans import CPConfig, CPPlan, VarlenPlan
from .rewrite import rewrite_graph


@dataclass
class PassState:
    """What the steps hand each other."""

    config: CPConfig
    sites: list[AttentionSite] = field(default_factory=list)
    plans: list[CPPlan] = field(default_factory=list)


def find(gm: torch.fx.GraphModule, state: PassState) -> None:
    """Every SDPA and varlen_attn call in the graph, normalised (passes/match.py); first, a refusal an
    integration made while Dynamo traced (refusal.py)."""
    raise_refusals(gm)
    state.sites = find_attention_sites(gm)


def plan(gm: torch.fx.GraphModule, state: PassState) -> None:
    """A CPPlan per site, or the first site's CPCompileError (passes/plan.py), which the other CP ranks are
    told about (passes/agree.py) so that they stop too instead of waiting for this rank."""
    try:
        state.plans = [plan_site(site, state.config) for site in state.sites]
    except CPCompileError as e:
        group = _config_group(state.config)
        if group is not None:
            agree(group.group, group.name, group.rank, f"error:{e}")
        raise


def agree_ranks(gm: torch.fx.GraphModule, state: PassState) -> None:
    """Every CP rank planned this graph the same way, or one CPCompileError on each (passes/agree.py)."""
    groups = {p.group.name: p.group for p in state.plans}
    if not groups and (group := _config_group(state.config)) is not None:
        groups = {group.name: group}
    for name, group in groups.items():
        agree(group.group, name, group.rank, summarize([p for p in state.plans if p.group.name == name]))


def rewrite(gm: torch.fx.GraphModule, state: PassState) -> None:
    """Each planned node replaced by its region call (passes/rewrite.py); logged per site."""
    if state.plans:
        rewrite_graph(gm, state.plans)
    log_plans(gm, state.plans)


def mixers(gm: torch.fx.GraphModule, state: PassState) -> None:
    """Each declared token mixer (cpcompile.token_mixer) replaced by its head-parallel all-to-all region
    (cpcompile/mixers/): planned, so refused with one CPCompileError, before any is rewritten."""
    if not find_mixers(gm):
        return
    group = state.plans[0].group if state.plans else state.config.cp_group or _config_group(state.config)
    rewrite_mixers(gm, state.config.strategy, group)


def guard(gm: torch.fx.GraphModule, state: PassState) -> None:
    """Refuse any op left that mixes tokens along the CP-sharded dim, or a flex_attention node
    (passes/guard_tokens.py): one CPCompileError at compile time, never a silently wrong result."""
    refuse_token_mixing(gm, state)


PASSES = (find, plan, agree_ranks, rewrite, mixers, guard)


def run(gm: torch.fx.GraphModule, config: CPConfig) -> list[CPPlan]:
    """Run the pass on `gm` in place; returns the plans of the rewritten sites (empty: nothing to do)."""
    state = PassState(config)
    for step in PASSES:
        step(gm, state)
    return state.plans


def _config_group(config: CPConfig) -> CPGroup | None:
    """The CP group the backend was given (None without torch.distributed: nothing to agree with)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return resolve_group(config.mesh, config.group)
    except CPCompileError:
        return None


__all__ = ["PASSES", "AttentionSite", "CPConfig", "CPPlan", "PassState", "VarlenPlan", "find_attention_sites", "run"]

"""The CP pass over one Dynamo graph: the steps of PASSES in order (find, plan, agree_ranks, rewrite, mixers,
totals, guard), each taking the graph and the PassState the steps hand each other.

`run(gm, config)` is the backend's entry; cpcompile.explain runs the same PASSES with a stand-in for the other
ranks (PassState.ranks) and stops at the first step that refuses. Every site is planned (and so validated) before
any is rewritten, and all of it happens at compile time, before any collective runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.fx

from ..errors import CPCompileError
from ..families.find import find_attention_sites
from ..families.plans import CPConfig, CPPlan
from ..families.site import AttentionSite
from ..log import log_plans
from ..mixers import MixerPlan, find_mixers, rewrite_mixers
from ..refusal import raise_refusals
from .agree import ProcessGroupRanks, Ranks, config_group
from .guard_tokens import refuse_token_mixing
from .plan import plan_site
from .rewrite import rewrite_graph
from .totals import rewrite_totals


@dataclass
class PassState:
    """What the steps hand each other."""

    config: CPConfig
    sites: list[AttentionSite] = field(default_factory=list)
    plans: list[CPPlan] = field(default_factory=list)
    mixers: list[MixerPlan] = field(default_factory=list)
    ranks: Ranks = field(default_factory=ProcessGroupRanks)
    """The other CP ranks (the process group's store; explain(): its stand-in world)."""
    device: torch.device | None = None
    """Plan the kernels for this device instead of the example tensors' (explain's meta models)."""
    compute: bool = True
    """Whether planning may run code on real tensors (the mixers' declaration check); explain() computes nothing."""


def find(gm: torch.fx.GraphModule, state: PassState) -> None:
    """Every call a registered attention family matches, normalised (families/find.py); first, a refusal an
    integration made while Dynamo traced (refusal.py)."""
    raise_refusals(gm)
    state.sites = find_attention_sites(gm)
    if state.device is not None:
        state.sites = [dataclasses.replace(s, device=state.device) for s in state.sites]


def plan(gm: torch.fx.GraphModule, state: PassState) -> None:
    """A CPPlan per site, or the first site's CPCompileError (passes/plan.py), which the other CP ranks are
    told about (passes/agree.py) so that they stop too instead of waiting for this rank."""
    for site in state.sites:
        try:
            state.plans.append(plan_site(site, state.config))
        except CPCompileError as e:
            state.ranks.refused(state, site, e)


def agree_ranks(gm: torch.fx.GraphModule, state: PassState) -> None:
    """Every CP rank planned this graph the same way, or one CPCompileError on each (passes/agree.py)."""
    state.ranks.agree(state)


def rewrite(gm: torch.fx.GraphModule, state: PassState) -> None:
    """Each planned node replaced by its region call (passes/rewrite.py); logged per site."""
    if state.plans:
        rewrite_graph(gm, state.plans, check_batch=state.config.check_batch)
    log_plans(gm, state.plans)


def mixers(gm: torch.fx.GraphModule, state: PassState) -> None:
    """Each declared token mixer (cpcompile.token_mixer) replaced by its head-parallel all-to-all region
    (cpcompile/mixers/): planned, so refused with one CPCompileError, before any is rewritten."""
    if not find_mixers(gm):
        return
    group = state.plans[0].group if state.plans else state.config.cp_group or config_group(state.config)
    state.mixers = rewrite_mixers(gm, state.config.strategy, group, state.config.mixer_layout, state.compute)


def totals(gm: torch.fx.GraphModule, state: PassState) -> None:
    """Each cpcompile::rank_total call (per-rank partial sums a formula needs whole: a MoE aux loss's expert counts)
    replaced by its sum over the CP group (passes/totals.py)."""
    group = state.plans[0].group if state.plans else state.config.cp_group or config_group(state.config)
    rewrite_totals(gm, group)


def guard(gm: torch.fx.GraphModule, state: PassState) -> None:
    """Refuse any op left that mixes tokens along the CP-sharded dim, or a flex_attention node
    (passes/guard_tokens.py): one CPCompileError at compile time, never a silently wrong result."""
    refuse_token_mixing(gm, state)


PASSES = (find, plan, agree_ranks, rewrite, mixers, totals, guard)


def run(gm: torch.fx.GraphModule, config: CPConfig) -> list[CPPlan]:
    """Run the pass on `gm` in place; returns the plans of the rewritten sites (empty: nothing to do)."""
    state = PassState(config)
    for step in PASSES:
        step(gm, state)
    return state.plans


__all__ = [
    "PASSES", "AttentionSite", "CPConfig", "CPPlan", "PassState", "Ranks", "find_attention_sites", "run",
]  # fmt: skip

"""Rank agreement at compile time: every rank's plans for a graph are compared through the process group's
store before any region runs, so ranks that diverge get one clear CPCompileError each, within seconds.

Ranks that planned different layouts, comms, kernels, shapes or dtypes would issue collectives of different
sizes or kinds: gloo fails with "Received data size doesn't match", NCCL hangs until its timeout, and some
mismatches (fp16 vs bf16, flat vs zigzag) even "succeed" with garbage. The store is a key-value service every
rank already talks to (no tensor collective, so nothing can hang on a mismatched size): each rank writes a
summary of its plans for its n-th compiled graph, waits for the other ranks' n-th summaries and compares.
A rank whose planner refused the graph writes its error instead, so the others fail with that error rather
than waiting. The fake process group (graph snapshots, one process) has no peers: nothing to agree on, nor has
a Python process group that says it stands in for its peers (`stands_in_for_peers`: the bench's link group,
cpcompile/testing/link_group.py).
"""

from __future__ import annotations

import ast
import datetime
import os
from collections import defaultdict
from typing import TYPE_CHECKING, Protocol

import torch.distributed as dist

from ..errors import CPCompileError
from ..families.plans import CPConfig, CPPlan
from ..mesh import CPGroup, resolve_group

if TYPE_CHECKING:
    from ..families.site import AttentionSite
    from . import PassState

TIMEOUT_S = float(os.environ.get("CPCOMPILE_AGREE_TIMEOUT", "300"))
"""How long a rank waits for the others to reach the same graph (CPCOMPILE_AGREE_TIMEOUT, seconds)."""

_graphs: dict[str, int] = defaultdict(int)
"""Per CP group: how many graphs this process has compiled with a cpcompile backend (the store key's index)."""


def _shape(shape: tuple) -> tuple:
    """A shape with its symbolic dims (a dynamic batch) written as "dyn": symbol names are per process."""
    return tuple(d if isinstance(d, int) else "dyn" for d in shape)


FIELDS = (
    "kind", "layout", "comm", "kernel", "causal", "scale", "dtensor", "q shape", "k shape", "v shape", "dtype",
    "device", "cp", "window", "max_doc", "softcap", "regather", "sinks", "deferred_merge",
)  # fmt: skip
"""The names of plan_summary's fields, in order."""


def plan_summary(plan: CPPlan) -> str:
    """Everything about a plan that must be the same on every rank (not the rank itself)."""
    s = plan.site
    fields = [
        s.kind, plan.layout, plan.comm, plan.kernel, plan.causal, plan.scale, plan.dtensor, _shape(s.q_shape),
        _shape(s.k_shape), _shape(s.v_shape), str(s.dtype), s.device.type, plan.group.size,
        getattr(plan, "window", None), getattr(plan, "max_doc", None), plan.softcap, plan.regather, plan.sinks,
        plan.deferred_merge,
    ]  # fmt: skip
    return repr(tuple(fields))


def _sites(summary: str) -> list[tuple] | None:
    try:
        return [ast.literal_eval(site) for site in summary[len("sites:") :].split(";") if site]
    except (ValueError, SyntaxError):
        return None


def differences(mine: str, theirs: str, rank: int, other: int) -> str:
    """The first site whose plans differ, by field name (e.g. "site 0 differs in max_doc: rank 0 has 21, rank 1
    has 18"), plus the likely cause when only varlen's max_q/max_k differ; "" when the summaries do not parse."""
    a, b = _sites(mine), _sites(theirs)
    if a is None or b is None:
        return ""
    if len(a) != len(b):
        return f"rank {rank} planned {len(a)} attention sites, rank {other} {len(b)}. "
    for i, (x, y) in enumerate(zip(a, b)):
        diff = [(name, u, v) for name, u, v in zip(FIELDS, x, y) if u != v]
        names = [name for name, _, _ in diff]
        if diff:
            said = ", ".join(f"{n}: rank {rank} has {u!r}, rank {other} {v!r}" for n, u, v in diff)
            hint = ""
            if names == ["max_doc"]:
                hint = (
                    " (varlen_attn's max_q/max_k: they and cu_seqlens must describe the GLOBAL packed batch, the "
                    "same on every rank, not a rank's local tokens, e.g. not torchtitan's get_attention_masks of "
                    "local positions)"
                )
            return f"site {i} differs in {said}{hint}. "
    return ""


def _store_and_peers(group: dist.ProcessGroup):
    """(the default store, the CP group's global ranks), or None where there is nothing to agree on."""
    one_process = dist.get_backend(group) == "fake" or getattr(group, "stands_in_for_peers", False)
    if one_process or dist.get_world_size(group) == 1:
        return None
    return dist.distributed_c10d._get_default_store(), dist.get_process_group_ranks(group)


def agree(group: dist.ProcessGroup, group_name: str, rank: int, summary: str) -> None:
    """Publish this rank's summary of its next graph and raise CPCompileError unless every rank's is the same.

    `summary` starting with "error:" publishes a planner refusal (the caller raises it afterwards)."""
    found = _store_and_peers(group)
    if found is None:
        return
    store, ranks = found
    index = _graphs[group_name]
    _graphs[group_name] += 1
    key = f"cpcompile/agree/{group_name}/{index}/"
    store.set(key + str(rank), summary)
    peers = [r for r in range(len(ranks)) if r != rank]
    try:
        store.wait([key + str(r) for r in peers], datetime.timedelta(seconds=TIMEOUT_S))
    except (RuntimeError, dist.DistStoreError) as e:  # a store timeout
        raise CPCompileError(
            f"CP rank {rank} compiled its graph #{index} but not every other CP rank reached the same graph within "
            f"{TIMEOUT_S:.0f} s ({e}). Fix: run the same model with the same shapes on every CP rank (a rank that "
            "recompiles for other shapes, or skips a compiled call, diverges); CPCOMPILE_AGREE_TIMEOUT sets the wait."
        ) from None
    others = {r: store.get(key + str(r)).decode() for r in peers}
    if summary.startswith("error:"):
        return
    refused = {r: s for r, s in others.items() if s.startswith("error:")}
    if refused:
        r, msg = next(iter(refused.items()))
        raise CPCompileError(f"CP rank {r} refused graph #{index}, so this rank stops too: {msg[len('error:') :]}")
    differ = {r: s for r, s in others.items() if s != summary}
    if differ:
        r, theirs = next(iter(differ.items()))
        raise CPCompileError(
            f"CP ranks planned graph #{index} differently: {differences(summary, theirs, rank, r)}"
            f"Rank {rank} has {summary}, rank {r} has {theirs} "
            "(per site: kind, layout, comm, kernel, causal, scale, dtensor, q/k/v local shapes, dtype, device, cp, "
            "window, max_doc, softcap, regather, sinks, deferred_merge). Fix: give every rank the same "
            "strategy/comm/kernel, dtype, batch size and local length (shard with cpcompile.shard_batch, which cuts "
            "every rank's part of one global batch)."
        )


def summarize(plans: list[CPPlan]) -> str:
    return "sites:" + ";".join(plan_summary(p) for p in plans)


class Ranks(Protocol):
    """The other CP ranks as the pass's plan and agree steps reach them: the process group's store
    (ProcessGroupRanks, the backend) or explain()'s stand-in world (explain/ranks.py), which plans every rank
    in this process and records refusals instead of raising them."""

    def refused(self, state: PassState, site: AttentionSite, error: CPCompileError) -> None:
        """This rank cannot plan `site`: tell the others (the backend then raises `error`)."""

    def agree(self, state: PassState) -> None:
        """Every rank planned this graph as `state.plans` says, or one CPCompileError."""


class ProcessGroupRanks:
    """The backend's ranks: agreement through the CP group's store (`agree`); without torch.distributed (or on
    the fake group) there is nothing to agree with."""

    def refused(self, state: PassState, site: AttentionSite, error: CPCompileError) -> None:
        if (group := config_group(state.config)) is not None:
            agree(group.group, group.name, group.rank, f"error:{error}")
        raise error

    def agree(self, state: PassState) -> None:
        groups = {p.group.name: p.group for p in state.plans}
        if not groups and (group := config_group(state.config)) is not None:
            groups = {group.name: group}
        for name, group in groups.items():
            agree(group.group, name, group.rank, summarize([p for p in state.plans if p.group.name == name]))


def config_group(config: CPConfig) -> CPGroup | None:
    """The CP group the backend was given (None without torch.distributed: nothing to agree with)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return resolve_group(config.mesh, config.group)
    except CPCompileError:
        return None

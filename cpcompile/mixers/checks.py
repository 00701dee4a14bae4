"""The mixers' run-time check: the packed documents' offsets (cu_seqlens) that state-passing regions read, checked
on every rank before any of them runs, once per graph and offsets input, as the varlen sites check theirs
(regions/guards.check_packed_metadata: one 2-int64 all-gather, device asserts, no host sync).

Why: the regions cut each chunk's offsets out of the GLOBAL ones with a clamp (documents.chunk_offsets), which is
exact for valid offsets (documents outside the chunk become empty ones) and silently wrong for others: decreasing
offsets (`[0, 13, 9, 24]`) were clamped into plausible documents (error 0.015 against one process, no message). A
graph with varlen attention checked them at its first attention region, after the mixers before it had read them,
and a graph of mixers alone not at all. The rules: offsets from 0, non-decreasing, ending at the GLOBAL packed length
(a rank's tokens times cp), the same on every rank; a bad one fails every rank's assert ("cpcompile: bad cu_seqlens
...", "cpcompile: cu_seqlens differs between CP ranks ...") before the regions' own collectives.
"""

from __future__ import annotations

import torch.fx

from ..regions.guards import check_packed_metadata
from .declare import read_mixer_call
from .plan_state import StatePlan


def _offsets(plan: StatePlan) -> torch.fx.Node | None:
    """The node of the call's documents' offsets (by keyword, or a module's positional argument), or None."""
    call = read_mixer_call(plan.node)
    cu = plan.spec.named(call.args, call.kwargs)[1].get(plan.documents)
    return cu if isinstance(cu, torch.fx.Node) else None


def _existing(cu: torch.fx.Node, first: torch.fx.Node, total: int, order: dict) -> torch.fx.Node | None:
    """A check of `cu` with the same total already in the graph before `first` (the varlen sites' one)."""
    for user in cu.users:
        if (
            user.op == "call_function"
            and user.target is check_packed_metadata
            and user.graph is first.graph
            and user.kwargs.get("total") == total
            and order[user] < order[first]
        ):
            return user
    return None


def check_documents(plans: list) -> None:
    """Route the offsets of every state-passing region given packed documents through one check_packed_metadata
    call per (graph, offsets input), inserted before the first such mixer node (or the graph's existing check of the
    same offsets, when one comes earlier). Runs on the mixer_call nodes, before they are replaced by their regions
    (which read their inputs from the nodes)."""
    users: dict[tuple[int, torch.fx.Node], list[StatePlan]] = {}
    for plan in plans:
        if plan.comm != "state" or plan.documents is None:
            continue
        cu = _offsets(plan)
        if cu is not None:
            users.setdefault((id(plan.node.graph), cu), []).append(plan)
    for (_, cu), found in users.items():
        graph = found[0].node.graph
        order = {n: i for i, n in enumerate(graph.nodes)}
        first = min((p.node for p in found), key=order.__getitem__)
        plan = found[0]
        total = plan.local_len * plan.group.size
        checked = _existing(cu, first, total, order)
        if checked is None:
            kwargs = dict(
                total=total, max_doc=None, doc_multiple_per_cp=0, group_name=plan.group.name, world=plan.group.size
            )
            with graph.inserting_before(first):
                checked = graph.call_function(check_packed_metadata, (cu,), kwargs)
            checked.meta = dict(cu.meta)
        for p in found:
            p.node.replace_input_with(cu, checked)

"""The layout explain() recommends for a model and world size, and whether switching to it is worth it.

Each layout of the sites' kind (flat / zigzag for SDPA, thd / thd_zigzag for varlen_attn) is planned as the
backend would plan it (the comm and kernel asked for; comm="auto": the planner's own choice per site), and costed
with the same estimate as the report's table: so the asked layout's total is the sum of the table's est. ms, and
the comm named with another layout is the one the backend would pick there. The layout the user asked for stands
unless another is estimated faster by more than cost.TIE (the model's error: a smaller gain is no evidence);
among those, the fastest, earlier ones winning ties (flat before zigzag, thd before thd_zigzag: fewer blocks,
no padding). thd_zigzag needs every document to be a multiple of 2*cp: for a batch that is not, it is costed on
the batch padded by pad_documents, and the advice says how many tokens that adds. thd_balanced (blocks from each
batch's plan) is not costed, so never recommended.

The layout stays the user's choice, since it is the data contract of shard_batch; this only advises.
"""

from __future__ import annotations

import dataclasses

import torch

from ..cost import TIE, Estimate, estimate
from ..errors import CPCompileError, node_origin
from ..families.plans import CPConfig
from ..families.registry import get_family
from ..families.site import AttentionSite
from ..layouts import THD_LAYOUTS
from ..passes.plan import plan_site
from .report import Recommendation


def _padded(cu: torch.Tensor, multiple: int) -> torch.Tensor:
    lengths = cu[1:] - cu[:-1]
    padded = (lengths + multiple - 1) // multiple * multiple
    return torch.cat((cu.new_zeros(1), padded.cumsum(0)))


def _layout_cost(sites, layout: str, config: CPConfig, cu: torch.Tensor | None) -> tuple[list[Estimate], str]:
    """Every site's estimate under `layout` with the comm and kernel the planner picks there (CPCompileError when
    the layout cannot take a site)."""
    world, note = config.cp_group.size, ""
    multiple = THD_LAYOUTS[layout].doc_multiple_per_cp * world if layout in THD_LAYOUTS else 0
    if cu is not None and multiple:
        padded = _padded(cu.long().cpu(), multiple)
        if int(padded[-1]) != int(cu[-1]):
            note = f"needs cpcompile.pad_documents: +{int(padded[-1]) - int(cu[-1])} tokens"
            cu = padded
    estimates = []
    for site in sites:
        plan = plan_site(site, dataclasses.replace(config, strategy=layout))  # the comm asked for, or "auto"
        shape = get_family(plan.site.kind).cost_shape(plan, world)
        if cu is not None:
            shape = dataclasses.replace(shape, tokens=int(cu[-1]) // world)
        estimates.append(estimate(shape, layout, plan.comm, plan.kernel, cu))
    return estimates, note


def _rule(message: str, sites: list[AttentionSite]) -> str:
    """The rule a site error names, without the node's origin and the fix (the refusals list has both)."""
    for site in sites:
        origin = node_origin(site.node) + ": "
        if origin in message:
            message = message.split(origin, 1)[1]
            break
    return message.split(". Fix: ", 1)[0][:200]


def _with(estimates: list[Estimate]) -> str:
    """The comm(s) and kernel(s) a layout's sites run with, e.g. "a2a + cudnn"."""
    return ", ".join(sorted({f"{e.comm} + {e.kernel}" for e in estimates}))


def recommend(sites: list[AttentionSite], config: CPConfig, cu: torch.Tensor | None) -> Recommendation | None:
    """The recommended layout for `sites` (all of one kind: SDPA or varlen_attn), or None without sites."""
    if not sites:
        return None
    family = get_family(sites[0].kind)
    costs: dict[str, tuple[float, list[Estimate], str]] = {}
    refused: dict[str, str] = {}
    for layout in family.recommend_layouts():  # the family's layouts that are costed
        try:
            estimates, note = _layout_cost(sites, layout, config, cu)
        except CPCompileError as e:
            refused[layout] = _rule(str(e), sites)
            continue
        costs[layout] = (sum(e.total_ms for e in estimates), estimates, note)
    if not costs:
        reasons = "; ".join(f"{name}: {why}" for name, why in refused.items())
        under = "" if config.comm == "auto" else f" with comm={config.comm}"
        return Recommendation("none", f"no layout can take these sites{under}: " + reasons)
    fastest = min(total for total, _, _ in costs.values())
    asked = costs.get(config.strategy)
    if asked is not None and asked[0] <= fastest * (1 + TIE):
        chosen = config.strategy  # no other layout is faster by more than the model's error
    else:
        chosen = next(name for name, (total, _, _) in costs.items() if total <= fastest * (1 + TIE))
    parts = []
    for name, (total, estimates, note) in costs.items():
        balance = max(e.balance for e in estimates)
        text = f"{name} {total:.3g} ms with {_with(estimates)}, FLOPs max/mean per rank {balance:.2f}"
        parts.append(text + (f", {note}" if note else ""))
    parts += [f"{name} refused ({why})" for name, why in refused.items()]
    what = "this batch's documents" if cu is not None else "these shapes"
    under = "the planner's comm per site (comm=auto)" if config.comm == "auto" else f"comm={config.comm}, as asked"
    reason = f"{under}; forward + backward over {len(sites)} site(s) for {what}: " + "; ".join(parts)
    total, estimates, _ = costs[chosen]
    return Recommendation(
        chosen, reason, {name: cost for name, (cost, _, _) in costs.items()}, runs_with=_with(estimates),
        asked=config.strategy, gain=0.0 if asked is None else 1 - total / asked[0],
    )  # fmt: skip

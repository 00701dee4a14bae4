"""The layout explain() recommends for a model and world size: the one whose best comm x kernel the cost model
estimates fastest over all its attention sites (packed sites with the example batch's documents), under the comm
asked for (comm="auto": each site's fastest comm).

The layout stays the user's choice, since it is the data contract of shard_batch; this only advises. Each layout
of the sites' kind (flat / zigzag for SDPA, thd / thd_zigzag for varlen_attn) is planned with the comm and the
kernel asked for, so the planner's rules decide what it may use; a layout within cost.TIE of the fastest
loses only to one listed before it (flat before zigzag, thd before thd_zigzag: fewer blocks, no padding).
thd_zigzag needs every document to be a multiple of 2*cp: for a batch that is not, it is costed on the batch
padded by pad_documents, and the reason says how many tokens that adds. thd_balanced (blocks from each batch's
plan) is not costed, so never recommended.
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
    """The fastest estimate of every site under `layout` (CPCompileError when the layout cannot take a site)."""
    world, note = config.cp_group.size, ""
    multiple = THD_LAYOUTS[layout].doc_multiple_per_cp * world if layout in THD_LAYOUTS else 0
    if cu is not None and multiple:
        padded = _padded(cu.long().cpu(), multiple)
        if int(padded[-1]) != int(cu[-1]):
            note = f"needs cpcompile.pad_documents: +{int(padded[-1]) - int(cu[-1])} tokens"
            cu = padded
    best = []
    for site in sites:
        plan = plan_site(site, dataclasses.replace(config, strategy=layout))  # the comm asked for, or "auto"
        options = [(e.comm, e.kernel) for e in plan.choice.options] if plan.choice else [(plan.comm, plan.kernel)]
        shape = get_family(plan.site.kind).cost_shape(plan, world)
        if cu is not None:
            shape = dataclasses.replace(shape, tokens=int(cu[-1]) // world)
        best.append(min((estimate(shape, layout, c, k, cu) for c, k in options), key=lambda e: e.total_ms))
    return best, note


def _rule(message: str, sites: list[AttentionSite]) -> str:
    """The rule a site error names, without the node's origin and the fix (the refusals list has both)."""
    for site in sites:
        origin = node_origin(site.node) + ": "
        if origin in message:
            message = message.split(origin, 1)[1]
            break
    return message.split(". Fix: ", 1)[0][:200]


def recommend(sites: list[AttentionSite], config: CPConfig, cu: torch.Tensor | None) -> Recommendation | None:
    """The recommended layout for `sites` (all of one kind: SDPA or varlen_attn), or None without sites."""
    if not sites:
        return None
    family = get_family(sites[0].kind)
    layouts = family.recommend_layouts()  # the family's layouts that are costed
    costs: dict[str, tuple[float, list[Estimate], str]] = {}
    refused: dict[str, str] = {}
    for layout in layouts:
        try:
            best, note = _layout_cost(sites, layout, config, cu)
        except CPCompileError as e:
            refused[layout] = _rule(str(e), sites)
            continue
        costs[layout] = (sum(e.total_ms for e in best), best, note)
    if not costs:
        reasons = "; ".join(f"{name}: {why}" for name, why in refused.items())
        under = "" if config.comm == "auto" else f" with comm={config.comm}"
        return Recommendation("none", f"no layout can take these sites{under}: " + reasons)
    fastest = min(total for total, _, _ in costs.values())
    chosen = next(name for name, (total, _, _) in costs.items() if total <= fastest * (1 + TIE))
    parts = []
    for name, (total, best, note) in costs.items():
        comms = sorted({f"{e.comm} + {e.kernel}" for e in best})
        balance = max(e.balance for e in best)
        text = f"{name} {total:.3g} ms with {', '.join(comms)}, FLOPs max/mean per rank {balance:.2f}"
        parts.append(text + (f", {note}" if note else ""))
    parts += [f"{name} refused ({why})" for name, why in refused.items()]
    what = "this batch's documents" if cu is not None else "these shapes"
    asked = "the fastest comm per site (comm=auto)" if config.comm == "auto" else f"comm={config.comm}, as asked"
    reason = f"{asked}; estimated forward + backward over {len(sites)} site(s) for {what}: " + "; ".join(parts)
    return Recommendation(chosen, reason, {name: total for name, (total, _, _) in costs.items()})

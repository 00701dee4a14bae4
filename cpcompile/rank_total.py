"""`cpcompile::rank_total`: per-rank partial sums over tokens made whole, for statistics of the batch that a
nonlinear formula reads (a MoE's aux loss reads each expert's share of the routed tokens: integrations/hf_moe.py).

Each rank holds its own tokens, so a sum over tokens is a per-rank partial (the token guard's Share): fine in a
loss that the ranks' shares add up to, wrong wherever a formula needs the batch's total (a product of two such
sums, a fraction of the tokens). `rank_total(xs)` marks such totals in the traced code: without CP (eagerly, one
rank, another backend) it is the values themselves; the pass step (passes/totals.py) rewrites it into
`total_region`, which sums each over the CP group (one all-gather of them all, summed in rank order in float64, so
every rank holds bit-identical totals), and the token guard takes its outputs as replicated values
(guard/stand_ins.py). No gradient flows through it: the totals are counts (routed tokens, target tokens), which
have none in one process either; a differentiable share stays a share and is summed by the user with the loss.
"""

from __future__ import annotations

import torch

from .comm.collectives import all_gather_dim0


@torch.library.custom_op("cpcompile::rank_total", mutates_args=())
def rank_total(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The totals over the CP ranks of `xs` (each rank's partial sums; no gradient); without CP, copies of xs."""
    return [x.detach().clone() for x in xs]


@rank_total.register_fake
def _rank_total_fake(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(x) for x in xs]


RANK_TOTAL = torch.ops.cpcompile.rank_total.default
"""The op overload Dynamo records in the graph."""


def total_region(xs: list[torch.Tensor], *, group_name: str, world: int) -> list[torch.Tensor]:
    """Each of `xs` summed over the CP group: one all-gather of all of them (as float64), summed in rank order."""
    del world
    flat = torch.cat([x.detach().reshape(-1).to(torch.float64) for x in xs])
    total = all_gather_dim0(flat.reshape(1, -1), group_name).sum(0)
    parts = total.split([x.numel() for x in xs])
    return [p.reshape(x.shape).to(x.dtype) for p, x in zip(parts, xs)]

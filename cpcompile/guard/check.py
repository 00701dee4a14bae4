"""The guard's entry: after the rewrite, one CPCompileError for the first op left that mixes tokens along the
CP-sharded dim, for a flex_attention node the rewrite did not reach, or for an input shard / shard_batch sharded
for another layout; the outputs that hold tokens are written on the graph (`token_marks.OUTPUTS_META`) for the
backend, which marks them when the compiled graph runs."""

from __future__ import annotations

import torch.fx

from ..errors import site_error
from ..graph.targets import is_flex
from ..token_marks import OUTPUTS_META
from .infer import guard_graph
from .inputs import input_marks, walk
from .messages import refusal, wrong_layout


def refuse_flex_attention(gm: torch.fx.GraphModule) -> None:
    """A flex_attention node left after the rewrite is refused: the pass rewrites every one it finds (or refuses
    it when planning), so one left sits where the rewrite does not reach, and would attend to local tokens."""
    for node in walk(gm):
        if is_flex(node):
            raise site_error(
                node,
                "this flex_attention call was not rewritten into a CP region (it sits inside a higher-order op the "
                "pass does not search), so it would attend over this rank's tokens only",
                "call flex_attention in the compiled graph itself or inside torch.utils.checkpoint",
                what="flex_attention node",
            )


def refuse_token_mixing(
    gm: torch.fx.GraphModule,
    plans: list,
    cp_size: int,
    seen: set[int] | None = None,
    strategy: str = "zigzag",
    pending: list | None = None,
) -> None:
    """Raise one CPCompileError for the first token-mixing op left in `gm` (nothing is sharded when `cp_size` < 2;
    `seen`: the local lengths of the backend's earlier graphs; `pending`: its earlier graphs that had none,
    infer.guard_graph)."""
    refuse_flex_attention(gm)
    if cp_size < 2:
        return
    refuse_wrong_layout(gm, strategy, cp_size)
    found = guard_graph(gm, plans, seen, strategy, pending)
    if found.flag is not None:
        raise refusal(found.flag, strategy)
    gm.meta[OUTPUTS_META] = tuple((i, tuple((p.dim, p.lo, p.hi) for p in tag.parts)) for i, tag in found.outputs)


def refuse_wrong_layout(gm: torch.fx.GraphModule, strategy: str, cp_size: int) -> None:
    """An input cpcompile.shard / shard_batch sharded with another layout or CP size than this backend's: its
    tokens are not the ones this rank's regions assume (a flat batch under zigzag), so the result would be
    silently wrong. Refused on every rank alike (every rank sharded with the same call)."""
    for name, mark in input_marks(gm).items():
        if mark.strategy is not None and (mark.strategy != strategy or mark.world != cp_size):
            raise wrong_layout(gm, name, mark, strategy, cp_size)

"""The guard's entry: after the rewrite, one CPCompileError for the first op left that mixes tokens along the
CP-sharded dim, or for a flex_attention node the rewrite did not reach."""

from __future__ import annotations

import torch.fx

from ..errors import site_error
from ..graph.targets import is_flex
from .infer import check_graph
from .inputs import walk
from .messages import refusal


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
    infer.check_graph)."""
    refuse_flex_attention(gm)
    if cp_size < 2:
        return
    flag = check_graph(gm, plans, seen, strategy, pending)
    if flag is not None:
        raise refusal(flag)

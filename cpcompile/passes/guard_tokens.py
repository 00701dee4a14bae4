"""The pass step `guard` (after the rewrite): the token guard (cpcompile/guard/) run on the rewritten graph with
this pass's plans, the CP group's size and the local lengths the same backend's earlier graphs had."""

from __future__ import annotations

import torch.fx

from .. import guard as token_guard
from ..errors import CPCompileError
from ..mesh import resolve_group

_SEEN: dict[int, tuple[object, set[int], list]] = {}
"""id(backend config) -> (config, the local sequence lengths of the attention sites compiled with it, its graphs
compiled before any length was known): a later graph of the same backend with no site (after a graph break) whose
inputs have one is checked with it as the sequence length, fully; the graph that brings the first length checks
the earlier ones with it (guard/infer.check_pending)."""


def _memory(config) -> tuple[object, set[int], list]:
    return _SEEN.setdefault(id(config), (config, set(), []))


def _cp_size(state) -> int:
    if state.plans:
        return state.plans[0].group.size
    if state.config.cp_group is not None:
        return state.config.cp_group.size
    try:
        return resolve_group(state.config.mesh, state.config.group).size
    except CPCompileError:
        return 1


def refuse_token_mixing(gm: torch.fx.GraphModule, state) -> None:
    """The pass step: raise one CPCompileError for the first token-mixing op left in `gm` (or a flex_attention
    node the rewrite did not reach)."""
    _, seen, pending = _memory(state.config)
    token_guard.refuse_token_mixing(gm, state.plans, _cp_size(state), seen, state.config.strategy, pending)

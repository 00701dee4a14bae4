"""The pass step `guard` (after the rewrite): the token guard (cpcompile/guard/) run on the rewritten graph with
this pass's plans, the CP group's size and the local lengths the same backend's earlier graphs had."""

from __future__ import annotations

import weakref

import torch.fx

from .. import guard as token_guard
from ..errors import CPCompileError
from ..mesh import resolve_group

_SEEN: dict[int, tuple[set[int], list]] = {}
"""id(backend config) -> (the local sequence lengths of the attention sites compiled with it, its graphs compiled
before any length was known): a later graph of the same backend with no site (after a graph break) whose inputs
have one is checked with it as the sequence length, fully; the graph that brings the first length checks the
earlier ones with it (guard/infer.check_pending). An entry goes with its config (weakref.finalize): holding the
config kept its mesh, and so the process group, alive past destroy_process_group (issue 43)."""


def _memory(config) -> tuple[set[int], list]:
    key = id(config)
    if key not in _SEEN:
        _SEEN[key] = (set(), [])
        weakref.finalize(config, _SEEN.pop, key, None)
    return _SEEN[key]


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
    seen, pending = _memory(state.config)
    token_guard.refuse_token_mixing(gm, state.plans, _cp_size(state), seen, state.config.strategy, pending)

"""Which graphs the pass searches: the Dynamo graph and the bodies of the higher-order ops in it.

torch.utils.checkpoint (both APIs, and torchtitan's checkpoint_wrapper), torch.cond, nested_compile_region
and friends put their code in a subgraph (a GraphModule attribute reached through a get_attr operand of the
higher-order op), so an attention call there is invisible to a walk of the top-level graph: every rank would
attend to its own tokens. The pass searches every body it can reach:

- bodies run exactly once per call (activation checkpoint, wrap, invoke_subgraph, ...): their attention is
  rewritten like any other; the checkpoint's recompute in backward re-runs the region, so it issues the same
  collectives on every rank;
- torch.cond branches: rewritten, and the condition is checked to be the same on every rank before the
  branch runs (passes/rewrite.py), since ranks taking different branches would issue different collectives;
- flex_attention's score_mod / mask_mod graphs are not bodies: they score one (q, kv) pair;
- any other body (while_loop, scan, map, a user autograd.Function traced by Dynamo, ...): attention inside it
  is refused with one CPCompileError (its trip count or its backward is not the pass's to rewrite).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.fx


@dataclass(frozen=True)
class Call:
    """Where a higher-order op's body and the operands its placeholders take sit in the op's args."""

    body: int
    """Index of the body (a get_attr GraphModule)."""
    operands: int
    """Index of the first operand; the body's placeholders take the operands from there on."""
    packed: bool = False
    """The operands are one tuple at index `operands` (hints_wrapper), not the remaining args."""

    def split(self, args: tuple) -> tuple[object, tuple]:
        """(the body, the operands its placeholders take) of a call's args (nodes, or the values they hold)."""
        operands = args[self.operands] if self.packed else args[self.operands :]
        return args[self.body], tuple(operands)


ONCE: dict[str, Call] = {
    "tag_activation_checkpoint": Call(0, 1),
    "wrap_activation_checkpoint": Call(0, 1),
    "wrap": Call(0, 1),
    "wrap_with_autocast": Call(4, 5),  # (device_type, dtype, enabled, cache_enabled, body, *operands)
    "wrap_with_set_grad_enabled": Call(1, 2),  # (enabled, body, *operands)
    "invoke_subgraph": Call(0, 2),  # (body, identifier, *operands)
    "hints_wrapper": Call(0, 1, packed=True),  # (body, operands, kwargs); hints= as a keyword
}
"""Higher-order ops that run their body exactly once per call, in place: attention inside is rewritten, and the
token guard runs the body on the call's operands. Argument positions as Dynamo records them (torch 2.11-2.14)."""

MODS = frozenset({"flex_attention", "flex_attention_backward"})
"""Higher-order ops whose graph operands are score/mask functions, not bodies: they hold no attention (a
flex_attention call is itself a site, families/flex/match.py)."""

BRANCHES = frozenset({"cond"})
"""Higher-order ops that run one of their bodies: rewritten, with the condition agreed across ranks."""


@dataclass(frozen=True)
class Body:
    """A graph the pass searches: the top-level graph (no hops) or a body nested in the higher-order op calls
    `hops` (outermost first; each lives in the graph of the one before)."""

    module: torch.fx.GraphModule
    hops: tuple[torch.fx.Node, ...] = ()

    @property
    def enclosing(self) -> tuple[str, ...]:
        """Names of the higher-order ops around this body, outermost first."""
        return tuple(hop_name(h) for h in self.hops)

    @property
    def refused_hop(self) -> str | None:
        """The first enclosing higher-order op whose body's attention the pass cannot rewrite, or None."""
        return next((n for n in self.enclosing if n not in ONCE and n not in BRANCHES), None)

    @property
    def branches(self) -> tuple[torch.fx.Node, ...]:
        """The enclosing torch.cond calls (their conditions must agree across ranks)."""
        return tuple(h for h in self.hops if hop_name(h) in BRANCHES)


def hop_name(node: torch.fx.Node) -> str | None:
    """The higher-order op's name when `node` calls one, else None."""
    if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
        return node.target.name()
    return None


def _submodule(gm: torch.fx.GraphModule, arg) -> torch.fx.GraphModule | None:
    if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
        sub = getattr(gm, str(arg.target), None)
        if isinstance(sub, torch.fx.GraphModule):
            return sub
    return None


def bodies(gm: torch.fx.GraphModule) -> Iterator[Body]:
    """The top-level graph, then every higher-order-op body reachable from it (each module once), depth first."""
    seen: set[int] = set()

    def walk(body: Body) -> Iterator[Body]:
        if id(body.module) in seen:
            return
        seen.add(id(body.module))
        yield body
        for node in body.module.graph.nodes:
            if hop_name(node) is None or hop_name(node) in MODS:
                continue
            for arg in (*node.args, *node.kwargs.values()):
                sub = _submodule(body.module, arg)
                if sub is not None:
                    yield from walk(Body(sub, (*body.hops, node)))

    yield from walk(Body(gm))

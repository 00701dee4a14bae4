"""Run one FX graph on meta tensors and follow this rank's tokens through it with cpcompile's own token rules.

Every value that holds the sharded tokens carries a tag (cpcompile/guard/tags.py): `Seq` (where the token axis
is, merged dims included), `Share` (a per-rank sum/mean/max over tokens) or `Local` (made from the local
length). At each aten op the op family's rule (cpcompile/guard/rules.py, reduce.py, index.py) gives the outputs'
tags or a refusal: a `Flag`. The rules are the project's own, so the answers do not depend on the torch version;
DTensor's propagator is asked only about ops no rule covers (guard/fallback.py).

The values stay plain meta tensors with the graph's shapes: nothing is computed or communicated. Meta, not
FakeTensorMode: nothing needs a device or a value (the graph's factories are sent to the meta device, its
constants and real parameters moved there).

cpcompile's region calls are not run: a stand-in returns a fresh output of the traced shape holding the tokens
on the sequence dim (SDPA out dim 2; varlen out dim 0, lse dim 1; a token mixer's region, node meta
`cpcompile_token_region`: its declared seq dim). Higher-order ops with a body (checkpoint,
wrap, invoke_subgraph) run their body with the same tracking, torch.cond both of its branches (the ranks
agree on the predicate at run time: passes/agree.py); any other higher-order op with a token-holding operand is
a Flag (it cannot be looked into). Code marked with cpcompile.mark_token_local runs without tracking and hands
the tokens on to its outputs (token_local.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx
from torch.utils import _pytree as pytree

from ..guard import rules as _rules
from ..guard.dispatch import Tracker as _Dispatch
from ..guard.tags import Part, Seq, Share, whole
from ..mixers import TOKEN_REGION
from ..regions.guards import agree_condition, check_packed_metadata
from ..token_local import is_token_local_node, is_token_local_op

RUN_TIME_GUARDS = frozenset({agree_condition, check_packed_metadata})
"""The pass's run-time checks (regions/guards.py): token-local, not run here (they would communicate)."""

BODY_OPERANDS = {"tag_activation_checkpoint": 1, "wrap": 1, "invoke_subgraph": 2}
"""Higher-order ops the analysis runs through: name -> index of the first operand after the body (its
placeholders are those operands)."""


@dataclass(frozen=True)
class Flag:
    """One op that needs tokens this rank does not hold.

    kind: "gather" (it needs other ranks' tokens), "partial" (a per-rank reduction over tokens is used as if it
    were the total), "positions" (a value made from the local length is used as positions), "unknown" (no rule:
    cannot tell), "hop" (a higher-order op that cannot be looked into), "flex_buffer" (a flex mod buffer holds
    this rank's tokens only). pairwise: tokens meet every other token, as in attention.
    """

    node: torch.fx.Node
    op: str
    kind: str
    pairwise: bool = False
    detail: str = ""


@dataclass
class Result:
    """What one run found: the flagged ops in execution order, and the regions whose inputs were misplaced."""

    flags: list[Flag] = field(default_factory=list)
    inconsistent: list[torch.fx.Node] = field(default_factory=list)
    """Region calls whose q/k/v did not arrive holding tokens on their sequence dim (the assignment is wrong)."""
    fallbacks: set[str] = field(default_factory=set)
    """Ops no rule covers that DTensor was asked about."""


def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from _tensors(a, {})


class Tracker(_Dispatch):
    """The dispatch tracker plus the node being run (for the flags) and marked code's hand-over."""

    def __init__(self) -> None:
        super().__init__(self._on_flag)
        self.result = Result()
        self.node: torch.fx.Node | None = None

    def _on_flag(self, op: str, verdict) -> None:
        self.flag(op, verdict.kind, verdict.pairwise, verdict.detail)

    def flag(self, op, kind: str, pairwise: bool = False, detail: str = "") -> None:
        self.result.flags.append(Flag(self.node, str(op), kind, pairwise, detail))

    def seq_dim(self, t) -> int | None:
        tag = self.tag(t)
        if isinstance(tag, Seq) and len(tag.parts) == 1 and tag.parts[0].hi == t.shape[tag.parts[0].dim]:
            return tag.parts[0].dim
        return None

    def carry(self, inputs, outputs) -> None:
        """Token-local code: each output holds tokens on a dim with an input's token count (the input's dim
        index first), else none."""
        sources = []
        for t in inputs:
            tag = self.tag(t)
            if isinstance(tag, Seq):
                sources += [(t.shape[p.dim], p.dim, p) for p in tag.parts]
        sizes, dims = {n for n, _, _ in sources}, {d for _, d, _ in sources}
        for out in outputs:
            cands = [d for d, n in enumerate(out.shape) if n in sizes]
            pick = next((d for d in cands if d in dims), cands[0] if cands else None)
            part = next((p for n, d, p in sources if pick is not None and n == out.shape[pick]), None)
            self.place(out, None if pick is None else Seq((Part(pick, part.lo, part.hi),)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.suspended and is_token_local_op(func):
            kwargs = kwargs or {}
            self.suspended += 1
            try:
                out = super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self.suspended -= 1
            outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            self.carry(list(_tensors(args, kwargs)), outs)
            return out
        return super().__torch_dispatch__(func, types, args, kwargs)


META = torch.device("meta")


def concrete(shape) -> tuple[int, ...]:
    """Sizes of a traced shape, symbolic ones at their hint (the example's size): a graph with dynamic dims is
    checked at the sizes it was traced with."""
    return tuple(int(s) if isinstance(s, int) else int(s.node.hint) for s in shape)


def _fresh(value):
    """A new meta tensor like a traced value (the traced ones are Dynamo's fake tensors)."""
    if isinstance(value, torch.Tensor):
        if hasattr(value, "_local_tensor") and hasattr(value, "placements"):  # a DTensor: its global shape
            return torch.empty(concrete(value.shape), dtype=value.dtype, device=META)
        return torch.empty_strided(concrete(value.shape), concrete(value.stride()), dtype=value.dtype, device=META)
    if isinstance(value, (list, tuple)):
        return type(value)(_fresh(v) for v in value)
    if isinstance(value, torch.SymInt):  # a dynamic size placeholder: at the size it was traced with
        return int(value.node.hint)
    return value


def _traced(node: torch.fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))


class Runner(torch.fx.Interpreter):
    """Runs a graph (or a higher-order op's body) node by node under the Tracker."""

    def __init__(self, gm: torch.fx.GraphModule, tracker: Tracker) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.tracker = tracker

    def run_node(self, n: torch.fx.Node):
        if n.meta.get("cpcompile_check"):  # a run-time guard the rewrite inserted (regions/guards.py): no tokens out
            return None
        prev, self.tracker.node = self.tracker.node, n
        try:
            if n.op in ("call_function", "call_method", "call_module") and not n.meta.get("cpcompile_plan"):
                if is_token_local_node(n):
                    return self._token_local(n)
            return super().run_node(n)
        finally:
            self.tracker.node = prev

    def _token_local(self, n: torch.fx.Node):
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        self.tracker.suspended += 1
        try:
            out = getattr(self, n.op)(n.target, args, kwargs)
        finally:
            self.tracker.suspended -= 1
        inputs = list(_tensors(args, kwargs))
        self.tracker.carry(inputs, [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)])
        return out

    def call_function(self, target, args, kwargs):
        node = self.tracker.node
        plan = node.meta.get("cpcompile_plan")
        if plan is not None:
            return self._region(plan, node, args)
        if (seq := node.meta.get(TOKEN_REGION)) is not None:
            return self._token_region(node, args, kwargs, seq)
        if target in RUN_TIME_GUARDS:  # they communicate (a few ints) and hand back their checked input
            return args[0]
        if isinstance(target, torch._ops.HigherOrderOperator):
            return self._higher_order(target, node, args)
        return super().call_function(target, args, kwargs)

    def _region(self, plan, node: torch.fx.Node, args):
        """A CP region: q/k/v must arrive holding tokens on their sequence dim; the output holds them there."""
        seq = 0 if plan.site.kind == "varlen" else 2
        for t in args[:3]:
            tag = self.tracker.tag(t)
            if isinstance(tag, Share):
                self.tracker.flag("the attention region", "partial", detail=f"{tag.describe()} goes into attention")
            elif self.tracker.seq_dim(t) != seq:
                self.tracker.result.inconsistent.append(node)
        out = _fresh(_traced(node))
        if plan.site.kind == "sdpa":
            self.tracker.place(out, whole(seq, out.shape[seq]))
        elif plan.site.kind == "flex":  # (out, lse, max_scores); the mods index their buffers by GLOBAL position
            for t in _tensors(args[5:], {}):
                if (tag := self.tracker.tag(t)) is not None:
                    what = "a flex_attention score_mod/mask_mod buffer"
                    self.tracker.flag(what, "flex_buffer", detail=tag.describe())
            for t in out:
                self.tracker.place(t, whole(seq, t.shape[seq]))
        else:
            for t, d in zip(out, (0, 1)):
                self.tracker.place(t, whole(d, t.shape[d]))
        return out

    def _token_region(self, node: torch.fx.Node, args, kwargs, seq: int):
        """A token mixer's head-parallel region (cpcompile/mixers/): its token inputs must arrive holding tokens
        on `seq` (weights hold none); its outputs hold them there."""
        for t in _tensors(args, kwargs):
            tag = self.tracker.tag(t)
            if isinstance(tag, Share):
                self.tracker.flag("the token mixer region", "partial", detail=f"{tag.describe()} goes into it")
            elif tag is not None and self.tracker.seq_dim(t) != seq % t.dim():
                self.tracker.result.inconsistent.append(node)
        out = _fresh(_traced(node))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.tracker.place(t, whole(seq % t.dim(), t.shape[seq]))
        return out

    def _higher_order(self, hop, node: torch.fx.Node, args):
        start = BODY_OPERANDS.get(hop.name())
        if start is not None and isinstance(args[0], torch.fx.GraphModule):
            return Runner(args[0], self.tracker).run(*args[start:])
        if hop.name() == "cond" and all(isinstance(b, torch.fx.GraphModule) for b in args[1:3]):
            return self._cond(node, *args[1:4])
        if any(self.tracker.tag(t) is not None for t in _tensors(args, {})):
            self.tracker.flag(hop.name(), "hop")
        return _fresh(_traced(node))

    def _cond(self, node: torch.fx.Node, true_fn, false_fn, operands):
        """Both branches run on the same operands. An output carries the tokens where either branch's does (a
        branch may return a token-wise constant instead); the two must not put them on different dims."""
        outs = [Runner(body, self.tracker).run(*operands) for body in (true_fn, false_fn)]
        leaves = [[t for t in pytree.tree_leaves(o) if isinstance(t, torch.Tensor)] for o in outs]
        for first, second in zip(*leaves):
            p, q = self.tracker.tag(first), self.tracker.tag(second)
            if p is not None and q is not None and p != q:
                detail = f"its two branches place the sequence dim differently ({p.describe()} and {q.describe()})"
                self.tracker.flag("cond", "hop", detail=detail)
            self.tracker.place(first, p if p is not None else q)
        return outs[0]


def track(
    gm: torch.fx.GraphModule, seeds: dict[str, int], length: int | None = None, state: frozenset[str] = frozenset()
) -> Result:
    """Run `gm` on meta tensors like its traced inputs, placeholder `name` holding tokens on dim seeds[name]
    (`length`: the local sequence length, for the local-length checks); what it found."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [_traced(n) for n in placeholders]
    tracker = Tracker()
    _rules.LOCAL_LENGTH.clear()
    _rules.STATE.clear()
    if length:
        _rules.LOCAL_LENGTH[0] = length
    try:
        with torch.no_grad():
            inputs = [_fresh(v) for v in values]
            for n, t in zip(placeholders, inputs):
                if n.name in state:
                    _rules.STATE.add(id(t))
                if n.name in seeds:
                    tracker.place(t, whole(seeds[n.name], t.shape[seeds[n.name]]))
            with tracker:
                Runner(gm, tracker).run(*inputs)
    finally:
        _rules.LOCAL_LENGTH.clear()
        _rules.STATE.clear()
    tracker.result.fallbacks = tracker.fallbacks
    return tracker.result


__all__ = ["BODY_OPERANDS", "Flag", "Result", "Runner", "Tracker", "track"]

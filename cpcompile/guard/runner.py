"""Run one FX graph on meta tensors under the tracker, node by node, and follow this rank's tokens through it.

cpcompile's region calls are not run: stand_ins.py gives their outputs. A higher-order op that runs its body
once (graph/bodies.py ONCE: the same table find rewrites by) runs its body on the call's operands with the same
tracking; torch.cond runs both of its branches (the ranks agree on the predicate at run time: passes/agree.py);
any other higher-order op with a token-holding operand is a Flag (it cannot be looked into). Code marked with
cpcompile.mark_token_local runs without tracking and hands the tokens on to its outputs (token_local.py). The
run-time guards the rewrite inserted (regions/guards.py) are token-local and not run (they would communicate).
"""

from __future__ import annotations

import torch
import torch.fx
from torch.utils import _pytree as pytree

from ..compat.graph_break import disabled_callee, ends_at_graph_break
from ..graph.bodies import BRANCHES, ONCE
from ..mixers import TOKEN_REGION
from ..rank_total import total_region
from ..regions.guards import agree_condition, check_packed_metadata
from ..token_local import is_token_local_function, is_token_local_node
from . import rules
from .flow import NodeTracker, Result, fresh, leaves, tensors, traced
from .length import is_length_node, length_symbols, length_tensor, length_use
from .stand_ins import rank_total, region, token_region
from .tags import Local, Seq, Share, whole

RUN_TIME_GUARDS = frozenset({agree_condition, check_packed_metadata})
"""The pass's run-time checks (regions/guards.py): token-local, not run here (they would communicate)."""


class Runner(torch.fx.Interpreter):
    """Runs a graph (or a higher-order op's body) node by node under the tracker."""

    def __init__(self, gm: torch.fx.GraphModule, tracker: NodeTracker) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.tracker = tracker

    def run_node(self, n: torch.fx.Node):
        if n.meta.get("cpcompile_check"):  # a run-time guard the rewrite inserted (regions/guards.py): no tokens out
            return None
        prev, self.tracker.node = self.tracker.node, n
        try:
            local = None
            if n.op in ("call_function", "call_method", "call_module") and not n.meta.get("cpcompile_plan"):
                if is_token_local_node(n):
                    return self._token_local(n)
                if (length := rules.LOCAL_LENGTH.get(0)) and not self.tracker.suspended:
                    local = self._length_use(n, length)
            out = super().run_node(n)
            if is_length_node(n, self.tracker.length_symbols, self.tracker.length_nodes):
                self.tracker.length_nodes.add(n)
            if local is not None and isinstance(out, torch.Tensor):
                self.tracker.place(out, local)
            return out
        finally:
            self.tracker.node = prev

    def _length_use(self, n: torch.fx.Node, length: int) -> Local | None:
        """Flag `n` when it uses the local length as a number with token data (length.py); the Local tag of the
        tensor it makes of the length (`torch.tensor(n)`), if it does."""
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        nodes = self.tracker.length_nodes
        if (why := length_use(n, args, kwargs, length, self.tracker.tag, nodes)) is not None:
            self.tracker.flag(n.target if n.op == "call_method" else getattr(n.target, "__name__", n.target),
                              "length", detail=why)  # fmt: skip
        return length_tensor(n, args, kwargs, length, self.tracker.tag, nodes)

    def _token_local(self, n: torch.fx.Node):
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        self.tracker.suspended += 1
        try:
            out = getattr(self, n.op)(n.target, args, kwargs)
        finally:
            self.tracker.suspended -= 1
        self.tracker.carry(list(tensors(args, kwargs)), leaves(out))
        return out

    def call_function(self, target, args, kwargs):
        node = self.tracker.node
        plan = node.meta.get("cpcompile_plan")
        if plan is not None:
            return region(self.tracker, plan, node, args)
        if (seq := node.meta.get(TOKEN_REGION)) is not None:
            return token_region(self.tracker, node, args, kwargs, seq)
        if target is total_region:  # per-rank partial sums made whole over the CP group
            return rank_total(self.tracker, node, args)
        if target in RUN_TIME_GUARDS:  # they communicate (a few ints) and hand back their checked input
            return args[0]
        if isinstance(target, torch._ops.HigherOrderOperator):
            return self._higher_order(target, node, args)
        return super().call_function(target, args, kwargs)

    def _higher_order(self, hop, node: torch.fx.Node, args):
        name = hop.name()
        if name in ONCE:
            body, operands = ONCE[name].split(args)
            if isinstance(body, torch.fx.GraphModule):
                return Runner(body, self.tracker).run(*operands)
        if name in BRANCHES and all(isinstance(b, torch.fx.GraphModule) for b in args[1:3]):
            return self._cond(*args[1:4])
        if any(self.tracker.tag(t) is not None for t in tensors(args, {})):
            self.tracker.flag(name, "hop")
        return fresh(traced(node))

    def _cond(self, true_fn, false_fn, operands):
        """Both branches run on the same operands. An output carries the tokens where either branch's does (a
        branch may return a token-wise constant instead); the two must not put them on different dims."""
        outs = [Runner(body, self.tracker).run(*operands) for body in (true_fn, false_fn)]
        for first, second in zip(*(leaves(o) for o in outs)):
            p, q = self.tracker.tag(first), self.tracker.tag(second)
            if p is not None and q is not None and p != q:
                detail = f"its two branches place the sequence dim differently ({p.describe()} and {q.describe()})"
                self.tracker.flag("cond", "hop", detail=detail)
            self.tracker.place(first, p if p is not None else q)
        return outs[0]


def track(
    gm: torch.fx.GraphModule,
    seeds: dict[str, int | Seq],
    length: int | None = None,
    state: frozenset[str] = frozenset(),
) -> Result:
    """Run `gm` on meta tensors like its traced inputs, placeholder `name` holding tokens on dim seeds[name] (or
    on the token axis a Seq tag gives: a marked input, token_marks.py) (`length`: the local sequence length, for
    the local-length checks; `state`: the placeholders that are model state); what it found."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [traced(n) for n in placeholders]
    tracker = NodeTracker()
    tracker.length_symbols = length_symbols(placeholders, seeds)
    rules.LOCAL_LENGTH.clear()
    rules.STATE.clear()
    if length:
        rules.LOCAL_LENGTH[0] = length
    try:
        with torch.no_grad():
            inputs = [fresh(v) for v in values]
            for n, t in zip(placeholders, inputs):
                if n.name in state:
                    rules.STATE.add(id(t))
                if n.name in seeds:
                    seed = seeds[n.name]
                    tracker.place(t, seed if isinstance(seed, Seq) else whole(seed, t.shape[seed]))
            with tracker:
                out = Runner(gm, tracker).run(*inputs)
            top = out if isinstance(out, (tuple, list)) else ()  # Dynamo's graphs return a flat tuple
            tags = [(i, tracker.tag(v)) for i, v in enumerate(top)]
            tracker.result.outputs = tuple((i, tag) for i, tag in tags if isinstance(tag, Seq))
            if ends_at_graph_break(gm):
                _outputs_into_python(gm, tracker, out)
                if length:
                    _outputs_into_disabled(gm, tracker, out)
    finally:
        rules.LOCAL_LENGTH.clear()
        rules.STATE.clear()
    tracker.result.fallbacks = tracker.fallbacks
    alive = live(gm)
    tracker.result.flags = [f for f in tracker.result.flags if f.node is None or f.node.graph is not gm.graph
                            or f.node in alive]  # fmt: skip
    return tracker.result


def _outputs_into_python(gm: torch.fx.GraphModule, tracker: NodeTracker, out) -> None:
    """A graph cut at a graph break hands its outputs on to Python code: an integer or bool reduction over
    tokens among them (max(position_ids) + 1, a count) is read there as a number (a branch, a size), each rank
    its own. A floating-point one (a loss share) is taken as the caller's share to combine."""
    node = next(n for n in gm.graph.nodes if n.op == "output")
    sources = pytree.tree_leaves(node.args[0])
    for value, source in zip(pytree.tree_leaves(out), sources):
        tag = tracker.tag(value) if isinstance(value, torch.Tensor) else None
        if isinstance(tag, Share) and not (value.is_floating_point() or value.is_complex()):
            tracker.node = source if isinstance(source, torch.fx.Node) else node
            detail = f"{tag.describe()} leaves the graph at a graph break, into Python code"
            tracker.flag("the graph's output", "branch", detail=detail)
            return


def _outputs_into_disabled(gm: torch.fx.GraphModule, tracker: NodeTracker, out) -> None:
    """A graph cut to call a torch.compiler.disable'd function: it runs eagerly on what the graph hands on, where
    no graph (and no guard) sees it. Refused when this rank's tokens are among the outputs, unless the function
    is marked token-local (the eager guard catches attention there; a cumsum it cannot)."""
    callee = disabled_callee(gm)
    if callee is None or (callee[1] is not None and is_token_local_function(callee[1])):
        return
    node = next(n for n in gm.graph.nodes if n.op == "output")
    sources = pytree.tree_leaves(node.args[0])
    for value, source in zip(pytree.tree_leaves(out), sources):
        if isinstance(value, torch.Tensor) and isinstance(tracker.tag(value), Seq):
            tracker.node = source if isinstance(source, torch.fx.Node) else node
            detail = f"this rank's tokens go on into the torch.compiler.disable'd function {callee[0]} ({callee[2]})"
            tracker.flag(callee[0], "eager", detail=detail)
            return


def live(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """Nodes whose result reaches the graph's output or an op with a side effect: a refusal of a dead node (a
    value Dynamo traced but nothing uses) would refuse a correct model."""
    roots = [n for n in gm.graph.nodes if n.op == "output" or _effectful(n)]
    seen: set[torch.fx.Node] = set()
    while roots:
        n = roots.pop()
        if n not in seen:
            seen.add(n)
            roots.extend(n.all_input_nodes)
    return seen


def _effectful(n: torch.fx.Node) -> bool:
    if n.op not in ("call_function", "call_method"):
        return n.op != "placeholder" and n.op != "get_attr"
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    if name.endswith("_") or "out" in n.kwargs or isinstance(n.target, torch._ops.HigherOrderOperator):
        return True
    try:
        return n.is_impure()
    except Exception:  # noqa: BLE001  (a target torch cannot judge: kept)
        return True

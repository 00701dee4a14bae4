"""Run one FX graph on meta tensors and follow the CP-sharded sequence dim through it with DTensor's own rules.

Every value that carries the sharded sequence gets a DTensor placement on a fake 2-rank mesh: `Shard(d)` (dim
d holds this rank's tokens; `_StridedShard` after a flatten with the batch), or `Partial` (a sum/mean/max over
the tokens: each rank holds its share). At each aten op with such an input, DTensor's ShardingPropagator (the
same code that decides a DTensor program's collectives) picks the cheapest valid strategy; when that strategy
has to move a sequence-carrying input off its placement (gather it, re-shard it on another dim, or sum a
Partial across ranks), the op needs tokens this rank does not hold: a `Flag`. Nothing here is a list of ops.

Only the propagator's decisions are used: the values stay plain meta tensors with the graph's shapes (the
"global" shape the propagator sees is this rank's local shape), nothing is redistributed and no collective
exists. Meta, not FakeTensorMode: nothing needs a device or a value, and meta kernels run 2.4x faster here (the
factories of the graph are sent to the meta device, its constants and real parameters moved there).

cpcompile's region calls are not run: a stand-in returns a fresh output of the traced shape placed on the
sequence dim (SDPA out dim 2; varlen out dim 0, lse dim 1). Higher-order ops with a body (checkpoint,
wrap, invoke_subgraph) run their body with the same tracking, torch.cond both of its branches (the ranks
agree on the predicate at run time: passes/agree.py); any other higher-order op with a sequence-carrying
operand is a Flag (it cannot be looked into). Code marked with cpcompile.mark_token_local runs
without tracking and hands the sequence dim on to its outputs (token_local.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

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

    kind: "gather" (a sequence-sharded input must be gathered or re-sharded), "partial" (a per-rank reduction
    over tokens is used as if it were the total), "unknown" (no sharding rule: cannot tell), "hop" (a
    higher-order op that cannot be looked into), "flex_buffer" (a flex mod buffer holds this rank's tokens only).
    pairwise: two sequence-sharded operands meet along their sequence dims (every token against every token, as
    attention does).
    """

    node: torch.fx.Node
    op: str
    kind: str
    pairwise: bool = False
    moves: tuple = ()
    """(placement before, placement the op needs) of each sequence-carrying input it would move."""
    detail: str = ""


@dataclass
class Result:
    """What one run found: the flagged ops in execution order, and the regions whose inputs were misplaced."""

    flags: list[Flag] = field(default_factory=list)
    inconsistent: list[torch.fx.Node] = field(default_factory=list)
    """Region calls whose q/k/v did not arrive placed on their sequence dim (the assignment is wrong)."""


@functools.cache
def _mesh(device_type: str) -> DeviceMesh:
    """A 2-rank mesh that only names placements: no process group, never communicates."""
    return DeviceMesh(device_type, torch.arange(2), _init_backend=False, _rank=0)


def _tensors(args, kwargs):
    """The tensors among an aten op's arguments (they are flat, or lists of tensors)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from _tensors(a, {})


META = torch.device("meta")
MAX_DECISIONS = 65536
_DECISIONS: dict = {}
"""The propagator's answer per (op, argument placements/shapes/strides/dtypes, other arguments): layers repeat,
and so do recompiles."""


@functools.cache
def _makes_tensors(func) -> bool:
    """Ops with a `device` argument (factories, *_like): their tensors are made on the meta device."""
    return any(a.name == "device" for a in func._schema.arguments)


def _meta(t: torch.Tensor) -> torch.Tensor:
    return t if t.device == META else t.to(META)


def _dim(p) -> int | None:
    return p.dim if hasattr(p, "dim") and not p.is_partial() else None


class Tracker(TorchDispatchMode):
    """Placements of the sequence-carrying meta tensors, updated at every aten op from DTensor's propagator."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mesh = mesh
        self.placed: dict[int, tuple[torch.Tensor, object]] = {}  # id -> (tensor, placement); holds the tensor
        self.result = Result()
        self.node: torch.fx.Node | None = None
        self.suspended = 0
        self.propagator = DTensor._op_dispatcher.sharding_propagator

    def place(self, t: torch.Tensor, p) -> None:
        if p is None or isinstance(p, Replicate):
            self.placed.pop(id(t), None)
        else:
            self.placed[id(t)] = (t, p)

    def placement(self, t) -> object | None:
        entry = self.placed.get(id(t)) if isinstance(t, torch.Tensor) else None
        return entry[1] if entry is not None else None

    def flag(self, op, kind: str, pairwise: bool = False, moves: tuple = (), detail: str = "") -> None:
        self.result.flags.append(Flag(self.node, str(op), kind, pairwise, moves, detail))

    def carry(self, inputs, outputs) -> None:
        """Token-local code: each output's sequence dim is a dim with an input's sequence length (the input's dim
        index first), else the output carries no tokens."""
        sources = [(t.shape[d], d) for t in inputs if (d := _dim(self.placement(t))) is not None]
        sizes, dims = {n for n, _ in sources}, {d for _, d in sources}
        for out in outputs:
            cands = [d for d, n in enumerate(out.shape) if n in sizes]
            pick = next((d for d in cands if d in dims), cands[0] if cands else None)
            self.place(out, None if pick is None else Shard(pick))

    def _spec(self, t: torch.Tensor) -> DTensorSpec:
        p = self.placement(t) or Replicate()
        return DTensorSpec(self.mesh, (p,), tensor_meta=TensorMeta(t.shape, t.stride(), t.dtype))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _makes_tensors(func) and kwargs.get("device") != META:
            kwargs = {**kwargs, "device": META}
        if any(t.device != META for t in _tensors(args, kwargs)):  # constants of the graph, real parameters
            args, kwargs = pytree.tree_map_only(torch.Tensor, _meta, (args, kwargs))
        out = func(*args, **kwargs)
        if self.suspended or not any(id(t) in self.placed for t in _tensors(args, kwargs)):
            return out
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outs:
            return out
        if is_token_local_op(func):
            self.carry(list(_tensors(args, kwargs)), outs)
            return out
        self._propagate(func, args, kwargs, out)
        return out

    def _propagate(self, func, args, kwargs, out) -> None:
        key = (func, self.mesh.device_type, self._key(args), self._key(kwargs))
        try:
            decision = _DECISIONS.get(key)
        except TypeError:  # an unhashable argument: decide without the cache
            key, decision = None, None
        if decision is None:
            decision = self._decide(func, args, kwargs)
            if key is not None and len(_DECISIONS) < MAX_DECISIONS:
                _DECISIONS[key] = decision
        kind, pairwise, moves, detail, placements = decision
        if kind is not None:
            self.flag(func, kind, pairwise, moves, detail)
        outs = pytree.tree_leaves(out, is_leaf=lambda x: x is None)
        for i, t in enumerate(outs):
            if isinstance(t, torch.Tensor):
                self.place(t, placements[i] if placements is not None and i < len(placements) else None)

    def _key(self, value):
        """What the propagator's answer depends on: placements, shapes, strides, dtypes and the other arguments."""
        if isinstance(value, torch.Tensor):
            return (self.placement(value), tuple(value.shape), value.stride(), value.dtype)
        if isinstance(value, (list, tuple)):
            return tuple(self._key(v) for v in value)
        if isinstance(value, dict):
            return tuple((k, self._key(v)) for k, v in value.items())
        return value

    def _decide(self, func, args, kwargs) -> tuple:
        """(flag kind or None, pairwise, moves, detail, output placements or None) from DTensor's propagator."""
        sargs, skwargs = pytree.tree_map_only(torch.Tensor, self._spec, (args, kwargs))
        schema = OpSchema(func, sargs, skwargs, schema_info=self.propagator.op_to_schema_info.get(func))
        try:
            sharding = self.propagator.propagate_op_sharding(schema)
        except Exception as e:  # no strategy for this op (or it failed): cannot tell whether it mixes tokens
            return "unknown", False, (), f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}", None
        kind, pairwise, moves = None, False, ()
        if sharding.redistribute_schema is not None:
            kind, pairwise, moves = _moves(schema, sharding.redistribute_schema)
        specs = sharding.output_spec
        specs = [specs] if isinstance(specs, DTensorSpec) or specs is None else list(specs)
        return kind, pairwise, moves, "", tuple(s.placements[0] if isinstance(s, DTensorSpec) else None for s in specs)


def _moves(schema: OpSchema, wanted: OpSchema) -> tuple:
    """(kind, pairwise, moves) when the strategy moves a sequence-carrying input off its placement, else Nones."""
    before, after = _specs(schema), _specs(wanted)
    moved = [(b.placements[0], a.placements[0]) for b, a in zip(before, after) if b.placements != a.placements]
    moved = [(b, a) for b, a in moved if not isinstance(b, Replicate)]
    if not moved:
        return None, False, ()
    placed = [s.placements[0] for s in before]
    sharded = [p for p in placed if _dim(p) is not None]
    kind = "partial" if any(p.is_partial() for p in placed) else "gather"
    return kind, kind == "gather" and len(sharded) >= 2, tuple(moved)


def _specs(schema: OpSchema) -> list[DTensorSpec]:
    leaves = pytree.tree_leaves((schema.args_schema, schema.kwargs_schema))
    return [s for s in leaves if isinstance(s, DTensorSpec)]


def _fresh(value):
    """A new meta tensor like a traced value (the traced ones are Dynamo's fake tensors)."""
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=META)
    if isinstance(value, (list, tuple)):
        return type(value)(_fresh(v) for v in value)
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
        if target in RUN_TIME_GUARDS:  # they communicate (a few ints) and hand back their checked input
            return args[0]
        if isinstance(target, torch._ops.HigherOrderOperator):
            return self._higher_order(target, node, args)
        return super().call_function(target, args, kwargs)

    def _region(self, plan, node: torch.fx.Node, args):
        """A CP region: q/k/v must arrive on their sequence dim; the output is placed on it."""
        seq = 0 if plan.site.kind == "varlen" else 2
        for t in args[:3]:
            p = self.tracker.placement(t)
            if p is not None and p.is_partial():
                self.tracker.flag("the attention region", "partial", moves=((p, Shard(seq)),))
            elif _dim(p) != seq:
                self.tracker.result.inconsistent.append(node)
        out = _fresh(_traced(node))
        if plan.site.kind == "sdpa":
            self.tracker.place(out, Shard(seq))
        elif plan.site.kind == "flex":  # (out, lse, max_scores); the mods index their buffers by GLOBAL position
            for t in _tensors(args[5:], {}):
                if (p := self.tracker.placement(t)) is not None:
                    what = "a flex_attention score_mod/mask_mod buffer"
                    self.tracker.flag(what, "flex_buffer", moves=((p, Replicate()),))
            for t in out:
                self.tracker.place(t, Shard(seq))
        else:
            for t, p in zip(out, (Shard(0), Shard(1))):
                self.tracker.place(t, p)
        return out

    def _higher_order(self, hop, node: torch.fx.Node, args):
        start = BODY_OPERANDS.get(hop.name())
        if start is not None and isinstance(args[0], torch.fx.GraphModule):
            return Runner(args[0], self.tracker).run(*args[start:])
        if hop.name() == "cond" and all(isinstance(b, torch.fx.GraphModule) for b in args[1:3]):
            return self._cond(node, *args[1:4])
        if any(self.tracker.placement(t) is not None for t in _tensors(args, {})):
            self.tracker.flag(hop.name(), "hop")
        return _fresh(_traced(node))

    def _cond(self, node: torch.fx.Node, true_fn, false_fn, operands):
        """Both branches run on the same operands. An output carries the tokens where either branch's does (a
        branch may return a token-wise constant instead); the two must not put them on different dims."""
        outs = [Runner(body, self.tracker).run(*operands) for body in (true_fn, false_fn)]
        leaves = [[t for t in pytree.tree_leaves(o) if isinstance(t, torch.Tensor)] for o in outs]
        for first, second in zip(*leaves):
            p, q = self.tracker.placement(first), self.tracker.placement(second)
            if p is not None and q is not None and p != q:
                detail = f"its two branches place the sequence dim differently ({p} and {q})"
                self.tracker.flag("cond", "hop", moves=((p, q),), detail=detail)
            self.tracker.place(first, p if p is not None else q)
        return outs[0]


def track(gm: torch.fx.GraphModule, seeds: dict[str, int]) -> Result:
    """Run `gm` on meta tensors like its traced inputs, placeholder `name` placed Shard(seeds[name]); what it
    found."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [_traced(n) for n in placeholders]
    device = next((v.device.type for v in values if isinstance(v, torch.Tensor)), "cpu")
    device = "cpu" if device == "meta" else device  # a meta graph (explain() of a meta model): any real mesh type
    tracker = Tracker(_mesh(device))
    with torch.no_grad():
        inputs = [_fresh(v) for v in values]
        for n, t in zip(placeholders, inputs):
            if n.name in seeds:
                tracker.place(t, Shard(seeds[n.name]))
        with tracker:
            Runner(gm, tracker).run(*inputs)
    return tracker.result


__all__ = ["BODY_OPERANDS", "Flag", "Result", "Runner", "Tracker", "track"]

"""A layout per layer kind: where a run of token mixers runs on flat chunks between two relayouts.

Under zigzag the attention layers keep zigzag's causal balance, but a state-passing mixer passes state on two
chunks a rank, (cp-1) more transitions a layer than on flat chunks (and, from cp 3, one more conv tail). A run of
mixers with only token-local ops between them can instead run flat: the token tensors that enter the run are
relayouted zigzag -> flat (relayout.py: one all-to-all each), the run's mixers pass state on flat chunks, and the
token tensors that leave it go back flat -> zigzag. `plan_layouts` finds the runs, prices both ways in bytes a
rank receives per forward call (the worst rank's), and, as `mixer_layout` asks, inserts the relayouts and re-plans
the run's mixers flat:

- "same" (the default): one layout everywhere; explain() still prints both prices per mixer.
- "auto": a run is relayouted where that receives fewer bytes (bytes only: the cost model has no measured rates
  for these collectives yet).
- "flat": every run is relayouted; a run that cannot be is one CPCompileError.

A run lies in the graph itself (not in a higher-order op's body) between two barriers: an attention region, a
higher-order op, a placeholder, the output, an in-place op (it would write a flat copy), or an op whose
token-carrying output does not hold exactly one dim of the local length (a reduction over the tokens, the tokens
flattened with the batch, a length that equals another dim's: their meaning would change with the layout, or is
not clear). Its cut points are chosen between the barriers and the run's first and last mixers: the cut
whose crossing token tensors (each with exactly one dim of the local length, its seq dim) receive the fewest
bytes. Inside the cuts every node runs on flat tokens; outside nothing changes. Packed layouts never get here (their
mixers are refused; backend() refuses mixer_layout="flat" with them).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch.utils import _pytree as pytree

from ..errors import CPCompileError, node_origin
from ..layouts import LAYOUTS, get_layout
from ..mesh import CPGroup
from .cost import a2a_bytes, describe, state_bytes
from .plan import MixerPlan, example, plan_mixer
from .plan_state import StatePlan, plan_state
from .relayout import received_tokens, relayout

MIXER_LAYOUTS = ("same", "auto", "flat")
"""backend(mixer_layout=...): one layout everywhere, relayouts where they receive fewer bytes, relayouts always."""

_TOKEN_REGION = "cpcompile_token_region"  # rewrite.TOKEN_REGION (rewrite.py imports this module)


@dataclass(frozen=True)
class Run:
    """A run of mixers and its price both ways (bytes a rank receives per forward call, the worst rank's)."""

    plans: tuple
    same: int
    """The run's mixers on the graph's layout."""
    flat: int = 0
    """The run's mixers on flat chunks plus the relayouts (0: not possible)."""
    relayouts: int = 0
    """The relayouts' share of `flat`."""
    cut: tuple[int, int] = (0, 0)
    """The nodes that run flat: graph positions [start, end)."""
    crossing: tuple[tuple, tuple] = ((), ())
    """(node, seq dim) of the token tensors relayouted to flat at the start, and back at the end."""
    flat_plans: tuple = ()
    why_not: str = ""
    """Why the run cannot be relayouted ("": it can)."""


def check_mixer_layout(mixer_layout: str, strategy: str) -> None:
    """One CPCompileError for a value backend() / explain() cannot take."""
    if mixer_layout not in MIXER_LAYOUTS:
        raise CPCompileError(f"unknown mixer_layout {mixer_layout!r}. Fix: use one of {list(MIXER_LAYOUTS)}.")
    if mixer_layout == "flat" and strategy not in LAYOUTS:
        raise CPCompileError(
            f"mixer_layout='flat' with strategy={strategy!r}: a relayout of packed documents is not supported (token "
            "mixers run on the chunk layouts only). Fix: use mixer_layout='same', or strategy='zigzag'."
        )


def _is_state(node: torch.fx.Node, value) -> bool:
    """Model state (parameters, buffers: Dynamo's static inputs) carries no tokens (as guard/inputs.is_state)."""
    if isinstance(value, torch.nn.Parameter) or "_dynamo_static_input_type" in (node.meta.get("tensor_dict") or {}):
        return True
    return isinstance(getattr(node.meta.get("grapharg"), "example", None), torch.nn.Parameter)


def _seq_dim(value, length: int) -> int | None:
    """The one dim of a tensor of size `length`; None: none, several, or not one tensor."""
    if not isinstance(value, torch.Tensor):
        return None
    dims = [d for d, n in enumerate(value.shape) if n == length]
    return dims[0] if len(dims) == 1 else None


def _kinds(nodes: list[torch.fx.Node], length: int) -> dict:
    """Per node: "free" (holds no tokens and reads none), "token" (one tensor with one dim of the local length,
    read from tokens), "inner" (several such tensors: a split, a mixer's (output, None); fine inside a run, never
    relayouted), or "opaque" (read from tokens, but a tensor without one dim of the local length: a reduction over
    the tokens, tokens flattened with the batch)."""
    kinds: dict = {}
    for n in nodes:
        value = example(n)
        leaves = [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
        if n.op == "placeholder":
            if not isinstance(value, torch.Tensor) or _is_state(n, value) or length not in value.shape:
                kinds[n] = "free"
                continue
        elif not any(kinds.get(a, "free") != "free" for a in n.all_input_nodes) or not leaves:
            kinds[n] = "free"  # reads no tokens; or sizes, Python numbers: the same under every chunk layout
            continue
        if any(_seq_dim(t, length) is None for t in leaves):
            kinds[n] = "opaque"
        else:
            kinds[n] = "token" if isinstance(value, torch.Tensor) else "inner"
    return kinds


def _mutates(n: torch.fx.Node) -> bool:
    """An in-place op (x.add_(...), x[i] = y, an aten overload that writes its input): on a flat copy it would not
    write the tensor the code outside the run reads."""
    if n.op == "call_method":
        return str(n.target).endswith("_") and not str(n.target).startswith("_")
    if n.target is operator.setitem:
        return True
    schema = getattr(n.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable) or getattr(n.target, "__name__", "").endswith("_")


def _barrier(n: torch.fx.Node, kinds: dict) -> bool:
    return (
        n.op in ("placeholder", "output")
        or n.meta.get("cpcompile_plan") is not None
        or isinstance(n.target, torch._ops.HigherOrderOperator)
        or kinds[n] == "opaque"
        or (n.op != "get_attr" and _mutates(n))
    )


def _runs(nodes: list[torch.fx.Node], plans: list, kinds: dict) -> list[list]:
    """The graph's mixers' plans grouped into runs: no barrier between two mixers of a run."""
    at = {p.node: p for p in plans}
    runs, current = [], []
    for n in nodes:
        if n in at:
            current.append(at[n])
        elif _barrier(n, kinds) and current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def _crossing(held: list, start: int, end: int):
    """(token tensors read inside [start, end) from before it, those inside read after it), or None where one
    that crosses is not one tensor with one seq dim. `held`: (node, its position, its users' positions, kind) of
    every node that holds tokens."""
    into = [(n, k) for n, i, users, k in held if i < start and any(start <= u < end for u in users)]
    out = [(n, k) for n, i, users, k in held if start <= i < end and users[-1] >= end]
    if any(k != "token" for _, k in into + out):
        return None
    return [n for n, _ in into], [n for n, _ in out]


def _row_bytes(n: torch.fx.Node, length: int) -> int:
    t = example(n)
    return t.numel() * t.element_size() // length


def _price(run: list, length: int, group: CPGroup, strategy: str, nodes, index, kinds) -> Run:
    """The run's price both ways, with its cheapest cut."""
    same = sum(state_bytes(p) if p.comm == "state" else a2a_bytes(p) for p in run)
    try:
        flats = tuple(
            plan_state(p.node, "flat", group) if p.comm == "state" else plan_mixer(p.node, "flat", group, check=False)
            for p in run  # (an a2a declaration was checked by the node's first plan)
        )  # fmt: skip
    except CPCompileError as e:
        return Run(tuple(run), same, why_not=f"a mixer of it cannot run on flat chunks ({e})")
    mixers = sum(state_bytes(p) if p.comm == "state" else a2a_bytes(p) for p in flats)
    first, last = index[run[0].node], index[run[-1].node]
    lo = max((i for i in range(first) if _barrier(nodes[i], kinds)), default=-1) + 1
    hi = min((i for i in range(last + 1, len(nodes)) if _barrier(nodes[i], kinds)), default=len(nodes))
    lay = get_layout(strategy)
    there = received_tokens(lay, LAYOUTS["flat"], group.size, length)
    back = received_tokens(LAYOUTS["flat"], lay, group.size, length)
    held = [  # the token nodes alive somewhere between the barriers: only they can cross a cut there
        (n, index[n], users, kinds[n])
        for n in nodes
        if kinds[n] != "free" and index[n] < hi and (users := sorted(index[u] for u in n.users)) and users[-1] >= lo
    ]
    best = None
    for start in range(lo, first + 1):
        for end in range(last + 1, hi + 1):
            found = _crossing(held, start, end)
            if found is None:
                continue
            into, out = found
            if any(len({_seq_dim(example(n), length) for n in side}) > 1 for side in (into, out)):
                continue  # one relayout call a side holds its tokens on one dim (the token guard reads one)
            cost = sum(_row_bytes(n, length) * there for n in into) + sum(_row_bytes(n, length) * back for n in out)
            if best is None or (cost, end - start) < (best[0], best[1][1] - best[1][0]):
                best = (cost, (start, end), found)
    if best is None:
        return Run(tuple(run), same, why_not="every cut around it crosses a tensor without one seq dim")
    cost, cut, (into, out) = best
    crossing = tuple(tuple((n, _seq_dim(example(n), length)) for n in side) for side in (into, out))
    return Run(tuple(run), same, mixers + cost, cost, cut, crossing, flats)  # type: ignore[arg-type]


def _insert(run: Run, nodes, strategy: str, group: CPGroup) -> None:
    """The relayouts around the run's cut (one region call a side, its all-to-alls one chain); the nodes inside
    read the flat copies, the nodes after the zigzag ones."""
    start, end = run.cut
    where = dict(group_name=group.name, rank=group.rank, world=group.size)
    graph = nodes[start].graph
    for side, (src, dst) in zip(run.crossing, ((strategy, "flat"), ("flat", strategy))):
        if not side:
            continue
        readers = set(nodes[start:end]) if src == strategy else set(nodes[end:])
        with graph.inserting_before(nodes[start] if src == strategy else nodes[end]):
            tensors = tuple(node for node, _ in side)
            call = graph.call_function(relayout, tensors, dict(seq_dims=tuple(d for _, d in side), src=src, dst=dst,
                                                               **where))  # fmt: skip
            call.meta["example_value"] = tuple(example(n) for n in tensors)
            call.meta[_TOKEN_REGION] = side[0][1]
            for i, (node, _) in enumerate(side):
                moved = graph.call_function(operator.getitem, (call, i))
                moved.meta = {k: v for k, v in node.meta.items() if k in ("example_value", "val")}
                for user in [u for u in node.users if u in readers]:
                    user.replace_input_with(node, moved)


def _note(run: Run, chosen: bool, mixer_layout: str, strategy: str) -> str:
    where = f"run of {len(run.plans)} mixer call(s) from {run.plans[0].spec.name}"
    if run.why_not:
        return f"layout {strategy} ({where}: no relayout to flat possible: {run.why_not})"
    verdict = "flat between relayouts" if chosen else strategy
    return (
        f"layout {verdict} ({where}: {run.same} bytes received a rank per forward call on {strategy} chunks, "
        f"{run.flat} on flat chunks with the relayouts ({run.relayouts} of it); mixer_layout={mixer_layout!r})"
    )


def plan_layouts(
    gm: torch.fx.GraphModule, plans: list, strategy: str, group: CPGroup, mixer_layout: str = "same"
) -> list[MixerPlan | StatePlan]:
    """`plans` with each run's choice in its notes; where a run is relayouted (mixer_layout), its mixers re-planned
    flat and the relayouts inserted into `gm` (before the mixers are rewritten)."""
    if strategy not in LAYOUTS or LAYOUTS[strategy].chunks_per_rank == 1:
        return plans
    top = [p for p in plans if p.node.graph is gm.graph]
    if not top or (mixer_layout != "flat" and not any(p.comm == "state" for p in top)):
        return plans  # a run of a2a mixers receives the same bytes on either layout: only "flat" relayouts it
    length = top[0].local_len
    replaced = {}
    count = len(_runs(list(gm.graph.nodes), top, _kinds(list(gm.graph.nodes), length)))
    for k in range(count):
        # the graph as the earlier runs' relayouts left it: a tensor a chosen run hands on is read through its
        # relayout back, so a later run relayouts that copy (never the flat original as if it were zigzag)
        nodes = list(gm.graph.nodes)
        index = {n: i for i, n in enumerate(nodes)}
        kinds = _kinds(nodes, length)
        run = _price(_runs(nodes, top, kinds)[k], length, group, strategy, nodes, index, kinds)
        chosen = not run.why_not and (mixer_layout == "flat" or (mixer_layout == "auto" and run.flat < run.same))
        if mixer_layout == "flat" and run.why_not:
            raise CPCompileError(
                f"cpcompile cannot run {node_origin(run.plans[0].node, 'token mixer')} on flat chunks "
                f"(mixer_layout='flat'): {run.why_not}. Fix: use mixer_layout='auto' or 'same'."
            )
        if chosen:
            _insert(run, nodes, strategy, group)
        note = _note(run, chosen, mixer_layout, strategy)
        for old, new in zip(run.plans, run.flat_plans if chosen else run.plans):
            replaced[old.node] = dataclasses.replace(new, note=f"{describe(new) if chosen else old.note}; {note}")
    return [replaced.get(p.node, p) for p in plans]

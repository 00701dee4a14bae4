"""What one run of the guard over a graph finds (`Flag`s, `Result`), and the tracker it runs under: the dispatch
tracker (dispatch.py) plus the node being run, and the hand-over of tokens across code marked token-local.

Every value that holds the sharded tokens carries a tag (tags.py): `Seq` (where the token axis is, merged dims
included), `Share` (a per-rank sum/mean/max over tokens) or `Local` (made from the local length). At each aten op
the op family's rule (rules.py, reduce.py, index.py) gives the outputs' tags or a refusal: a `Flag`. The values
are plain meta tensors with the graph's shapes: nothing is computed or communicated.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.utils import _pytree as pytree

from ..token_local import is_token_local_op
from .dispatch import Tracker
from .tags import Part, Seq

META = torch.device("meta")


@dataclass(frozen=True)
class Flag:
    """One op that needs tokens this rank does not hold.

    kind: "gather" (it needs other ranks' tokens), "partial" (a per-rank reduction over tokens is used as if it
    were the total), "branch" (a per-rank reduction over tokens decides a value: a comparison, a Python number,
    an output that goes on into Python code at a graph break), "positions" (a value made from the local length is
    used as positions), "unknown" (no rule:
    cannot tell), "hop" (a higher-order op that cannot be looked into), "flex_buffer" (a flex mod buffer holds
    this rank's tokens only). pairwise: tokens meet every other token, as in attention.
    """

    node: torch.fx.Node
    op: str
    kind: str
    pairwise: bool = False
    detail: str = ""
    reading: str = ""
    """Set where the graph's token dims were not known (no attention, no marked input): the reading of its dims
    under which the op mixes tokens (infer.py), which the message names beside the usual fixes."""


@dataclass
class Result:
    """What one run found: the flagged ops in execution order, and the regions whose inputs were misplaced."""

    flags: list[Flag] = field(default_factory=list)
    inconsistent: list[torch.fx.Node] = field(default_factory=list)
    """Region calls whose q/k/v did not arrive holding tokens on their sequence dim (the assignment is wrong)."""
    fallbacks: set[str] = field(default_factory=set)
    """Ops no rule covers that DTensor was asked about."""
    outputs: tuple[tuple[int, object], ...] = ()
    """(index among the graph's flattened outputs, Seq tag) of every output that holds tokens: the compiled
    graph marks them when it runs (token_marks.py), for the graph fed them next."""


def tensors(args, kwargs) -> Iterator[torch.Tensor]:
    """The tensors among a call's arguments, lists and tuples opened."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from tensors(a, {})


def leaves(value) -> list[torch.Tensor]:
    """The tensors in a (nested) output."""
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


class NodeTracker(Tracker):
    """The dispatch tracker plus the node being run (for the flags) and marked code's hand-over."""

    def __init__(self) -> None:
        super().__init__(self._on_flag)
        self.result = Result()
        self.node: torch.fx.Node | None = None
        self.length_symbols: set[str] = set()
        """The symbols of the token dims' sizes (dynamic shapes: length.py)."""
        self.length_nodes: set[torch.fx.Node] = set()
        """Nodes whose value is the local length or computed from it (dynamic shapes: length.py)."""

    def _on_flag(self, op: str, verdict) -> None:
        self.flag(op, verdict.kind, verdict.pairwise, verdict.detail)

    def flag(self, op, kind: str, pairwise: bool = False, detail: str = "") -> None:
        self.result.flags.append(Flag(self.node, str(op), kind, pairwise, detail))

    def seq_dim(self, t) -> int | None:
        """The dim holding t's tokens when they fill one whole dim, else None."""
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
            self.carry(list(tensors(args, kwargs)), leaves(out))
            return out
        return super().__torch_dispatch__(func, types, args, kwargs)


def concrete(shape) -> tuple[int, ...]:
    """Sizes of a traced shape, symbolic ones at their hint (the example's size): a graph with dynamic dims is
    checked at the sizes it was traced with."""
    return tuple(int(s) if isinstance(s, int) else int(s.node.hint) for s in shape)


def fresh(value):
    """A new meta tensor like a traced value (the traced ones are Dynamo's fake tensors)."""
    if isinstance(value, torch.Tensor):
        if hasattr(value, "_local_tensor") and hasattr(value, "placements"):  # a DTensor: its global shape
            return torch.empty(concrete(value.shape), dtype=value.dtype, device=META)
        return torch.empty_strided(concrete(value.shape), concrete(value.stride()), dtype=value.dtype, device=META)
    if isinstance(value, (list, tuple)):
        return type(value)(fresh(v) for v in value)
    if isinstance(value, torch.SymInt):  # a dynamic size placeholder: at the size it was traced with
        return int(value.node.hint)
    return value


def traced(node: torch.fx.Node):
    """The value Dynamo traced for a node."""
    return node.meta.get("example_value", node.meta.get("val"))

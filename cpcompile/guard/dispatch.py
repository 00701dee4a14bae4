"""The tracker: a dispatch mode that runs each aten op on meta tensors and applies the op family's rule to the
tags of its inputs (guard/rules.py, reduce.py, index.py). Writes through a view (a slice of a `new_empty`
buffer, `copy_`) tag the view's base too. An op no rule covers, fed token data, is asked of DTensor's sharding
propagator where the tokens are on a plain dim (guard/fallback.py), else refused: never passed silently."""

from __future__ import annotations

import functools

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from . import index as _index  # noqa: F401  (registers its rules)
from . import reduce as _reduce  # noqa: F401
from .fallback import ask_dtensor
from .rules import RULES, Verdict, pointwise, refuse
from .tags import Local, Seq, Share, reshaped

META = torch.device("meta")


@functools.cache
def _makes_tensors(func) -> bool:
    """Ops with a `device` argument (factories, *_like): their tensors are made on the meta device."""
    return any(a.name == "device" for a in func._schema.arguments)


@functools.cache
def _is_pointwise(func) -> bool:
    return torch.Tag.pointwise in func.tags


@functools.cache
def _aliases(func) -> tuple[bool, int | None]:
    """(the first output is a view of the first argument, index of the argument the op writes into or None)."""
    schema = func._schema
    alias = schema.returns[0].alias_info if schema.returns else None
    view = alias is not None and not alias.is_write
    written = next((i for i, a in enumerate(schema.arguments) if a.alias_info and a.alias_info.is_write), None)
    return view, written


def _tensors(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from _tensors(a, {})


def _meta(t: torch.Tensor) -> torch.Tensor:
    return t if t.device == META else t.to(META)


class Tracker(TorchDispatchMode):
    """Tags of the token-carrying meta tensors, updated at every aten op by the op family's rule."""

    def __init__(self, on_flag) -> None:
        super().__init__()
        self.tags: dict[int, tuple[torch.Tensor, object]] = {}  # id -> (tensor, tag); holds the tensor
        self.bases: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(view) -> (view, the tensor it views)
        self.on_flag = on_flag
        self.suspended = 0
        self.fallbacks: set[str] = set()

    def place(self, t: torch.Tensor, tag) -> None:
        if tag is None:
            self.tags.pop(id(t), None)
        else:
            self.tags[id(t)] = (t, tag)

    def tag(self, t) -> object | None:
        entry = self.tags.get(id(t)) if isinstance(t, torch.Tensor) else None
        return entry[1] if entry is not None else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _makes_tensors(func) and kwargs.get("device") != META:
            kwargs = {**kwargs, "device": META}
        if any(t.device != META for t in _tensors(args, kwargs)):  # constants of the graph, real parameters
            args, kwargs = pytree.tree_map_only(torch.Tensor, _meta, (args, kwargs))
        out = func(*args, **kwargs)
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        view, written = _aliases(func)
        if view and outs and args and isinstance(args[0], torch.Tensor):
            self.bases[id(outs[0])] = (outs[0], args[0])
        if self.suspended:
            return out
        if not any(id(t) in self.tags for t in _tensors(args, kwargs)) and func.__name__.split(".")[0] not in (
            "arange", "slice"
        ):  # fmt: skip
            for t in outs:
                self.place(t, None)
            return out
        verdict = self._decide(func, args, kwargs, outs)
        if verdict.kind is not None:
            self.on_flag(str(func), verdict)
            return out
        for i, t in enumerate(outs):
            self.place(t, verdict.outs[i] if i < len(verdict.outs) else None)
        if written is not None and written < len(args) and isinstance(args[written], torch.Tensor):
            self._written(func, args[written], verdict.outs[0] if verdict.outs else None)
        return out

    def _decide(self, func, args, kwargs, outs) -> Verdict:
        locs = [self.tag(t) for t in _tensors(args, kwargs) if isinstance(self.tag(t), Local)]
        name = func.__name__.split(".")[0]
        rule = RULES.get(name)
        if rule is None and _is_pointwise(func):
            rule = pointwise
        if func.__name__ in ("max.other", "min.other", "max.out", "min.out"):
            rule = pointwise
        if locs and rule not in (RULES.get("view"), pointwise, RULES.get("embedding"), RULES.get("index")):
            if any(isinstance(self.tag(t), Seq) for t in _tensors(args, kwargs)):
                return refuse("positions", f"a value {locs[0].describe()} is combined with this rank's tokens")
            if rule is None or name in ("sum", "mean", "amax", "amin", "max", "min"):
                return Verdict((locs[0],) * len(outs))
        if rule is not None:
            v = rule(func, args, kwargs, outs, self.tag)
            if locs and not v.kind and rule is not RULES.get("view"):
                if any(isinstance(x, Seq) for x in v.outs):
                    return refuse("positions", f"a value {locs[0].describe()} indexes or meets this rank's tokens")
                v = Verdict(tuple(o if o is not None else locs[0] for o in v.outs))
            return v
        if any(isinstance(self.tag(t), Share) for t in _tensors(args, kwargs)):
            return refuse("partial", f"{func} has no rule to keep a per-rank partial a partial")
        self.fallbacks.add(str(func))
        return ask_dtensor(func, args, kwargs, outs, self.tag)

    def _written(self, func, dest: torch.Tensor, new) -> None:
        """An in-place op wrote `new` (the result's tag) into `dest`: dest and the tensors it views hold it."""
        seen = 0
        while dest is not None and seen < 32:
            old = self.tag(dest)
            if new is not None and old is not None and old != new and isinstance(new, Seq) and isinstance(old, Seq):
                self.on_flag(str(func), refuse("gather", "it writes tokens into a buffer that holds them elsewhere"))
                return
            self.place(dest, new if new is not None else old)
            base = self.bases.get(id(dest), (None, None))[1]
            if base is None or new is None or not isinstance(new, Seq):
                if base is not None and new is not None:
                    self.place(base, self.tag(base) or new)
                return
            mapped = _to_base(new, dest, base)
            if mapped is None:
                self.on_flag(str(func), refuse("unknown", "tokens are written through a view cpcompile cannot follow"))
                return
            dest, new, seen = base, mapped, seen + 1


def _to_base(tag: Seq, view: torch.Tensor, base: torch.Tensor) -> Seq | None:
    """The view's token axis on the tensor it views: the same dims for a slice (the token dims not cut), the flat
    index for a reshape."""
    if view.dim() == base.dim() and all(view.shape[p.dim] == base.shape[p.dim] for p in tag.parts):
        return tag
    if view.numel() == base.numel():
        return reshaped(tag, tuple(view.shape), tuple(base.shape))
    return None

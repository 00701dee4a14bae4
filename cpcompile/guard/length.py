"""The local sequence length used as a number: `x * L`, `pos / L`, `q * log(L)` with L read from a token-holding
value's shape. Under CP each rank holds L of the cp*L tokens, so a scale, a mean or a position computed from L is
wrong on every rank. The aten ops see only a number: in a graph with static shapes Dynamo bakes `x.shape[1]` into
the graph as a constant (and folds `math.log(x.shape[1])` too), so the rule reads the FX node: arithmetic between
token data and a number that is L or a usual function of it (1/L, sqrt, log), on a source line that reads a size
(`.shape`, `.size(`, `len(`), or a symbolic size (a graph with dynamic dims) at L. A constant that merely equals
L on a line that reads no size is not taken for it."""

from __future__ import annotations

import math
import operator
import re

import torch
import torch.fx

from ..errors import node_code
from .flow import traced
from .tags import Local, Seq

ARITHMETIC_FUNCTIONS = frozenset({
    operator.mul, operator.truediv, operator.floordiv, operator.add, operator.sub, operator.pow, operator.mod,
    operator.imul, operator.itruediv, operator.iadd, operator.isub, torch.mul, torch.div, torch.true_divide,
    torch.add, torch.sub, torch.pow, torch.floor_divide, torch.remainder, torch.full, torch.full_like,
})  # fmt: skip
ARITHMETIC_METHODS = frozenset({
    "mul", "div", "true_divide", "add", "sub", "pow", "floor_divide", "remainder", "mul_", "div_", "add_", "sub_",
    "fill_", "new_full", "__mul__", "__rmul__", "__truediv__", "__rtruediv__", "__add__", "__radd__", "__sub__",
    "__rsub__", "__pow__", "__rpow__", "__floordiv__",
})  # fmt: skip
SIZE_READ = re.compile(r"\.shape\b|\.size\(|\blen\(|\.numel\(")


def _arithmetic(n: torch.fx.Node) -> bool:
    if n.op == "call_function":
        return n.target in ARITHMETIC_FUNCTIONS
    return n.op == "call_method" and n.target in ARITHMETIC_METHODS


def of_length(value: float, length: int) -> str | None:
    """How `value` is made from the length (None: not one of the usual ways)."""
    forms = {"L": length, "1/L": 1 / length, "sqrt(L)": math.sqrt(length), "1/sqrt(L)": length**-0.5}
    if length > 1:
        forms.update({"log(L)": math.log(length), "1/log(L)": 1 / math.log(length), "log2(L)": math.log2(length)})
    return next((k for k, v in forms.items() if math.isclose(value, v, rel_tol=1e-9)), None)


def length_use(n: torch.fx.Node, args, kwargs, length: int, tag) -> str | None:
    """Why FX node `n` uses the local length `length` as a number with token data (None: it does not)."""
    if not _arithmetic(n):
        return None
    values = [*args, *kwargs.values()]
    if not any(isinstance(v, torch.Tensor) and isinstance(tag(v), (Seq, Local)) for v in values):
        return None
    symbolic = {
        i for i, a in enumerate([*n.args, *n.kwargs.values()])
        if isinstance(a, torch.fx.Node) and isinstance(traced(a), (torch.SymInt, torch.SymFloat))
    }  # fmt: skip
    reads_size = bool(SIZE_READ.search(node_code(n)))
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (reads_size or i in symbolic):
            continue
        if (form := of_length(float(v), length)) is not None:
            return f"the number {v!r} is {form} for this rank's length L = {length}"
    return None

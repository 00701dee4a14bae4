"""The local sequence length used as a number: `x * L`, `pos / L`, `q * log(L)` with L read from a token dim.
Under CP each rank holds L of the cp*L tokens, so a scale, a mean or a position computed from L is wrong on every
rank. The guard follows the value, not the line:

- dynamic shapes: the token dims' sizes are symbols (graph inputs); a number the graph computes from one (sym-int
  arithmetic) is the length's, whatever its value (`length_nodes`), and a tensor made of it (`torch.tensor(n)`,
  `new_tensor`, `full`) is `Local`;
- static shapes: Dynamo bakes `x.shape[1]` into the graph as a constant, so a number that is L or a usual function
  of it (1/L, sqrt, log) is the length's when the statement it comes from reads a token dim's size, directly or
  through a name assigned from one on an earlier line (`n = x.shape[1]` ... `pos / n`: length_source.py). A read of
  another dim of the same tensor (`q * q.shape[-1] ** -0.5` where head_dim == L) is not L.
"""

from __future__ import annotations

import math
import operator
import re

import torch
import torch.fx

from ..errors import node_code, node_frame
from .flow import traced
from .length_source import statement_reads
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
FACTORY_FUNCTIONS = frozenset({torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.full, torch._refs.tensor})
FACTORY_METHODS = frozenset({"new_tensor", "new_full", "fill_"})
SIZE_READ = re.compile(r"\.shape\b|\.size\(|\blen\(|\.numel\(")
"""A source line that reads a size (where the source cannot be parsed)."""


def _arithmetic(n: torch.fx.Node) -> bool:
    if n.op == "call_function":
        return n.target in ARITHMETIC_FUNCTIONS
    return n.op == "call_method" and n.target in ARITHMETIC_METHODS


def makes_tensor(n: torch.fx.Node) -> bool:
    """A node that makes a tensor of its number arguments (`torch.tensor(n)`, `x.new_tensor(n)`, `full`)."""
    if n.op == "call_function":
        return n.target in FACTORY_FUNCTIONS
    return n.op == "call_method" and n.target in FACTORY_METHODS


def of_length(value: float, length: int) -> str | None:
    """How `value` is made from the length (None: not one of the usual ways)."""
    forms = {"L": length, "1/L": 1 / length, "sqrt(L)": math.sqrt(length), "1/sqrt(L)": length**-0.5}
    if length > 1:
        forms.update({"log(L)": math.log(length), "1/log(L)": 1 / math.log(length), "log2(L)": math.log2(length)})
    return next((k for k, v in forms.items() if math.isclose(value, v, rel_tol=1e-9)), None)


def length_symbols(placeholders, seeds: dict) -> set[str]:
    """The symbols of the seeded inputs' token dims (graphs with dynamic shapes; Dynamo names equal sizes alike)."""
    found = set()
    for node in placeholders:
        seed, value = seeds.get(node.name), traced(node)
        dims = seed.dims if isinstance(seed, Seq) else {seed} if isinstance(seed, int) else set()
        for d in dims:
            if isinstance(value, torch.Tensor) and isinstance(size := value.shape[d], torch.SymInt):
                found.add(str(size.node.expr))
    return found


def is_length_node(n: torch.fx.Node, symbols: set[str], length_nodes: set[torch.fx.Node]) -> bool:
    """A size placeholder of a token dim, or a number the graph computes from one."""
    value = traced(n)
    if n.op == "placeholder":
        return isinstance(value, torch.SymInt) and str(value.node.expr) in symbols
    if not isinstance(value, (torch.SymInt, torch.SymFloat, int, float)) or isinstance(value, bool):
        return False
    return any(a in length_nodes for a in n.all_input_nodes)


def _reads_token_length(n: torch.fx.Node, tokens: list[torch.Tensor], tag) -> bool:
    """Whether the statement `n` comes from reads the size of a token dim (length_source.py)."""
    frame = node_frame(n)
    reads = statement_reads(*frame) if frame is not None else None
    if reads is None:
        return bool(SIZE_READ.search(node_code(n)))
    seq = next((t for t in tokens if isinstance(tag(t), Seq)), None)
    for read in reads:
        if read.beside_owner and read.dim is not None and seq is not None:
            if read.dim % seq.dim() not in tag(seq).dims:
                continue  # another dim of the op's own tensor (q * q.shape[-1] ** -0.5)
        return True
    return False


def number_of_length(n, args, kwargs, length: int, tokens, tag, length_nodes) -> str | None:
    """How a number among the arguments of node `n` is the local length `length` (None: none is)."""
    sources = [*n.args, *n.kwargs.values()]
    values = [*args, *kwargs.values()]
    for source, v in zip(sources, values):
        if isinstance(source, torch.fx.Node) and source in length_nodes:
            return f"the number {v!r} is computed from this rank's length L = {length}"
    forms = [
        (v, form) for source, v in zip(sources, values)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not isinstance(source, torch.fx.Node)
        and (form := of_length(float(v), length)) is not None
    ]  # fmt: skip
    if forms and _reads_token_length(n, tokens, tag):
        v, form = forms[0]
        return f"the number {v!r} is {form} for this rank's length L = {length}"
    return None


def length_use(n: torch.fx.Node, args, kwargs, length: int, tag, length_nodes=frozenset()) -> str | None:
    """Why FX node `n` uses the local length `length` as a number with token data (None: it does not)."""
    if not _arithmetic(n):
        return None
    tokens = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and isinstance(tag(v), (Seq, Local))]
    if not tokens:
        return None
    return number_of_length(n, args, kwargs, length, tokens, tag, length_nodes)


def length_tensor(n: torch.fx.Node, args, kwargs, length: int, tag, length_nodes=frozenset()) -> Local | None:
    """The Local tag of a tensor node `n` makes of the local length (`torch.tensor(n)`), or None."""
    if not makes_tensor(n):
        return None
    why = number_of_length(n, args, kwargs, length, [], tag, length_nodes)
    return Local(f"a tensor of the local length: {why}") if why is not None else None

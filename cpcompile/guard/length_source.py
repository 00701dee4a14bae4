"""Where a number in a graph with static shapes came from: the size reads of the user's source, followed through
Python assignments.

With static shapes Dynamo bakes `x.shape[1]` into the graph as a constant: `n = x.shape[1]` on one line and
`pos / n` on another leave only `pos / 8` in the graph. So the guard reads the statement of the node's source line
and the function around it (the file as Python parses it): a size read (`t.shape[i]`, `t.size(i)`, `len(t)`,
`t.numel()`, a `b, s, d = t.shape` unpacking) names its tensor and dim, and a name assigned from an expression
holding reads (or other such names) carries them on, so `pos / n` reads `x.shape[1]`. length.py then asks whether
a read is of a token dim: where the arithmetic's own tensor operand is the read's tensor (`q * q.shape[-1] **
-0.5`), that tensor's tag says which of its dims hold tokens; where it is not, the read counts (conservative)."""

from __future__ import annotations

import ast
import functools
import linecache
from dataclasses import dataclass


@dataclass(frozen=True)
class SizeRead:
    """A size read in the source: of tensor name `owner` (None: not a plain name), at dim `dim` (None: all of it,
    `numel()`, or not a constant); `beside_owner`: the read is an operand of an arithmetic op whose other operand
    is `owner` itself (`q * q.shape[-1] ** -0.5`), so that op's tensor is the read's tensor."""

    owner: str | None
    dim: int | None
    beside_owner: bool = False


@functools.lru_cache(maxsize=64)
def _parsed(path: str, size: int) -> ast.Module | None:
    del size  # part of the cache key: a file edited in place is parsed again
    try:
        return ast.parse("".join(linecache.getlines(path)))
    except (SyntaxError, ValueError):
        return None


def _innermost(tree: ast.AST, line: int, kinds) -> ast.AST | None:
    found = None
    for node in ast.walk(tree):
        if isinstance(node, kinds) and node.lineno <= line <= (node.end_lineno or node.lineno):
            if found is None or node.lineno >= found.lineno:
                found = node
    return found


def _name(node: ast.AST) -> str | None:
    return node.id if isinstance(node, ast.Name) else None


def _const_int(node: ast.AST) -> int | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and (v := _const_int(node.operand)) is not None:
        return -v
    return None


def _direct_read(node: ast.AST) -> SizeRead | None:
    """The size read `node` is, if it is one."""
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape":
        return SizeRead(_name(node.value.value), _const_int(node.slice))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        owner = _name(node.func.value)
        if node.func.attr == "size" and node.args:
            return SizeRead(owner, _const_int(node.args[0]))
        if node.func.attr == "numel":
            return SizeRead(owner, None)
    if isinstance(node, ast.Call) and _name(node.func) == "len" and node.args:
        return SizeRead(_name(node.args[0]), 0)
    return None


def _reads(expr: ast.AST, names: dict[str, frozenset[SizeRead]]) -> set[SizeRead]:
    """The size reads `expr` holds, directly or through names carrying them; a read beside its own tensor in an
    arithmetic op is marked so (SizeRead.beside_owner)."""
    found: set[SizeRead] = set()
    for node in ast.walk(expr):
        if (read := _direct_read(node)) is not None:
            found.add(read)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in names:
            found |= names[node.id]
    for node in ast.walk(expr):
        if isinstance(node, ast.BinOp):
            for side, other in ((node.left, node.right), (node.right, node.left)):
                owner = _name(other)
                if owner is None:
                    continue
                for sub in ast.walk(side):
                    read = _direct_read(sub)
                    if read is not None and read.owner == owner and read in found:
                        found.discard(read)
                        found.add(SizeRead(read.owner, read.dim, beside_owner=True))
    return found


def _unpacked_shape(value: ast.AST) -> ast.AST | None:
    """The tensor whose sizes `b, s, d = value` unpacks (`t.shape`, `t.size()`), else None."""
    if isinstance(value, ast.Attribute) and value.attr == "shape":
        return value.value
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "size":
        return value.func.value if not value.args else None
    return None


def _assigned(stmt: ast.stmt, names: dict[str, frozenset[SizeRead]]) -> None:
    """Update `names` with what the assignment `stmt` binds: reads carried on, or none (a name rebound)."""
    if isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name):
        names[stmt.target.id] = frozenset(names.get(stmt.target.id, frozenset()) | _reads(stmt.value, names))
        return
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
    value = getattr(stmt, "value", None)
    for target in targets:
        if isinstance(target, ast.Name) and value is not None:
            names[target.id] = frozenset(_reads(value, names))
        elif isinstance(target, ast.Tuple) and value is not None:
            owner = _unpacked_shape(value)
            for i, element in enumerate(target.elts):
                if isinstance(element, ast.Name):
                    names[element.id] = frozenset({SizeRead(_name(owner), i)} if owner is not None else ())


def statement_reads(path: str, line: int) -> set[SizeRead] | None:
    """The size reads of the statement at `path`:`line`, directly or through names the function around it
    assigned from reads on earlier lines (None: the source cannot be read or parsed)."""
    tree = _parsed(path, len(linecache.getlines(path)))
    if tree is None:
        return None
    stmt = _innermost(tree, line, ast.stmt)
    if stmt is None:
        return None
    scope = _innermost(tree, line, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or tree
    names: dict[str, frozenset[SizeRead]] = {}
    earlier = sorted(
        (s for s in ast.walk(scope) if isinstance(s, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and s.lineno < line),
        key=lambda s: (s.lineno, s.col_offset),
    )
    for s in earlier:
        if not (s.lineno <= stmt.lineno <= (s.end_lineno or s.lineno)):
            _assigned(s, names)
    value = getattr(stmt, "value", None) if isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign)) else stmt
    return _reads(value if value is not None else stmt, names)

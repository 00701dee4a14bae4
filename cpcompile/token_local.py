"""`cpcompile.mark_token_local`: the escape hatch for code the token guard refuses but that is token-local.

The token guard (cpcompile/guard/) refuses any op that would need the CP-sharded sequence whole. An op it cannot
analyse (a custom op with no DTensor sharding rule), or a function it reads wrongly, can be declared token-local:
every output token depends only on the same token of the inputs, so running it on each rank's own tokens is
exact. The guard then runs that code without looking inside and carries the sequence dim over to its outputs (the
output dim with the inputs' local length, the same dim index first). Marking code that does mix tokens makes the
result silently wrong again: the mark is the user's promise.

What can be marked:
- an operator: `torch.ops.mylib.fused_norm` (all overloads), one overload `torch.ops.mylib.fused_norm.default`,
  or a `torch.library.custom_op` object;
- a Python function or method, or an `nn.Module` subclass (its `forward`): every FX node whose recorded stack
  passes through that function (Dynamo inlines it, so its ops are ordinary graph nodes);
- an `nn.Module` instance: that instance only (its forward is replaced by a copy of the class's whose code has a
  name of its own, so other instances of the class stay checked).

The marks are process-wide (like `torch._dynamo.allow_in_graph`) and read at compile time; mark before compiling.
"""

from __future__ import annotations

import inspect
import itertools
import re
import types
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.fx
import torch.nn as nn

T = TypeVar("T")

_OPS: set = set()
"""Marked OpOverloads and OpOverloadPackets."""
_CODE: dict[tuple[str, str], list[tuple[int, int]]] = {}
"""Marked Python code: (file, function name) -> line ranges (first line, last line)."""

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


_INSTANCES = itertools.count()


def _instance_forward(module: nn.Module):
    """Give `module` its own forward: the class's function with a code object of a name of its own (what the
    graph's recorded stacks show), so a mark applies to this instance only."""
    func = inspect.unwrap(getattr(type(module).forward, "__func__", type(module).forward))
    name = f"{func.__code__.co_name}__cp_token_local_{next(_INSTANCES)}"
    names = {"co_name": name, **({"co_qualname": name} if hasattr(func.__code__, "co_qualname") else {})}
    code = func.__code__.replace(**names)
    copy = types.FunctionType(code, func.__globals__, name, func.__defaults__, func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    module.forward = types.MethodType(copy, module)
    return code


def _code_of(obj) -> object:
    if isinstance(obj, nn.Module):
        return _instance_forward(obj)
    if inspect.isclass(obj):
        if not issubclass(obj, nn.Module):
            raise TypeError(f"mark_token_local takes an nn.Module class, not {obj!r}")
        obj = obj.forward
    obj = inspect.unwrap(getattr(obj, "__func__", obj))
    code = getattr(obj, "__code__", None)
    if code is None:
        raise TypeError(f"mark_token_local cannot mark {obj!r}: not an operator, function, method or module")
    return code


def mark_token_local(obj: T) -> T:
    """Declare `obj` token-local for the CP token guard and return it unchanged (usable as a decorator).

    obj: an operator (`torch.ops.ns.op`, one of its overloads, or a `torch.library.custom_op`), a function or
    method, or an nn.Module subclass or instance (its class's forward). Token-local means every output token
    depends only on the same token of the inputs; cpcompile then runs it on each rank's own tokens unchanged.
    """
    op = getattr(obj, "_opoverload", obj)  # torch.library.custom_op -> its OpOverload
    if isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        _OPS.add(op)
        return obj
    code = _code_of(obj)
    if isinstance(obj, nn.Module):
        _MODULES.append(obj)
    last = max((line for *_, line in code.co_lines() if line is not None), default=code.co_firstlineno)
    _CODE.setdefault((code.co_filename, code.co_name), []).append((code.co_firstlineno, last))
    return obj


_MODULES: list = []
"""Instances marked (their forward was replaced): a clear puts the class's back."""
_BUILTIN: list = []
"""What cpcompile's integrations marked (library code known to be token-local): kept across a clear."""


def mark_builtin_token_local(obj: T) -> T:
    """mark_token_local for cpcompile's own integrations: the mark survives clear_token_local_marks, which
    would otherwise make a registered integration (HF, torchtitan) refuse its own library's code."""
    _BUILTIN.append(obj)
    return mark_token_local(obj)


def clear_token_local_marks() -> None:
    """Forget every user mark (tests; a process that changes its mind); the integrations' marks stay."""
    _OPS.clear()
    _CODE.clear()
    for module in _MODULES:
        module.__dict__.pop("forward", None)
    _MODULES.clear()
    for obj in _BUILTIN:
        mark_token_local(obj)


def is_token_local_function(fn: Callable) -> bool:
    """Whether a Python function (or a wrapper of one, as torch.compiler.disable makes) was marked."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    return code is not None and (code.co_filename, code.co_name) in _CODE


def is_token_local_op(op: Callable) -> bool:
    """Whether an aten/custom operator (overload) was marked, by itself or through its packet."""
    if not _OPS:
        return False
    return op in _OPS or getattr(op, "overloadpacket", None) in _OPS


def in_token_local_code(node: torch.fx.Node) -> bool:
    """Whether the node's recorded stack passes through marked Python code."""
    if not _CODE:
        return False
    for path, line, func in _FRAME.findall(node.meta.get("stack_trace") or ""):
        for first, last in _CODE.get((path, func), ()):
            if first <= int(line) <= last:
                return True
    return False


def is_token_local_node(node: torch.fx.Node) -> bool:
    """A node the guard runs without analysis: its target is a marked op or function (kept whole in the graph,
    e.g. by allow_in_graph), or its stack passes through marked code."""
    code = getattr(node.target, "__code__", None)
    if code is not None and (code.co_filename, code.co_name) in _CODE:
        return True
    return is_token_local_op(node.target) or in_token_local_code(node)

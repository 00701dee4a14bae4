"""Whether Dynamo cut a graph at a graph break: its outputs then go on into Python code (a branch, a size, the
resumed frame), not to the caller. Read from the attribute Dynamo's OutputGraph sets on every graph it compiles
(`gm.compile_subgraph_reason`, a GraphCompileReason whose `graph_break` is False for a frame's return), and
which torch.compiler.disable'd function a graph was cut to call (the reason's text names it)."""

from __future__ import annotations

import gc
import re
import types

import torch.fx

TORCH_VERSIONS = ("2.11", "2.13", "2.14")
"""The torch releases whose Dynamo sets `compile_subgraph_reason.graph_break` (tests/unit/test_compat.py)."""


def ends_at_graph_break(gm: torch.fx.GraphModule) -> bool:
    """True when Dynamo compiled `gm` because of a graph break (False for a graph not made by Dynamo)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    return bool(getattr(reason, "graph_break", False))


_DISABLED = re.compile(r"Skip calling function `<function (\S+) at (0x[0-9a-f]+)>`.*torch\.compiler\.disable", re.S)
"""Dynamo's reason for a graph break at a call of a torch.compiler.disable'd function (2.11-2.14)."""


def disabled_callee(gm: torch.fx.GraphModule) -> tuple[str, object | None, str] | None:
    """(name, function, call site) of the torch.compiler.disable'd function Dynamo cut `gm` to call eagerly, or
    None. The function is found by the address its repr in the reason names (None if it is gone); the call site
    is `file:line` of the call (the reason's user stack)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    found = _DISABLED.search(str(getattr(reason, "reason", "")))
    if not ends_at_graph_break(gm) or found is None:
        return None
    address = int(found.group(2), 16)
    function = next((f for f in gc.get_objects() if id(f) == address and isinstance(f, types.FunctionType)), None)
    stack = getattr(reason, "user_stack", None) or []
    site = f"{stack[-1].filename}:{stack[-1].lineno}" if stack else "?"
    return found.group(1), function, site

"""Whether Dynamo cut a graph at a graph break: its outputs then go on into Python code (a branch, a size, the
resumed frame), not to the caller. Read from the attribute Dynamo's OutputGraph sets on every graph it compiles
(`gm.compile_subgraph_reason`, a GraphCompileReason whose `graph_break` is False for a frame's return)."""

from __future__ import annotations

import torch.fx

TORCH_VERSIONS = ("2.11", "2.13", "2.14")
"""The torch releases whose Dynamo sets `compile_subgraph_reason.graph_break` (tests/unit/test_compat.py)."""


def ends_at_graph_break(gm: torch.fx.GraphModule) -> bool:
    """True when Dynamo compiled `gm` because of a graph break (False for a graph not made by Dynamo)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    return bool(getattr(reason, "graph_break", False))

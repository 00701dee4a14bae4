"""`cpcompile::refused`: a refusal found while Dynamo traces, raised by the backend as one CPCompileError.

Code that Dynamo traces (an integration's attention function) cannot raise: under fullgraph=True Dynamo turns
the exception into its own "Unsupported: Observed exception". Such code returns `refused(x, message)` instead
while compiling; the op stands in for the refused result in the graph, and the pass's first step raises its
message (passes/__init__.find), before any collective. Run anywhere else (another
backend, eagerly), the op itself raises the same error.
"""

from __future__ import annotations

import torch
import torch.fx

from .errors import CPCompileError


@torch.library.custom_op("cpcompile::refused", mutates_args=())
def refused(x: torch.Tensor, message: str) -> torch.Tensor:
    """Stands in for a refused result of x's shape; running it raises CPCompileError(message)."""
    raise CPCompileError(message)


@refused.register_fake
def _refused_fake(x: torch.Tensor, message: str) -> torch.Tensor:
    return torch.empty_like(x)


def raise_refusals(gm: torch.fx.GraphModule) -> None:
    """The first `cpcompile::refused` call in the graph (or a body of it) as its CPCompileError."""
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.find_nodes(op="call_function", target=torch.ops.cpcompile.refused.default):
            raise CPCompileError(node.args[1])

"""Trace a model with Dynamo for explain(): capture every graph, compute nothing, leave no compiled code behind.

The capture backend is a CPBackend, so the eager-attention guard treats the traced call as a cpcompile one:
attention that Dynamo runs eagerly (a graph break inside attention code, a compiler.disable'd function) raises
the guard's CPCompileError, which explain() reports. It returns a stand-in for each graph that hands back zeros
of the graph's output shapes (from Dynamo's fake example values): no kernel runs, so explain() works at full
model sizes and on meta tensors, and the pass's regions (never run) need no process group. Dynamo compiles the
module-level `_call` (the model is inlined into it) with dynamic=False, and `_call`'s cache entries are removed
afterwards, so the user's own compiled code of the model is neither reused nor displaced (frames Dynamo resumes
after a graph break inside the model are the exception: their entries stay, as with any torch.compile).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx
from torch.utils._pytree import tree_map

from ..backend import CPBackend
from ..errors import CPCompileError


def _zeros(value):
    if isinstance(value, torch.Tensor):
        return torch.zeros(value.shape, dtype=value.dtype, device=value.device)
    return value


def _shape_only(gm: torch.fx.GraphModule):
    """A stand-in for the compiled graph: the graph's outputs as zeros of their recorded shapes."""
    (output,) = (n for n in gm.graph.nodes if n.op == "output")

    def value(arg):
        if not isinstance(arg, torch.fx.Node):
            return arg
        found = arg.meta.get("example_value", arg.meta.get("val"))
        if found is None:
            raise RuntimeError(f"cpcompile.explain: Dynamo recorded no example value for graph output {arg.name}")
        return found

    outputs = tree_map(value, output.args[0])

    def run(*args):
        return tree_map(_zeros, outputs)

    return run


@dataclass
class _Capture(CPBackend):
    """A CPBackend (for the eager guard) that only records the graphs Dynamo hands it."""

    graphs: list[torch.fx.GraphModule] = field(default_factory=list)

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return _shape_only(gm)


def _call(model, args, kwargs):
    return model(*args, **kwargs)


def capture_graphs(model, args: tuple, kwargs: dict, config) -> tuple[list[torch.fx.GraphModule], Exception | None]:
    """(Dynamo's graphs of `model(*args, **kwargs)`, untouched by the pass, and the eager guard's CPCompileError
    when attention ran outside them). Not fullgraph: every graph a graph break leaves is captured."""
    model = getattr(model, "_orig_mod", model)  # a torch.compile'd module: trace the module itself
    capture = _Capture(config)
    error = None
    try:
        torch.compile(_call, backend=capture, dynamic=False)(model, args, kwargs)
    except CPCompileError as e:
        error = e
    finally:
        reset_code = getattr(torch._dynamo.eval_frame, "reset_code", None)
        if reset_code is not None:
            reset_code(_call.__code__)
    return capture.graphs, error

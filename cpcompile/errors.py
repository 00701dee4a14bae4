"""One error type for everything cpcompile refuses, raised before any collective runs."""

from __future__ import annotations

import os
import re

import torch
import torch.fx

_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.dirname(os.path.abspath(__file__))
_NOT_USER = (
    os.path.join(_HERE, "compat", "eager_attention.py"),  # the eager guard's SDPA wrapper (Dynamo inlines it)
    os.path.join(_HERE, "attention_op.py"),  # cpcompile.attention, which HF's "cpcompile" attention calls
    os.path.join(_HERE, "integrations", ""),  # the HF attention function: the model's line is the one to name
    os.path.join(_HERE, "mixers", ""),  # a declared token mixer's forward wrapper: the caller's line
)


class CPCompileError(ValueError):
    """An input or configuration cpcompile cannot turn into a correct CP region.

    The message always says what was found, the rule it breaks and what to do about it.
    """


class BatchLayoutError(CPCompileError, RuntimeError):
    """A step's batch does not fit the layout the backend compiled for (regions/batch_check.py), found at run time
    on every CP rank. Also a RuntimeError, like the device assert that says the same on CUDA."""


def _user_frame(node: torch.fx.Node) -> tuple[str, str, str, str] | None:
    """(path, line, function, code) of the user's innermost frame Dynamo recorded for `node`, or None."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', trace)
    # torch's frames (varlen_attn's own) and cpcompile's own attention plumbing are not the user's
    user = [f for f in frames if not f[0].startswith((_TORCH_DIR, *_NOT_USER))]
    return (user or frames)[-1] if frames else None


def node_frame(node: torch.fx.Node) -> tuple[str, int] | None:
    """(path, line) of the user's innermost frame Dynamo recorded for `node`, or None."""
    frame = _user_frame(node)
    return (frame[0], int(frame[1])) if frame is not None else None


def node_origin(node: torch.fx.Node, what: str = "attention node") -> str:
    """Name an FX node for an error message: node name plus the user's source line when Dynamo recorded it."""
    frame = _user_frame(node)
    if frame is not None:
        path, line, func, code = frame
        return f"{what} '{node.name}' at {path}:{line} in {func}: `{code.strip()}`"
    return f"{what} '{node.name}'"


def node_code(node: torch.fx.Node) -> str:
    """The user's source line of `node` ("" when Dynamo recorded none)."""
    frame = _user_frame(node)
    return frame[3].strip() if frame is not None else ""


def node_source(node: torch.fx.Node) -> str:
    """The user's source line of `node` as `file.py:line` ("?" when Dynamo recorded none)."""
    frame = _user_frame(node)
    return f"{os.path.basename(frame[0])}:{frame[1]}" if frame is not None else "?"


def site_error(
    node: torch.fx.Node, rule: str, fix: str, *, what: str = "attention node", action: str = "rewrite"
) -> CPCompileError:
    """Build the error for a node: which node (`what` names its kind), which rule, which fix."""
    return CPCompileError(f"cpcompile cannot {action} {node_origin(node, what)}: {rule}. Fix: {fix}")

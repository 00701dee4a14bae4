"""Where a call of a torch.compile'd function shows on the Python stack, and which backend it runs: torch's own
frames and wrapper objects, read by name (torch has no API for "which compiled call is in progress").

The eager guard (eager_guard.py) asks this for every eager attention call, to tell whether it runs inside a call
of a function compiled with a cpcompile backend. On torch 2.11-2.14 a compiled call (of a function or a module)
runs in `compile_wrapper` of torch/_dynamo/eval_frame.py, whose local `callback` leads to the backend through
torch's chain of wrappers (convert frame, debug wrapper, torch.compile's wrapper). Older releases ran it in `_fn`
(`self.callback`); that frame still exists around it, but its callback no longer leads to the backend.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

TORCH_VERSIONS = ("2.11", "2.13", "2.14")
"""The torch releases whose compiled calls run in these frames (tests/unit/test_compat.py checks the installed
one: each name is seen in a compiled call and leads to its backend)."""

EVAL_FRAME_FILE = os.path.normpath(torch._dynamo.eval_frame.__file__)
WRAPPER_NAMES = frozenset({"compile_wrapper"})
"""The functions of eval_frame.py that a compiled call runs in, holding its Dynamo callback."""
CHAIN = ("_torchdynamo_orig_backend", "_inner_convert", "compiler_fn", "__wrapped__")
"""The attributes that lead from a Dynamo callback to the backend, one wrapper at a time."""


def compile_callbacks(frame) -> Iterator[tuple[str, object]]:
    """(frame name, Dynamo callback) of every torch.compile wrapper frame from `frame` outwards."""
    while frame is not None:
        code = frame.f_code
        if code.co_name in WRAPPER_NAMES and os.path.normpath(code.co_filename) == EVAL_FRAME_FILE:
            local = frame.f_locals
            callback = local.get("callback") or getattr(local.get("self"), "callback", None)
            if callback is not None:
                yield code.co_name, callback
        frame = frame.f_back


def backend_chain(callback, depth: int = 8) -> Iterator[object]:
    """The callback and each wrapper after it, ending in the backend (at most `depth` objects)."""
    x = callback
    for _ in range(depth):
        if x is None:
            return
        yield x
        x = next((getattr(x, a) for a in CHAIN if getattr(x, a, None) is not None), None)

"""A refusal as one line for scripts: Dynamo wraps the backend's CPCompileError in a traceback of ~80 lines, in
which the one line that says what, where and the fix is easy to miss.

    cpcompile.one_line_refusals()  # a script's uncaught CPCompileError: its message, not the traceback

Every rank raises the same refusal before any collective runs (the ranks agree at compile time), so only rank 0
(the `RANK` torchrun sets; no `RANK`: this process) prints it; every rank still exits with status 1. Any other
uncaught error keeps Python's traceback.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType

from .errors import CPCompileError


def refusal_in(exc: BaseException | None) -> CPCompileError | None:
    """The CPCompileError in `exc`'s chain (Dynamo's BackendCompilerFailed keeps it as `inner_exception`), or None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, CPCompileError):
            return exc
        seen.add(id(exc))
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
    return None


def one_line_refusals(hint: str = "--verbose: the whole traceback") -> None:
    """Make an uncaught CPCompileError print `error: <its message> (<hint>)` on rank 0 instead of the traceback."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        refused = refusal_in(exc)
        if refused is None:
            previous(kind, exc, tb)
        elif os.environ.get("RANK", "0") == "0":
            print(f"error: {refused} ({hint})", file=sys.stderr, flush=True)

    sys.excepthook = hook

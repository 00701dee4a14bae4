"""The eager-attention guard: attention that runs outside a rewritten region while a model compiled with the
cpcompile backend is running raises CPCompileError instead of attending to this rank's local tokens.

Without fullgraph=True, Dynamo runs code eagerly in several ways nobody sees: a graph break at the attention
call, a `torch.compiler.disable`d function, a frame past the recompile limit, a compile error swallowed by
`suppress_errors`, a frame Dynamo cannot resume and skips. Attention run that way sees only the rank's own
tokens: a silently wrong model. The pass cannot see such code (it never reaches a graph), so the guard
works at run time:

- interception: torch's eager attention entry points are hooked when the first backend is made
  (compat/eager_attention.py: `F.scaled_dot_product_attention` wrapped, varlen_attn's ops given CPU and CUDA
  kernels that check first). Under Dynamo tracing the wrapper is inlined to the original call, so graphs do not
  change.
- scope: an eager attention call raises only when a call of a function compiled with a CPBackend is in
  progress on this thread: a torch.compile wrapper frame whose backend is a CPBackend is on the Python stack
  (compat/compile_frames.py reads torch's frames).
  Attention anywhere else (a reference model, evaluation without CP) runs as usual. The stack is only walked
  for eager attention calls, and only once a backend exists.
"""

from __future__ import annotations

import sys

from .compat import compile_frames, eager_attention
from .errors import CPCompileError

_state = {"backends": 0}


def _is_cp_backend(callback) -> bool:
    """Whether a Dynamo callback ends in a CPBackend (no import: backend.py imports us; CPBackend carries a class
    marker)."""
    return any(getattr(type(x), "is_cpcompile_backend", False) for x in compile_frames.backend_chain(callback))


def cp_call_in_progress() -> bool:
    """Whether a function compiled with a cpcompile backend is running on this thread (see module doc)."""
    if not _state["backends"]:
        return False
    return any(_is_cp_backend(cb) for _, cb in compile_frames.compile_callbacks(sys._getframe(1)))


def eager_attention_error(what: str) -> CPCompileError:
    return CPCompileError(
        f"{what} ran eagerly (outside a rewritten CP region) while a model compiled with the cpcompile backend "
        "was running: it would attend to this rank's local tokens only. Dynamo ran it outside its graph: a "
        "graph break at the attention call, a torch.compiler.disable'd function, the recompile limit "
        "(torch._dynamo.config.recompile_limit), a compile error suppressed by torch._dynamo.config."
        "suppress_errors (logged above), or a frame Dynamo skipped. Fix: compile with fullgraph=True to see the "
        "break and remove it; keep attention out of disabled functions; find recompiles with "
        "TORCH_LOGS=recompiles (pad to fixed shapes, cpcompile.pad_to_multiple)."
    )


def install() -> None:
    """Put the guard in place (idempotent) and count one more backend (the guard is live once one exists)."""
    _state["backends"] += 1
    eager_attention.install(cp_call_in_progress, eager_attention_error)

"""The eager-attention guard: attention that runs outside a rewritten region while a model compiled with the
cpcompile backend is running raises CPCompileError instead of attending to this rank's local tokens.

Without fullgraph=True, Dynamo runs code eagerly in several ways nobody sees: a graph break at the attention
call, a `torch.compiler.disable`d function, a frame past the recompile limit, a compile error swallowed by
`suppress_errors`, a frame Dynamo cannot resume and skips. Attention run that way sees only the rank's own
tokens: a silently wrong model. The pass cannot see such code (it never reaches a graph), so the guard
works at run time:

- interception: `torch.nn.functional.scaled_dot_product_attention` is replaced by a wrapper (installed when
  the first backend is made; code that calls `F.scaled_dot_product_attention`, as HF transformers, torchtitan
  and nn.MultiheadAttention do, goes through it) and varlen_attn's op (`torch_attn::_varlen_attn`, and
  `_varlen_attn_out` where torch has it) gets a CPU and a CUDA kernel that checks before running torch's own.
  Under Dynamo tracing the wrapper is inlined to the original call, so graphs do not change.
- scope: an eager attention call raises only when a call of a function compiled with a CPBackend is in
  progress on this thread: a torch.compile wrapper frame whose backend is a CPBackend is on the Python stack.
  Attention anywhere else (a reference model, evaluation without CP) runs as usual. The stack is only walked
  for eager attention calls, and only once a backend exists.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .errors import CPCompileError

_SDPA = torch._C._nn.scaled_dot_product_attention
"""The original function (F.scaled_dot_product_attention is this builtin until the guard is installed)."""

_EVAL_FRAME_FILE = os.path.normpath(torch._dynamo.eval_frame.__file__)
_WRAPPER_NAMES = frozenset({"compile_wrapper", "_fn"})
"""The function torch.compile's wrapper runs a compiled call in (torch 2.13: compile_wrapper, older: _fn)."""

_state = {"installed": False, "backends": 0}


def _is_cp_backend(callback) -> bool:
    """Whether a Dynamo callback ends in a CPBackend: callback -> ConvertFrame -> debug wrapper ->
    torch.compile's wrapper -> the backend (torch's own chain of wrappers, followed attribute by attribute)."""
    x = callback
    for _ in range(8):
        if getattr(type(x), "is_cpcompile_backend", False):  # CPBackend (no import: backend.py imports us)
            return True
        x = next(
            (
                getattr(x, a)
                for a in ("_torchdynamo_orig_backend", "_inner_convert", "compiler_fn", "__wrapped__")
                if getattr(x, a, None) is not None
            ),
            None,
        )
        if x is None:
            return False
    return False


def cp_call_in_progress() -> bool:
    """Whether a function compiled with a cpcompile backend is running on this thread (see module doc)."""
    if not _state["backends"]:
        return False
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name in _WRAPPER_NAMES and os.path.normpath(code.co_filename) == _EVAL_FRAME_FILE:
            local = frame.f_locals
            callback = local.get("callback") or getattr(local.get("self"), "callback", None)
            if callback is not None and _is_cp_backend(callback):
                return True
        frame = frame.f_back
    return False


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


def _guarded_sdpa(*args, **kwargs):
    # Only a call that computes is guarded: a plain tensor off the meta device, outside tracing (torch 2.11's
    # Dynamo runs an op's composite body, e.g. cpcompile.attention's, on FakeTensors with is_compiling() False).
    # Written inline, is_compiling() first: Dynamo compiles any helper frame called here from an eager frame,
    # and inside that frame is_compiling() is a constant True.
    query = args[0] if args else kwargs.get("query")
    if (
        not torch.compiler.is_compiling()
        and type(query) is torch.Tensor
        and query.device.type != "meta"
        and cp_call_in_progress()
    ):
        raise eager_attention_error("scaled_dot_product_attention")
    return _SDPA(*args, **kwargs)


_guarded_sdpa.__doc__ = _SDPA.__doc__  # not functools.wraps: Dynamo must see a plain Python function to inline


def _guarded_kernel(op, name: str) -> Callable:
    original = op._init_fn

    def kernel(*args, **kwargs):
        if cp_call_in_progress():
            raise eager_attention_error(name)
        return original(*args, **kwargs)

    return kernel


def _varlen_ops() -> list:
    try:
        import torch.nn.attention.varlen as varlen
    except ImportError:
        return []
    return [op for op in (getattr(varlen, n, None) for n in ("_varlen_attn", "_varlen_attn_out")) if op is not None]


def install() -> None:
    """Put the guard in place (idempotent) and count one more backend (the guard is live once one exists)."""
    _state["backends"] += 1
    if _state["installed"]:
        return
    F.scaled_dot_product_attention = _guarded_sdpa
    for op in _varlen_ops():
        op.register_kernel(("cpu", "cuda"))(_guarded_kernel(op, "varlen_attn"))
    _state["installed"] = True

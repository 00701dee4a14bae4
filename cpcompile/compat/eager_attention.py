"""Hooks on torch's eager attention entry points: torch has no per-call hook for them, so a check cpcompile
installs (eager_guard.py: attention Dynamo runs eagerly inside a compiled call) is patched in.

- `torch.nn.functional.scaled_dot_product_attention` is replaced by `guarded_sdpa`, a plain Python function that
  calls the builtin `torch._C._nn.scaled_dot_product_attention` (what F.scaled_dot_product_attention is on torch
  2.11-2.14); code that calls `F.scaled_dot_product_attention`, as HF transformers, torchtitan and
  nn.MultiheadAttention do, goes through it. Under Dynamo tracing it is inlined to the original call, so graphs
  do not change.
- varlen_attn's ops (`torch_attn::_varlen_attn`, and `_varlen_attn_out` on torch 2.13 and 2.14) get a CPU and a
  CUDA kernel that check first, then run torch's own (`_init_fn`, the custom op's implementation).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

TORCH_VERSIONS = ("2.11", "2.13", "2.14")
"""The torch releases these hooks are written for (tests/unit/test_compat.py checks the installed one)."""
VARLEN_OPS = {"_varlen_attn": ("2.11", "2.13", "2.14"), "_varlen_attn_out": ("2.13", "2.14")}
"""varlen_attn's custom ops in torch.nn.attention.varlen, and the releases that have each."""

SDPA = torch._C._nn.scaled_dot_product_attention
"""The original function (F.scaled_dot_product_attention is this builtin until the hook is installed)."""

_HOOK: list = []
"""[in_progress, error] once installed: in_progress() says whether an eager call must be refused, error(name)
makes the exception."""


def guarded_sdpa(*args, **kwargs):
    # Only a call that computes is checked: a plain tensor off the meta device, outside tracing (torch 2.11's
    # Dynamo runs an op's composite body, e.g. cpcompile.attention's, on FakeTensors with is_compiling() False).
    # Written inline, is_compiling() first: Dynamo compiles any helper frame called here from an eager frame,
    # and inside that frame is_compiling() is a constant True.
    query = args[0] if args else kwargs.get("query")
    if (
        not torch.compiler.is_compiling()
        and type(query) is torch.Tensor
        and query.device.type != "meta"
        and _HOOK
        and _HOOK[0]()
    ):
        raise _HOOK[1]("scaled_dot_product_attention")
    return SDPA(*args, **kwargs)


guarded_sdpa.__doc__ = SDPA.__doc__  # not functools.wraps: Dynamo must see a plain Python function to inline


def _guarded_kernel(op, name: str) -> Callable:
    original = op._init_fn

    def kernel(*args, **kwargs):
        if _HOOK[0]():
            raise _HOOK[1](name)
        return original(*args, **kwargs)

    return kernel


def varlen_ops() -> list:
    """varlen_attn's custom ops this torch has."""
    try:
        import torch.nn.attention.varlen as varlen
    except ImportError:
        return []
    return [op for op in (getattr(varlen, n, None) for n in VARLEN_OPS) if op is not None]


def install(in_progress: Callable[[], bool], error: Callable[[str], Exception]) -> None:
    """Hook the eager entry points (once; later calls keep the first check)."""
    if _HOOK:
        return
    _HOOK[:] = [in_progress, error]
    F.scaled_dot_product_attention = guarded_sdpa
    for op in varlen_ops():
        op.register_kernel(("cpu", "cuda"))(_guarded_kernel(op, "varlen_attn"))

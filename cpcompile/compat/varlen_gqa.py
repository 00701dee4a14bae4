"""varlen_attn's `enable_gqa` keyword: torch 2.13 and 2.14 take it, torch 2.11 has none (there GQA follows the head
counts). Callers that build a varlen_attn call (integrations/hf.py's packed rows) pass what this torch takes."""

from __future__ import annotations

import inspect

TORCH_VERSIONS = ("2.11",)
"""The torch releases whose varlen_attn has no enable_gqa (tests/unit/test_compat.py checks the installed one)."""


def _gqa_kwargs() -> dict:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return {}
    return {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}


VARLEN_GQA_KWARGS = _gqa_kwargs()
"""{"enable_gqa": True} where varlen_attn takes the keyword, else {} (a constant: read inside traced code)."""

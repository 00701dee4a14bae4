"""CP regions: the plain torch functions the pass inserts in place of an attention node."""

from .a2a import a2a_attention
from .a2a_varlen import a2a_varlen_attention
from .all_gather import all_gather_attention
from .all_gather_varlen import all_gather_varlen_attention

REGIONS = {"all_gather": all_gather_attention, "a2a": a2a_attention}
VARLEN_REGIONS = {"all_gather": all_gather_varlen_attention, "a2a": a2a_varlen_attention}
"""Regions for varlen_attn sites (packed documents), by comm."""

__all__ = [
    "REGIONS",
    "VARLEN_REGIONS",
    "a2a_attention",
    "a2a_varlen_attention",
    "all_gather_attention",
    "all_gather_varlen_attention",
]

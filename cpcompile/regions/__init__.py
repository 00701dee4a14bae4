"""CP regions: the plain torch functions the pass inserts in place of an attention node."""

from .a2a import a2a_attention
from .all_gather import all_gather_attention

REGIONS = {"all_gather": all_gather_attention, "a2a": a2a_attention}

__all__ = ["REGIONS", "a2a_attention", "all_gather_attention"]

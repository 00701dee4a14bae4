"""CP regions: the plain torch functions the pass inserts in place of an attention node."""

from .all_gather import all_gather_attention

REGIONS = {"all_gather": all_gather_attention}

__all__ = ["REGIONS", "all_gather_attention"]

"""The user-side helpers: cut a global batch into this rank's tokens (any layout), and put it back together.

api.py dispatches shard / unshard by layout kind: dense.py (chunk layouts), packed.py (packed documents,
cu_seqlens-aware, thd_balanced's per-batch plan), dtensor.py (DTensor in/out); batch.py shards whole batch dicts;
flex.py gives a rank its FlexAttention BlockMask.
"""

from .api import shard, unshard
from .batch import METADATA_KEYS, SEQUENCE_KEYS, shard_batch
from .dense import pad_to_multiple
from .flex import shard_block_mask
from .packed import pad_cu_seqlens, pad_documents, plan_documents

__all__ = [
    "METADATA_KEYS",
    "SEQUENCE_KEYS",
    "pad_cu_seqlens",
    "pad_documents",
    "pad_to_multiple",
    "plan_documents",
    "shard",
    "shard_batch",
    "shard_block_mask",
    "unshard",
]

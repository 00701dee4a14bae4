"""The block executor: run a rank's attention blocks on a kernel provider and merge them.

`attend` / `attend_backward` (dense blocks, dense.py) are what the regions call: recorded into the region's graph
for a traceable provider, else the opaque custom ops `torch.ops.cpcompile.attend_blocks(_backward)` (dense_ops.py,
registered on import). `torch.ops.cpcompile.attend_varlen_blocks(_backward)` run packed documents (varlen.py; their
per-block metadata, built by the caller once per batch: `prepare_blocks`, varlen_meta.py). The names below are the
surface other code (regions, bench/, tests) uses; the modules' private helpers are not.
"""

from . import streams
from .blocks import BlockTuple, VarlenSpec, decode_dense, decode_varlen, encode_dense, encode_varlen
from .calls import Call, plan_calls
from .dense import attend, attend_backward, planned_calls, traced
from .dense_ops import attend_blocks, attend_blocks_backward
from .dense_run import backward_thunks, call_work, forward_thunks, merged, summed
from .varlen import attend_varlen, attend_varlen_backward, attend_varlen_blocks, attend_varlen_blocks_backward
from .varlen_meta import prepare_blocks

__all__ = [
    "BlockTuple",
    "Call",
    "VarlenSpec",
    "attend",
    "attend_backward",
    "attend_blocks",
    "attend_blocks_backward",
    "attend_varlen",
    "attend_varlen_backward",
    "attend_varlen_blocks",
    "attend_varlen_blocks_backward",
    "backward_thunks",
    "call_work",
    "decode_dense",
    "decode_varlen",
    "encode_dense",
    "encode_varlen",
    "forward_thunks",
    "merged",
    "plan_calls",
    "planned_calls",
    "prepare_blocks",
    "streams",
    "summed",
    "traced",
]

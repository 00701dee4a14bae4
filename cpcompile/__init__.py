"""cpcompile: context parallelism for PyTorch as a torch.compile pass.

model = torch.compile(model, backend=cpcompile.backend(strategy="zigzag", mesh=mesh), fullgraph=True)
"""

from . import integrations
from .attention_op import attention
from .backend import CPBackend, backend
from .brief_errors import one_line_refusals
from .errors import CPCompileError
from .explain import explain
from .mixers import hf_token_mixers, token_mixer
from .sharding import (
    pad_cu_seqlens,
    pad_documents,
    pad_to_multiple,
    plan_documents,
    shard,
    shard_batch,
    shard_block_mask,
    unshard,
)
from .shutdown import destroy_process_group
from .token_local import mark_token_local
from .verify import verify

__version__ = "0.1.0"

integrations.install()  # attn_implementation="cpcompile" once transformers is imported (integrations/hf.py)

__all__ = [
    "CPBackend",
    "CPCompileError",
    "attention",
    "backend",
    "destroy_process_group",
    "explain",
    "hf_token_mixers",
    "mark_token_local",
    "one_line_refusals",
    "pad_cu_seqlens",
    "pad_documents",
    "pad_to_multiple",
    "plan_documents",
    "shard",
    "shard_batch",
    "shard_block_mask",
    "token_mixer",
    "unshard",
    "verify",
]

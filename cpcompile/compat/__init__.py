"""torch compatibility: every patch cpcompile applies to torch, and every place it reads torch internals that move
between releases, one module each. Each states the torch releases it serves (`TORCH_VERSIONS`), and
tests/unit/test_compat.py checks that against the installed torch: the unpatched behaviour is still broken there
(or the internals still look as read), and the patch is a no-op where it is not needed.

- dtensor_cpu_sdpa: DTensor sharding rules for the CPU SDPA kernels (torch has them for CUDA only);
- varlen_fake: varlen_attn's fake output takes v's head dim (torch's takes q's: MLA fails to trace);
- eager_attention: hooks on F.scaled_dot_product_attention and varlen_attn's ops for the eager guard;
- varlen_gqa: varlen_attn's enable_gqa keyword where torch has it;
- dist_nn_defaults: torch.distributed.nn.functional's default `group` arguments no longer pin the default process
  group past destroy_process_group;
- compile_frames: which stack frames and wrapper attributes lead from a compiled call to its backend;
- graph_break: whether Dynamo cut a graph at a graph break (its outputs go on into Python code);
- versions: the installed release as TORCH_VERSIONS name it.
"""

from __future__ import annotations

import torch.distributed as dist

from .dist_nn_defaults import unpin_default_group
from .dtensor_cpu_sdpa import register_cpu_sdpa_rules
from .varlen_fake import fix_varlen_fake


def install() -> None:
    """The import-time patches (idempotent): Dynamo traces a model before any backend is called, and the default
    process group must not be pinned by a module imported while it exists."""
    register_cpu_sdpa_rules()
    fix_varlen_fake()
    if dist.is_available():
        unpin_default_group()


__all__ = ["fix_varlen_fake", "install", "register_cpu_sdpa_rules", "unpin_default_group"]

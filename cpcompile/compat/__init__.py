"""torch compatibility: every patch cpcompile applies to torch, and every place it reads torch internals that move
between releases, one module each. Each states the torch releases it serves (`TORCH_VERSIONS`), and
tests/unit/test_compat.py checks that against the installed torch: the unpatched behaviour is still broken there
(or the internals still look as read), and the patch is a no-op where it is not needed.

- dtensor_cpu_sdpa: DTensor sharding rules for the CPU SDPA kernels (torch has them for CUDA only);
- varlen_fake: varlen_attn's fake output takes v's head dim (torch's takes q's: MLA fails to trace);
- eager_attention: hooks on F.scaled_dot_product_attention and varlen_attn's ops for the eager guard;
- varlen_gqa: varlen_attn's enable_gqa keyword where torch has it;
- compile_frames: which stack frames and wrapper attributes lead from a compiled call to its backend;
- graph_break: whether Dynamo cut a graph at a graph break (its outputs go on into Python code);
- versions: the installed release as TORCH_VERSIONS name it.
"""

from __future__ import annotations

from .dtensor_cpu_sdpa import register_cpu_sdpa_rules
from .varlen_fake import fix_varlen_fake


def install() -> None:
    """The import-time patches (idempotent): Dynamo traces a model before any backend is called."""
    register_cpu_sdpa_rules()
    fix_varlen_fake()


__all__ = ["fix_varlen_fake", "install", "register_cpu_sdpa_rules"]

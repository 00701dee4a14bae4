"""torch's varlen_attn fake gives its output q's head dim; MLA (v's head dim differs from q/k's) needs v's.

torch 2.11-2.14 register `torch_attn::_varlen_attn`'s fake as `empty_like(query)`: FA2, its only kernel, takes one
head dim, so eager varlen_attn never meets a v of another width. Under cpcompile the region runs kernels that do
(cudnn_varlen, cpu_varlen_ref), but Dynamo traces the model with the fake first, so whatever follows the call (a
reshape to H * Dv, the output projection) fails on q's width before the pass runs. The wrapper keeps torch's
fake and corrects only the output's last dim, only when v's differs (equal widths: torch's output unchanged);
eager calls are unchanged.
"""

from __future__ import annotations

import functools

TORCH_VERSIONS = ("2.11", "2.13", "2.14")
"""The torch releases whose fake gives q's width (tests/unit/test_compat.py checks the installed one's)."""


def fix_varlen_fake() -> bool:
    """Wrap torch's varlen_attn fake so its output takes v's head dim (idempotent; a no-op without the op).
    True when this call wrapped it."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return False
    op = getattr(varlen, "_varlen_attn", None)
    fake = getattr(op, "_abstract_fn", None)
    if fake is None or getattr(fake, "_cpcompile_v_width", False):
        return False

    @functools.wraps(fake)
    def with_v_width(query, key, value, *args, **kwargs):
        out, *rest = fake(query, key, value, *args, **kwargs)
        if value.shape[-1] != out.shape[-1]:
            out = out.new_empty((*out.shape[:-1], value.shape[-1]))
        return (out, *rest)

    with_v_width._cpcompile_v_width = True
    op.register_fake(with_v_width)
    return True

"""CPU provider: aten's flash-attention kernel for CPU (forward and backward, GQA, any float dtype).

aten's kernel takes one head dim for q, k and v; MLA blocks (v's head dim differs) run on it with the smaller
head dim zero-padded to the larger: zero columns add nothing to q.k (the scale is explicit) and give zero output
columns, so the sliced results are exact. CPU runs are tests and small models, where the pad copies are cheap.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import any_head_dim, cpu_support_problem

_aten = torch.ops.aten


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))


class CPUFlashKernel:
    name = "cpu_flash"

    def supports(self, device: torch.device, dtype: torch.dtype) -> str | None:
        return cpu_support_problem(device, dtype)

    supports_head_dim = staticmethod(any_head_dim)

    def forward(self, q, k, v, causal, scale):
        d, d_v = q.shape[-1], v.shape[-1]
        if d != d_v:
            out, lse = self.forward(*(_pad(t, max(d, d_v)) for t in (q, k, v)), causal, scale)
            return out[..., :d_v], lse
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        d, d_v = q.shape[-1], v.shape[-1]
        if d != d_v:
            padded = (_pad(t, max(d, d_v)) for t in (dout, q, k, v, out))
            dq, dk, dv = self.backward(*padded, lse, causal, scale)
            return dq[..., :d], dk[..., :d], dv[..., :d_v]
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )

"""CPU provider: aten's flash-attention kernel for CPU (forward and backward, GQA, any float dtype)."""

from __future__ import annotations

import torch

from .base import any_head_dim, cpu_support_problem

_aten = torch.ops.aten


class CPUFlashKernel:
    name = "cpu_flash"

    def supports(self, device: torch.device, dtype: torch.dtype) -> str | None:
        return cpu_support_problem(device, dtype)

    supports_head_dim = staticmethod(any_head_dim)

    def forward(self, q, k, v, causal, scale):
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )

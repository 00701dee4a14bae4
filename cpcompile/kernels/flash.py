"""FlashAttention-2 provider: aten's `_scaled_dot_product_flash_attention(_backward)` (CUDA, fp16/bf16, GQA).

About 1.7x slower than cuDNN on Hopper at the Llama3-8B shape, but it takes head dims cuDNN refuses and it is
the kernel behind varlen (cu_seqlens, bottom-right causal). q/k/v need a unit last dim; its backward makes
dout and out contiguous (BSHD) itself.
"""

from __future__ import annotations

import torch

from ._cuda import cuda_half_reason, head_dim_reason, squeeze_lse

_aten = torch.ops.aten


class FlashKernel:
    name = "flash"

    def supports(self, device: torch.device, dtype: torch.dtype) -> str | None:
        return cuda_half_reason(device, dtype, "FlashAttention-2")

    def supports_head_dim(self, head_dim: int, v_head_dim: int | None = None) -> str | None:
        return head_dim_reason(head_dim, "FlashAttention-2", v_head_dim)

    def forward(self, q, k, v, causal, scale):
        out, lse, *_ = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out, squeeze_lse(lse, 3)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        seed = q.new_empty(2, dtype=torch.int64)
        return _aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, q.shape[-2], k.shape[-2],
            0.0, causal, seed, seed, scale=scale,
        )  # fmt: skip

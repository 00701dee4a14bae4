"""cuDNN provider: aten's `_scaled_dot_product_cudnn_attention(_backward)` (CUDA, fp16/bf16, native GQA).

The fastest dense kernel on Hopper (about 1.7x torch's FlashAttention-2 at the Llama3-8B shape). It takes
any strides with a unit last dim, so batched views of causal squares and token-major gathered K/V need no
copy. It only does top-left causal masks, which is exactly what a causal-square block is. v's head dim may
differ from q/k's (MLA): aten's cuDNN graph has separate d_qk and d_v.
"""

from __future__ import annotations

import torch

from ._cuda import cuda_half_reason, head_dim_reason, squeeze_lse

_aten = torch.ops.aten


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    b, h, s, d = grad.shape
    return grad if groups == 1 else grad.view(b, h // groups, groups, s, d).sum(2)


class CuDNNKernel:
    """`expand_kv=True` repeats K/V heads up to the q heads for a cuDNN without GQA (measured by the probe)."""

    name = "cudnn"
    supports_window = False
    supports_softcap = False
    traceable = True
    """Aten ops on views: the executor records its calls into the region's graph (executor/dense.py)."""

    def __init__(self, expand_kv: bool = False):
        self.expand_kv = expand_kv

    def supports(self, device: torch.device, dtype: torch.dtype) -> str | None:
        reason = cuda_half_reason(device, dtype, "cuDNN attention")
        if reason is None and not torch.backends.cudnn.is_available():
            reason = "this torch build has no cuDNN"
        if reason is None and (torch.backends.cudnn.version() or 0) < 90000:
            reason = f"cuDNN {torch.backends.cudnn.version()} is older than 9.0"
        return reason

    def supports_head_dim(self, head_dim: int, v_head_dim: int | None = None) -> str | None:
        return head_dim_reason(head_dim, "cuDNN attention", v_head_dim, distinct_v=True)  # cuDNN takes d_qk != d_v

    def forward(self, q, k, v, causal, scale):
        if self.expand_kv:
            g = q.shape[1] // k.shape[1]
            k, v = _expand(k, g), _expand(v, g)
        out, lse, *_ = _aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        return out, squeeze_lse(lse, 3)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        g = q.shape[1] // k.shape[1] if self.expand_kv else 1
        k, v = _expand(k, g), _expand(v, g)
        empty = q.new_empty(0, dtype=torch.int64)
        dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.contiguous().unsqueeze(-1), empty, empty,
            None, None, None, q.shape[-2], k.shape[-2], 0.0, causal, scale=scale,
        )  # fmt: skip
        return dq, _fold(dk, g), _fold(dv, g)

"""FlashAttention-2 provider: aten's `_scaled_dot_product_flash_attention(_backward)` (CUDA, fp16/bf16, GQA).

About 1.7x slower than cuDNN on Hopper at the Llama3-8B shape, but it takes head dims cuDNN refuses and it is
the kernel behind varlen (cu_seqlens, bottom-right causal). q/k/v need a unit last dim; its backward makes
dout and out contiguous (BSHD) itself. Windowed blocks (kernels/base.py) run on aten's dense
`_flash_attention_forward/_backward` (no cu_seqlens: (B, S, H, D) views), whose window_size_left/right are
flash-attn's, on the same bottom-right diagonal as the blocks' windows (FA2 reads a side of -1 or >= Sk as Sk,
which layouts/window.fa2_exact keeps from meaning anything else). No softcap: aten's FA2 has none.
"""

from __future__ import annotations

import torch

from ._cuda import cuda_half_reason, head_dim_reason, squeeze_lse

_aten = torch.ops.aten


def _bshd(t: torch.Tensor) -> torch.Tensor:
    """(B, H, S, D) -> the (B, S, H, D) view FA2 takes, copied only where the last dim is not unit-strided."""
    t = t.transpose(1, 2)
    return t if t.stride(-1) == 1 else t.contiguous()


def _window_kwargs(window: tuple[int, int]) -> dict:
    return {"window_size_left": window[0], "window_size_right": window[1]}


class FlashKernel:
    name = "flash"
    supports_window = True
    supports_softcap = False
    traceable = True
    """Aten ops on views: the executor records its calls into the region's graph (executor/dense.py)."""

    def supports(self, device: torch.device, dtype: torch.dtype) -> str | None:
        return cuda_half_reason(device, dtype, "FlashAttention-2")

    def supports_head_dim(self, head_dim: int, v_head_dim: int | None = None) -> str | None:
        return head_dim_reason(head_dim, "FlashAttention-2", v_head_dim)

    def forward(self, q, k, v, causal, scale, window=None):
        if window is not None:
            out, lse, *_ = _aten._flash_attention_forward(
                _bshd(q), _bshd(k), _bshd(v), None, None, q.shape[-2], k.shape[-2], 0.0, False, False,
                scale=scale, **_window_kwargs(window),
            )  # fmt: skip
            return out.transpose(1, 2), lse
        out, lse, *_ = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out, squeeze_lse(lse, 3)

    def backward(self, dout, q, k, v, out, lse, causal, scale, window=None):
        if window is not None:
            rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
            dq, dk, dv = _aten._flash_attention_backward(
                _bshd(dout), _bshd(q), _bshd(k), _bshd(v), _bshd(out), lse.float().contiguous(), None, None,
                q.shape[-2], k.shape[-2], 0.0, False, rng, q.new_empty(0), scale=scale, **_window_kwargs(window),
            )  # fmt: skip
            return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        seed = q.new_empty(2, dtype=torch.int64)
        return _aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, q.shape[-2], k.shape[-2],
            0.0, causal, seed, seed, scale=scale,
        )  # fmt: skip

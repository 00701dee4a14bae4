"""CPU provider: aten's flash-attention kernel for CPU (forward and backward, GQA, any float dtype).

aten's kernel takes one head dim for q, k and v; MLA blocks (v's head dim differs) run on it with the smaller
head dim zero-padded to the larger: zero columns add nothing to q.k (the scale is explicit) and give zero output
columns, so the sliced results are exact. CPU runs are tests and small models, where the pad copies are cheap.
Windowed blocks (kernels/base.py) take the kernel's additive attn_mask (q's dtype, -inf outside the window),
forward and backward: the kernel has no window of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import any_head_dim, cpu_support_problem

_aten = torch.ops.aten


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))


def window_mask(sq: int, sk: int, window: tuple[int, int], device: torch.device) -> torch.Tensor:
    """(Sq, Sk) bool: key j visible to row i under a bottom-right window (kernels/base.py)."""
    left, right = window
    rel = torch.arange(sk, device=device)[None, :] - torch.arange(sq, device=device)[:, None] - (sk - sq)
    mask = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        mask &= rel >= -left
    if right >= 0:
        mask &= rel <= right
    return mask


def _additive(q: torch.Tensor, k: torch.Tensor, window: tuple[int, int] | None) -> dict:
    if window is None:
        return {}
    mask = window_mask(q.shape[-2], k.shape[-2], window, q.device)
    return {"attn_mask": torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))}


class CPUFlashKernel:
    name = "cpu_flash"
    supports_window = True
    supports_softcap = False
    traceable = True
    """Aten ops on views: the executor records its calls into the region's graph (executor/dense.py)."""

    def supports(self, device: torch.device, dtype: torch.dtype) -> str | None:
        return cpu_support_problem(device, dtype)

    supports_head_dim = staticmethod(any_head_dim)

    def forward(self, q, k, v, causal, scale, window=None):
        d, d_v = q.shape[-1], v.shape[-1]
        if d != d_v:
            out, lse = self.forward(*(_pad(t, max(d, d_v)) for t in (q, k, v)), causal, scale, window)
            return out[..., :d_v], lse
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale, **_additive(q, k, window)
        )
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal, scale, window=None):
        d, d_v = q.shape[-1], v.shape[-1]
        if d != d_v:
            padded = (_pad(t, max(d, d_v)) for t in (dout, q, k, v, out))
            dq, dk, dv = self.backward(*padded, lse, causal, scale, window)
            return dq[..., :d], dk[..., :d], dv[..., :d_v]
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale, **_additive(q, k, window)
        )

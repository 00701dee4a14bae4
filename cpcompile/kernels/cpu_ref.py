"""CPU reference dense provider: math attention in fp32 (fp64 for fp64 inputs) with windows and softcapped scores.

aten has no kernel that softcaps scores (Gemma 2's tanh capping), so softcapped sites run here on CPU (on CUDA
they are refused: no provider takes softcap). O(Sq * Sk) memory per block: tests and small CPU runs. It follows
base.AttentionKernel (causal squares top-left, windows bottom-right, LSE (B, Hq, Sq) of the capped scores,
backward from the final out/lse) and returns its partial outputs and gradients in the accumulation dtype.
"""

from __future__ import annotations

import torch

from ..precision import acc_dtype
from .base import any_head_dim, cpu_support_problem
from .cpu_flash import window_mask


def _mask(sq: int, sk: int, causal: bool, window, device) -> torch.Tensor | None:
    if window is not None:
        return window_mask(sq, sk, window, device)
    if causal:
        return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()
    return None


class CPUReferenceKernel:
    name = "cpu_ref"
    supports_window = True
    supports_softcap = True
    last_resort = True
    """kernel="auto" offers it only where no other provider runs the site (it materialises the scores)."""
    traceable = True
    """Torch math: the executor records its calls into the region's graph (executor/dense.py)."""

    def supports(self, device: torch.device, dtype: torch.dtype) -> str | None:
        return cpu_support_problem(device, dtype)

    supports_head_dim = staticmethod(any_head_dim)

    def _scores(self, q, k, causal, scale, window, softcap):
        """(capped scores with -inf where masked, d capped / d raw or None, k expanded to q's heads, groups)."""
        acc = acc_dtype(q.dtype)
        groups = q.shape[1] // k.shape[1]
        kh = k.to(acc).repeat_interleave(groups, dim=1)
        raw = (q.to(acc) @ kh.transpose(-1, -2)) * scale
        slope = None
        if softcap:
            capped = torch.tanh(raw / softcap)
            slope, raw = 1 - capped * capped, capped * softcap
        mask = _mask(q.shape[-2], k.shape[-2], causal, window, q.device)
        if mask is not None:
            raw = raw.masked_fill(~mask, float("-inf"))
        return raw, slope, kh, groups

    def forward(self, q, k, v, causal, scale, window=None, softcap=0.0):
        scores, _, _, groups = self._scores(q, k, causal, scale, window, softcap)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse[..., None])
        return probs @ v.to(probs.dtype).repeat_interleave(groups, dim=1), lse

    def backward(self, dout, q, k, v, out, lse, causal, scale, window=None, softcap=0.0):
        scores, slope, kh, groups = self._scores(q, k, causal, scale, window, softcap)
        acc = scores.dtype
        probs = torch.exp(scores - lse.to(acc)[..., None])
        do, vh = dout.to(acc), v.to(acc).repeat_interleave(groups, dim=1)
        delta = (do * out.to(acc)).sum(-1, keepdim=True)
        ds = probs * (do @ vh.transpose(-1, -2) - delta)
        if slope is not None:
            ds = ds * slope
        dq = (ds @ kh) * scale
        dk = (ds.transpose(-1, -2) @ q.to(acc)) * scale
        dv = probs.transpose(-1, -2) @ do

        def fold(g: torch.Tensor) -> torch.Tensor:  # q heads back onto their kv head
            b, h, s, d = g.shape
            return g.view(b, h // groups, groups, s, d).sum(2)

        return dq, fold(dk), fold(dv)

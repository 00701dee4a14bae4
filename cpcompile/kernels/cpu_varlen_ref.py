"""CPU reference varlen provider: dense attention under a mask built from the ranges (aten has no CPU varlen).

O(Tq * Tk) memory per block, computed in fp32 (fp64 for fp64 inputs): meant for tests and small CPU runs,
where its simplicity is the point. It follows base.VarlenAttentionKernel exactly (bottom-right causal, LSE
(Hq, Tq), final out/lse in backward) and returns out = 0, lse = -inf for rows without keys. Its partial
outputs and gradients stay in the accumulation dtype (the executor sums them in it anyway), so low-precision
runs round once, at the end.
"""

from __future__ import annotations

import torch

from ..precision import acc_dtype
from .base import any_head_dim, cpu_support_problem, range_ids


def _mask(
    ranges: torch.Tensor, tq: int, tk: int, causal: bool, window: tuple[int, int], top_left: bool = False
) -> torch.Tensor:
    """(Tq, Tk) bool: which keys each q row sees (causal and window on the bottom-right diagonal, or on the
    top-left one when `top_left`: cuDNN's other anchor, the same mask on a square range)."""
    qs, qe, ks, ke = ranges
    qid, kid = range_ids(qs, qe, tq), range_ids(ks, ke, tk)
    mask = (qid[:, None] == kid[None, :]) & (qid >= 0)[:, None]
    left, right = window
    if causal:
        right = 0
    if left >= 0 or right >= 0:
        seq = qid.clamp(min=0)
        t = torch.arange(tq, device=ranges.device) - qs[seq]
        shift = 0 if top_left else (ke - ks - (qe - qs))[seq]
        j = torch.arange(tk, device=ranges.device)[None, :] - ks[kid.clamp(min=0)][None, :]
        rel = j - (t + shift)[:, None]  # key position relative to the row's diagonal
        if right >= 0:
            mask &= rel <= right
        if left >= 0:
            mask &= rel >= -left
    return mask


def _heads_first(x: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """(T, H, D) -> (H * groups, T, D) in `dtype`, each kv head repeated for its group of q heads."""
    return x.to(dtype).repeat_interleave(groups, dim=1).transpose(0, 1)


class CPUVarlenReference:
    name = "cpu_varlen_ref"
    traceable = False
    """The reference stays one opaque executor op: its materialised scores would fill the graph, and CPU speed is
    not the point (tests/unit/test_varlen_traced.py runs the traced path on it)."""
    supports_window = True

    def supports(self, device: torch.device, dtype: torch.dtype) -> str | None:
        return cpu_support_problem(device, dtype)

    supports_head_dim = staticmethod(any_head_dim)

    top_left = False
    """The diagonal anchor of the mask: bottom-right (the interface's). A CPU stand-in for cuDNN's top-left
    calls sets it on its own instance (tests/support/cudnn_stand_in.py)."""

    def _probs(self, q, k, ranges, causal, scale, window, lse=None):
        acc = acc_dtype(q.dtype)
        groups = q.shape[1] // k.shape[1]
        qh, kh = q.to(acc).transpose(0, 1), _heads_first(k, groups, acc)
        mask = _mask(ranges, q.shape[0], k.shape[0], causal, window, self.top_left)
        scores = (qh @ kh.transpose(1, 2)) * scale
        if lse is None:
            lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)
        safe = torch.where(torch.isinf(lse), 0, lse)
        probs = torch.where(mask, torch.exp(scores - safe[..., None]), 0)
        return probs, lse, qh, kh, groups

    def grad_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return acc_dtype(dtype)  # partial gradients stay in the accumulation dtype

    def prepared_count(self, window: tuple[int, int] = (-1, -1), tiled: bool = False, square: bool = False) -> int:
        return 0

    def prepare(self, ranges, tq, tk, max_q, window=(-1, -1), tiled=False, square=False) -> list[torch.Tensor]:
        """Nothing: the reference builds its dense mask from the ranges at every call."""
        return []

    def forward(
        self, q, k, v, ranges, max_q, max_k, causal, scale, window=(-1, -1), tiled=False, square=False, prepared=None
    ):
        probs, lse, _, _, groups = self._probs(q, k, ranges, causal, scale, window)
        out = probs @ _heads_first(v, groups, probs.dtype)
        return out.transpose(0, 1), lse

    def backward(
        self, dout, q, k, v, out, lse, ranges, max_q, max_k, causal, scale, window=(-1, -1), tiled=False,
        square=False, prepared=None,
    ):  # fmt: skip
        probs, _, qh, kh, groups = self._probs(q, k, ranges, causal, scale, window, lse.to(acc_dtype(q.dtype)))
        acc = probs.dtype
        do, vh = dout.to(acc).transpose(0, 1), _heads_first(v, groups, acc)
        delta = (do * out.to(acc).transpose(0, 1)).sum(-1, keepdim=True)
        ds = probs * (do @ vh.transpose(1, 2) - delta)
        dq = (ds @ kh) * scale
        dk = (ds.transpose(1, 2) @ qh) * scale
        dv = probs.transpose(1, 2) @ do

        def fold(g: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
            g = g.transpose(0, 1)  # (T, Hq, D)
            return g.unflatten(1, (ref.shape[1], groups)).sum(2)

        return dq.transpose(0, 1), fold(dk, k), fold(dv, v)

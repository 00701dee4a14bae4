"""CUDA varlen provider: aten's FlashAttention-2 varlen ops `_flash_attention_forward/_backward` (cu_seqlens).

The kernel behind torch's own `varlen_attn`: packed (T, H, D) q/k/v, native GQA, bottom-right causal per
sequence, LSE (Hq, Tq) fp32, any row strides with a unit last dim (so K/V can be views of the gather buffer).
Block ranges become cu_seqlens (`varlen_ranges`: adjacent, or tiled; device ops, no host sync); the static
`max_q`/`max_k` bounds size the grid (ceil(max/128) tiles x sequences x heads, most of them empty and cheap but
not free: the layouts keep the bounds tight). FA2 leaves rows of no sequence unwritten and writes lse = +inf
for rows whose sequence has no keys: the varlen executor masks both unless a block vouches that every row
sees a key (kernels/base.VarlenAttentionKernel). Backward writes dK/dV for every key of every sequence,
zeros where no row sees it (FA2 zero-fills key blocks its loop over q blocks skips, incl. empty q sides).
`square` (all ranges square) changes nothing here: FA2 varlen has one causal anchor, and on a square range
both anchors are the same mask.
"""

from __future__ import annotations

import torch

from ._cuda import cuda_half_reason, head_dim_reason
from .varlen_ranges import cu_seqlens

_aten = torch.ops.aten


def _window_kwargs(window: tuple[int, int], causal: bool) -> dict:
    """aten's window_size_left/right, only when there is a window (causal alone is is_causal's job)."""
    left, right = window
    if causal:
        right = 0
    return {} if (left, right) in ((-1, -1), (-1, 0)) else {"window_size_left": left, "window_size_right": right}


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class FlashVarlenKernel:
    name = "flash_varlen"
    traceable = True
    """The executor records its calls into the region's graph (executor/varlen.py)."""
    supports_window = True
    """FA2's window_size_left/right on the bottom-right diagonal, the interface's window semantics."""

    def supports(self, device: torch.device, dtype: torch.dtype) -> str | None:
        return cuda_half_reason(device, dtype, "FlashAttention-2 varlen")

    def grad_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype  # aten's FA2 backward writes dq/dk/dv in the input dtype

    def supports_head_dim(self, head_dim: int, v_head_dim: int | None = None) -> str | None:
        return head_dim_reason(head_dim, "FlashAttention-2 varlen", v_head_dim)

    def prepared_count(self, window: tuple[int, int] = (-1, -1), tiled: bool = False, square: bool = False) -> int:
        """How many tensors `prepare` returns (static)."""
        return 2

    def prepare(self, ranges, tq, tk, max_q, window=(-1, -1), tiled=False, square=False) -> list[torch.Tensor]:
        """cu_seqlens q and k (int32): device ops on the ranges, computed once per batch in a region's graph."""
        return list(cu_seqlens(ranges, tiled))

    def forward(
        self, q, k, v, ranges, max_q, max_k, causal, scale, window=(-1, -1), tiled=False, square=False, prepared=None
    ):
        cu_q, cu_k = prepared or cu_seqlens(ranges, tiled)
        out, lse, *_ = _aten._flash_attention_forward(
            _unit_last(q), _unit_last(k), _unit_last(v), cu_q, cu_k, max(max_q, 1), max(max_k, 1),
            0.0, causal, False, scale=scale, **_window_kwargs(window, causal),
        )  # fmt: skip
        return out, lse

    def backward(
        self, dout, q, k, v, out, lse, ranges, max_q, max_k, causal, scale, window=(-1, -1), tiled=False,
        square=False, prepared=None,
    ):  # fmt: skip
        cu_q, cu_k = prepared or cu_seqlens(ranges, tiled)
        rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
        unused = q.new_empty(0)
        return _aten._flash_attention_backward(
            _unit_last(dout), _unit_last(q), _unit_last(k), _unit_last(v), _unit_last(out),
            lse.float().contiguous(), cu_q, cu_k, max(max_q, 1), max(max_k, 1), 0.0, causal, rng, unused,
            scale=scale, **_window_kwargs(window, causal),
        )  # fmt: skip

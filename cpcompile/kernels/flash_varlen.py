"""CUDA varlen provider: aten's FlashAttention-2 varlen ops `_flash_attention_forward/_backward` (cu_seqlens).

The kernel behind torch's own `varlen_attn`: packed (T, H, D) q/k/v, native GQA, bottom-right causal per
sequence, LSE (Hq, Tq) fp32, any row strides with a unit last dim (so K/V can be views of the gather buffer).
Block ranges become adjacent cu_seqlens (`adjacent_cu_seqlens`, device ops, no host sync); the static
`max_q`/`max_k` bounds size the grid (ceil(max/128) tiles x sequences x heads, most of them empty and cheap but
not free: the layouts keep the bounds tight). FA2 leaves rows of no sequence unwritten and writes lse = +inf
for rows whose sequence has no keys: the varlen executor masks both unless a block vouches that every row
sees a key (kernels/base.VarlenAttentionKernel). Backward writes dK/dV for every key of every sequence,
zeros where no row sees it (FA2 zero-fills key blocks its loop over q blocks skips, incl. empty q sides).
"""

from __future__ import annotations

import torch

from ._cuda import cuda_half_reason, head_dim_reason

_aten = torch.ops.aten


def adjacent_cu_seqlens(ranges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_q, cu_k), int32 of length 2B+1: range i, then the gap after it (q gap with k gap) as one sequence.

    Two sequences a range instead of base.ranges_to_cu_seqlens' three (fewer empty tiles in the grid). A gap
    sequence may attend gap rows to gap keys when both are non-empty (cpcompile's layouts never make both);
    that only writes rows and keys outside every range, which the executor masks out of the merge and sums.
    """
    qs, qe, ks, ke = ranges.long()
    cu_q = torch.cat((torch.stack((qs, qe), 1).flatten(), qe[-1:]))
    cu_k = torch.cat((torch.stack((ks, ke), 1).flatten(), ke[-1:]))
    return cu_q.int(), cu_k.int()


def tiled_cu_seqlens(ranges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_q, cu_k), int32 of length B+1, for ranges that tile both buffers (each starts where the previous
    ends, from 0 to the end): the starts plus the last end, no gap sequences (half the grid of the general
    encoding, whose empty gap sequences still launch their tiles)."""
    qs, qe, ks, ke = ranges.long()
    return torch.cat((qs, qe[-1:])).int(), torch.cat((ks, ke[-1:])).int()


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
    supports_window = True
    """FA2's window_size_left/right on the bottom-right diagonal, the interface's window semantics."""

    def supports(self, device: torch.device, dtype: torch.dtype) -> str | None:
        return cuda_half_reason(device, dtype, "FlashAttention-2 varlen")

    def grad_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype  # aten's FA2 backward writes dq/dk/dv in the input dtype

    def supports_head_dim(self, head_dim: int) -> str | None:
        return head_dim_reason(head_dim, "FlashAttention-2 varlen")

    def forward(self, q, k, v, ranges, max_q, max_k, causal, scale, window=(-1, -1), tiled=False):
        cu_q, cu_k = (tiled_cu_seqlens if tiled else adjacent_cu_seqlens)(ranges)
        out, lse, *_ = _aten._flash_attention_forward(
            _unit_last(q), _unit_last(k), _unit_last(v), cu_q, cu_k, max(max_q, 1), max(max_k, 1),
            0.0, causal, False, scale=scale, **_window_kwargs(window, causal),
        )  # fmt: skip
        return out, lse

    def backward(self, dout, q, k, v, out, lse, ranges, max_q, max_k, causal, scale, window=(-1, -1), tiled=False):
        cu_q, cu_k = (tiled_cu_seqlens if tiled else adjacent_cu_seqlens)(ranges)
        rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
        unused = q.new_empty(0)
        return _aten._flash_attention_backward(
            _unit_last(dout), _unit_last(q), _unit_last(k), _unit_last(v), _unit_last(out),
            lse.float().contiguous(), cu_q, cu_k, max(max_q, 1), max(max_k, 1), 0.0, causal, rng, unused,
            scale=scale, **_window_kwargs(window, causal),
        )  # fmt: skip

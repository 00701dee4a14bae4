"""The one interface every attention kernel provider implements.

A provider runs one block: q (B, Hq, Sq, D) against k, v (B, Hkv, Sk, D[v]), either a causal square
(Sq == Sk, top-left aligned) or unmasked. It returns the output and the log-sum-exp of the scaled scores
(B, Hq, Sq) in at least fp32, and its backward takes the FINAL merged output and LSE (ring-attention identity).
"""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionKernel(Protocol):
    name: str

    def supports(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """None when this provider can run on `device`/`dtype`, else the reason it cannot."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) for one block."""

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv) for one block, given the final out and lse of its q rows."""

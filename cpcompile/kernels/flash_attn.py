"""Provider for the `flash-attn` package (FlashAttention-2 >= 2.7 / -3 builds), used only when installed.

Nothing imports the package until a block runs, so its absence is a clean `supports()` reason (and a
CPCompileError at plan time), never an import crash. Not exercised on our machines (neither has the package).
"""

from __future__ import annotations

import torch

from ._cuda import cuda_half_reason, head_dim_reason, missing_package


def _interface():
    from flash_attn import flash_attn_interface

    return flash_attn_interface


class FlashAttnPackageKernel:
    name = "flash_attn"
    supports_window = False
    supports_softcap = False

    def supports(self, device: torch.device, dtype: torch.dtype) -> str | None:
        return missing_package("flash_attn", "flash-attn") or cuda_half_reason(device, dtype, "flash-attn")

    def supports_head_dim(self, head_dim: int, v_head_dim: int | None = None) -> str | None:
        return head_dim_reason(head_dim, "flash-attn", v_head_dim)

    def forward(self, q, k, v, causal, scale):
        # flash-attn takes (B, S, H, D) with a unit last stride: our (B, H, S, D) views transposed.
        res = _interface()._flash_attn_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, scale, causal, -1, -1, 0.0, None, False
        )
        out, lse = res[0], res[1]
        return out.transpose(1, 2), lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        _interface()._flash_attn_backward(
            dout.transpose(1, 2).contiguous(), qt, kt, vt, out.transpose(1, 2).contiguous(), lse.contiguous(),
            dq, dk, dv, 0.0, scale, causal, -1, -1, 0.0, None, False,
        )  # fmt: skip
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

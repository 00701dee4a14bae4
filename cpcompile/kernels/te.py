"""Provider for TransformerEngine's fused attention (cuDNN through TE), used only when TE is installed.

Nothing imports TE until a block runs, so its absence is a clean `supports()` reason (and a CPCompileError
at plan time), never an import crash. Written against TE 2.x `cpp_extensions.fused_attn_fwd/bwd` in the
bshd_bshd_bshd layout; not exercised on our machines (neither has TE). aten's cuDNN provider reaches the
same cuDNN kernels without the dependency.
"""

from __future__ import annotations

import torch

from ._cuda import cuda_half_reason, head_dim_reason, missing_package


def _te():
    import transformer_engine.pytorch.cpp_extensions.fused_attn as fa
    import transformer_engine_torch as tex

    return fa, tex


def _cu_seqlens(batch: int, length: int, device) -> torch.Tensor:
    return torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device)


class TransformerEngineKernel:
    name = "te"
    supports_window = False
    supports_softcap = False

    def supports(self, device: torch.device, dtype: torch.dtype) -> str | None:
        return missing_package("transformer_engine", "transformer-engine[pytorch]") or cuda_half_reason(
            device, dtype, "TransformerEngine fused attention"
        )

    def supports_head_dim(self, head_dim: int, v_head_dim: int | None = None) -> str | None:
        return head_dim_reason(head_dim, "TransformerEngine fused attention", v_head_dim)

    def _common(self, q, k, causal, scale):
        fa, tex = _te()
        b, sq, sk = q.shape[0], q.shape[-2], k.shape[-2]
        return (
            fa,
            tex,
            dict(
                max_seqlen_q=sq,
                max_seqlen_kv=sk,
                cu_seqlens_q=_cu_seqlens(b, sq, q.device),
                cu_seqlens_kv=_cu_seqlens(b, sk, q.device),
                mask="causal" if causal else "no_mask",
                scale=scale,
            ),
        )

    def forward(self, q, k, v, causal, scale):
        fa, tex, c = self._common(q, k, causal, scale)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        out, aux = fa.fused_attn_fwd(
            True, c["max_seqlen_q"], c["max_seqlen_kv"], c["cu_seqlens_q"], c["cu_seqlens_kv"], qt, kt, vt,
            q.dtype, tex.NVTE_Fused_Attn_Backend.NVTE_F16_arbitrary_seqlen, attn_scale=scale,
            qkv_layout="bshd_bshd_bshd", attn_mask_type=c["mask"],
        )  # fmt: skip
        return out.transpose(1, 2), aux[0].squeeze(-1)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        fa, tex, c = self._common(q, k, causal, scale)
        qt, kt, vt, ot, dot = (t.transpose(1, 2) for t in (q, k, v, out, dout))
        rng = torch.zeros(2, dtype=torch.int64, device=q.device)
        dq, dk, dv, *_ = fa.fused_attn_bwd(
            c["max_seqlen_q"], c["max_seqlen_kv"], c["cu_seqlens_q"], c["cu_seqlens_kv"], qt, kt, vt, ot, dot,
            q.dtype, q.dtype, [lse.contiguous().unsqueeze(-1), rng],
            tex.NVTE_Fused_Attn_Backend.NVTE_F16_arbitrary_seqlen, attn_scale=scale,
            qkv_layout="bshd_bshd_bshd", attn_mask_type=c["mask"],
        )  # fmt: skip
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

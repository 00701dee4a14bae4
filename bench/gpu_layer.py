"""The GPU check's model: one attention layer as users compile it (q/k/v projections, attention, o projection),
dense (SDPA, causal GQA) or packed (varlen_attn over documents, causal), and the pieces the check runs on it:
the compute time of one CP rank on a fake process group, and fwd+bwd parity on gloo ranks sharing the GPU.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

import cpcompile
from cpcompile.testing.varlen_model import GQA, attend_per_document

PACKED = ("thd", "thd_zigzag", "thd_balanced")


@dataclasses.dataclass(frozen=True)
class LayerShape:
    hidden: int = 4096
    hq: int = 32
    hkv: int = 8
    head_dim: int = 128


LLAMA3_8B = LayerShape()
SMALL = LayerShape(hidden=256, hq=8, hkv=2, head_dim=64)


def varlen(q, k, v, cu, longest):
    """Causal varlen_attn as a model calls it (GQA switch only where torch has one: cpcompile.testing's GQA)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu, cu, longest, longest, window_size=(-1, 0), **GQA)


class AttentionLayer(nn.Module):
    """x (B, S, hidden) -> attention -> (B, S, hidden); packed: x (T, hidden) with the GLOBAL cu_seqlens.
    `per_document`: packed attention as SDPA document by document (the fp64 reference: varlen_attn has no fp64)."""

    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        h, d = shape.hidden, shape.head_dim
        self.shape = shape
        self.wq = nn.Linear(h, shape.hq * d, bias=False)
        self.wk = nn.Linear(h, shape.hkv * d, bias=False)
        self.wv = nn.Linear(h, shape.hkv * d, bias=False)
        self.wo = nn.Linear(shape.hq * d, h, bias=False)
        self.per_document = False

    def forward(self, x: torch.Tensor, cu: torch.Tensor | None = None, longest: int = 0) -> torch.Tensor:
        sh = self.shape
        if cu is not None:
            t = x.shape[0]
            q, k, v = (
                w(x).view(t, n, sh.head_dim) for w, n in ((self.wq, sh.hq), (self.wk, sh.hkv), (self.wv, sh.hkv))
            )
            a = attend_per_document(q, k, v, cu, True) if self.per_document else varlen(q, k, v, cu, longest)
            return self.wo(a.reshape(t, sh.hq * sh.head_dim))
        b, s, _ = x.shape
        q, k, v = (
            w(x).view(b, s, n, sh.head_dim).transpose(1, 2)
            for w, n in ((self.wq, sh.hq), (self.wk, sh.hkv), (self.wv, sh.hkv))
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=sh.hq != sh.hkv)
        return self.wo(a.transpose(1, 2).reshape(b, s, sh.hq * sh.head_dim))


def build(shape: LayerShape, dtype: torch.dtype, seed: int = 0, device: str = "cuda") -> AttentionLayer:
    torch.manual_seed(seed)
    layer = AttentionLayer(shape).to(device, dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 1 / math.sqrt(p.shape[1]))
    return layer


def documents(total: int, seed: int, unit: int) -> list[int]:
    """Log-normal document lengths (median ~total/8, multiples of `unit`) filling `total` tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths, left = [], total
    while left:
        n = math.exp(math.log(max(unit, total // 8)) + torch.randn(1, generator=g).item())
        n = min(left, max(unit, int(n) // unit * unit))
        lengths.append(n)
        left -= n
    return lengths


def cu_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def layer_inputs(layout: str, x: torch.Tensor, cu: torch.Tensor | None, group=None) -> tuple:
    """(this rank's x, the model's cu_seqlens or None, longest document) for `layout` on `group` (default group)."""
    if layout not in PACKED:
        return cpcompile.shard(x, strategy=layout, seq_dim=1, group=group), None, 0
    model_cu = cpcompile.plan_documents(cu, strategy=layout, group=group)
    local = cpcompile.shard(x, strategy=layout, seq_dim=0, cu_seqlens=model_cu, group=group)
    return local, model_cu.to(x.device), int((cu[1:] - cu[:-1]).max())


def unshard_out(layout: str, out: torch.Tensor, cu: torch.Tensor | None, group=None) -> torch.Tensor:
    if layout not in PACKED:
        return cpcompile.unshard(out, strategy=layout, seq_dim=1, group=group)
    model_cu = cpcompile.plan_documents(cu, strategy=layout, group=group)
    return cpcompile.unshard(out, strategy=layout, seq_dim=0, cu_seqlens=model_cu, group=group)

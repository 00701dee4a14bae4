"""A small Llama-style model over packed documents: attention is torch.nn.attention.varlen.varlen_attn.

Inputs are packed (T,) token ids, per-document position ids and the GLOBAL cu_seqlens. `per_document_sdpa`
swaps varlen_attn (which has no CPU kernel) for SDPA run document by document: the single-process reference.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn

from .model import TinyConfig, rope, run_block

GQA = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}
"""varlen_attn's GQA switch where it has one (torch 2.13); torch 2.11's varlen_attn follows the head counts."""


class VarlenAttention(nn.Module):
    def __init__(self, cfg: TinyConfig, causal: bool, max_len: int):
        super().__init__()
        self.cfg, self.causal, self.max_len = cfg, causal, max_len
        self.head_dim = cfg.dim // cfg.heads
        self.q = nn.Linear(cfg.dim, cfg.heads * self.head_dim, bias=False)
        self.kv = nn.Linear(cfg.dim, 2 * cfg.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)
        self.per_document_sdpa = False

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q = self.q(x).view(t, self.cfg.heads, self.head_dim)
        k, v = self.kv(x).view(t, 2, self.cfg.kv_heads, self.head_dim).unbind(1)
        pos = position_ids[None]
        q = rope(q.transpose(0, 1)[None], pos, self.cfg.rope_base)[0].transpose(0, 1)
        k = rope(k.transpose(0, 1)[None], pos, self.cfg.rope_base)[0].transpose(0, 1)
        if self.per_document_sdpa:
            out = attend_per_document(q, k, v, cu_seqlens, self.causal)
        else:
            window = (-1, 0) if self.causal else (-1, -1)
            out = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, self.max_len, self.max_len, window_size=window, **GQA)
        return self.o(out.reshape(t, -1))


def attend_per_document(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, causal: bool
) -> torch.Tensor:
    """varlen_attn's result from SDPA document by document: any device and dtype (varlen_attn: CUDA fp16/bf16)."""
    bounds = cu_seqlens.tolist()
    outs = [
        F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), is_causal=causal, enable_gqa=True
        ).transpose(0, 1)
        for a, b in zip(bounds, bounds[1:])
        if b > a
    ]
    return torch.cat(outs)


class VarlenBlock(nn.Module):
    def __init__(self, cfg: TinyConfig, causal: bool, max_len: int):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(cfg.dim), nn.RMSNorm(cfg.dim)
        self.attn = VarlenAttention(cfg, causal, max_len)
        self.up = nn.Linear(cfg.dim, 2 * cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x, position_ids, cu_seqlens):
        x = x + self.attn(self.norm1(x), position_ids, cu_seqlens)
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class VarlenTinyLlama(nn.Module):
    """TinyLlama over packed documents. `max_len` is passed to varlen_attn as max_q/max_k: keep it a constant
    bound (not the batch's longest document), or every new value recompiles."""

    def __init__(self, cfg: TinyConfig | None = None, causal: bool = True, max_len: int = 4096):
        super().__init__()
        self.cfg = cfg or TinyConfig()
        self.embed = nn.Embedding(self.cfg.vocab, self.cfg.dim)
        self.blocks = nn.ModuleList(VarlenBlock(self.cfg, causal, max_len) for _ in range(self.cfg.layers))
        self.norm = nn.RMSNorm(self.cfg.dim)
        self.head = nn.Linear(self.cfg.dim, self.cfg.vocab, bias=False)

    def use_per_document_sdpa(self, on: bool = True) -> VarlenTinyLlama:
        for block in self.blocks:
            block.attn.per_document_sdpa = on
        return self

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = run_block(self.cfg, block, x, position_ids, cu_seqlens)
        return self.head(self.norm(x))


def document_position_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-token position inside its document (RoPE restarts at every document)."""
    total = int(cu_seqlens[-1])
    tokens = torch.arange(total)
    doc = torch.searchsorted(cu_seqlens.long(), tokens, right=True) - 1
    return tokens - cu_seqlens.long()[doc]

"""A small Llama-style transformer (RMSNorm, RoPE from position_ids, GQA, SwiGLU) calling SDPA.

Everything but attention is token-wise, so with sharded input_ids and position_ids it runs unchanged under CP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class TinyConfig:
    vocab: int = 128
    dim: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    hidden: int = 128
    rope_base: float = 10000.0
    checkpoint: str | None = None
    """Activation checkpointing of every block: None, "non_reentrant" or "reentrant" (torch.utils.checkpoint)."""


def run_block(cfg: TinyConfig, block: nn.Module, *args: torch.Tensor) -> torch.Tensor:
    """block(*args), under torch.utils.checkpoint when cfg.checkpoint asks for it."""
    if cfg.checkpoint is None:
        return block(*args)
    if cfg.checkpoint not in ("non_reentrant", "reentrant"):
        raise ValueError(f"TinyConfig.checkpoint must be None, 'non_reentrant' or 'reentrant', not {cfg.checkpoint!r}")
    return checkpoint(block, *args, use_reentrant=cfg.checkpoint == "reentrant")


def rope(x: torch.Tensor, position_ids: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary embedding of x (B, H, S, D) at the given (B, S) positions."""
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = position_ids[:, None, :, None].float() * inv  # (B, 1, S, D/2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.cfg = cfg
        self.head_dim = cfg.dim // cfg.heads
        self.q = nn.Linear(cfg.dim, cfg.heads * self.head_dim, bias=False)
        self.kv = nn.Linear(cfg.dim, 2 * cfg.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.cfg.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.cfg.kv_heads, self.head_dim).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        q, k = rope(q, position_ids, self.cfg.rope_base), rope(k, position_ids, self.cfg.rope_base)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.cfg.heads != self.cfg.kv_heads)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(cfg.dim), nn.RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.up = nn.Linear(cfg.dim, 2 * cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x, position_ids):
        x = x + self.attn(self.norm1(x), position_ids)
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class TinyLlama(nn.Module):
    def __init__(self, cfg: TinyConfig | None = None):
        super().__init__()
        self.cfg = cfg or TinyConfig()
        self.embed = nn.Embedding(self.cfg.vocab, self.cfg.dim)
        self.blocks = nn.ModuleList(Block(self.cfg) for _ in range(self.cfg.layers))
        self.norm = nn.RMSNorm(self.cfg.dim)
        self.head = nn.Linear(self.cfg.dim, self.cfg.vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = run_block(self.cfg, block, x, position_ids)
        return self.head(self.norm(x))


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over this rank's tokens (labels already shifted; -100 ignored)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")

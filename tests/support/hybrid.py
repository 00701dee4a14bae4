"""A tiny hybrid model for the token-mixer tests: blocks of a depthwise causal conv plus a chunked gated linear
recurrence (pure torch, per head, a Python loop over chunks), and a softmax attention block (SDPA), both declared
mixers with cpcompile.token_mixer. Every head count comes from the inputs' shapes, as the declaration asks."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import cpcompile


class CausalConv(nn.Module):
    """HF's causal_conv1d torch fallback: a depthwise conv over tokens, (B, L, C) -> (B, L, C), channel-local."""

    def __init__(self, channels: int, kernel: int = 4) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(channels, 1, kernel) * 0.4)
        self.bias = nn.Parameter(torch.randn(channels) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        y = F.conv1d(x.transpose(1, 2), self.weight, self.bias, padding=self.weight.shape[-1] - 1, groups=x.shape[-1])
        return F.silu(y[..., :n]).transpose(1, 2)


class GatedRecurrence(nn.Module):
    """Chunked gated linear attention per head (a scalar decay a token, like Mamba2's SSD or GLA):
    o_t = sum_{s<=t} exp(G_t - G_s) (q_t . k_s) v_s, G the running sum of log decays; chunk by chunk, the
    state S (B, H, Dk, Dv) carried between chunks. q/k/v (B, L, H, D), a (B, L, H) decay logits; A_log (H,) a
    per-head rate (split with the heads), norm (Dv,) shared by every head (not split)."""

    def __init__(self, heads: int, head_dim: int, chunk: int = 4) -> None:
        super().__init__()
        self.chunk = chunk
        self.A_log = nn.Parameter(torch.randn(heads) * 0.3)
        self.norm = nn.Parameter(1 + 0.1 * torch.randn(head_dim))

    def forward(self, q, k, v, a):
        b, n, h, d = q.shape
        logg = -F.softplus(a) * self.A_log.exp()  # (B, L, H), <= 0
        q, k, v, logg = (t.transpose(1, 2) for t in (q, k, v, logg))  # heads first
        state = q.new_zeros(b, h, d, v.shape[-1])
        outs = []
        for c0 in range(0, n, self.chunk):
            qc, kc, vc = (t[:, :, c0 : c0 + self.chunk] for t in (q, k, v))
            g = logg[:, :, c0 : c0 + self.chunk].cumsum(-1)  # (B, H, C)
            c = g.shape[-1]
            decay = (g[..., :, None] - g[..., None, :]).masked_fill(
                ~torch.ones(c, c, dtype=torch.bool, device=q.device).tril(), float("-inf")
            )
            intra = (qc @ kc.transpose(-1, -2)) * decay.exp()
            outs.append(intra @ vc + (qc * g[..., None].exp()) @ state)
            last = g[..., -1:]
            state = state * last[..., None].exp() + (kc * (last - g)[..., None].exp()).transpose(-1, -2) @ vc
        o = torch.cat(outs, dim=2).transpose(1, 2)  # (B, L, H, Dv)
        return o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm


class MixerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.in_proj = nn.Linear(dim, 3 * heads * head_dim + heads)
        self.conv = cpcompile.token_mixer(CausalConv(3 * heads * head_dim), heads_dim=2)
        self.scan = cpcompile.token_mixer(GatedRecurrence(heads, head_dim), heads_dim=2)
        self.out_proj = nn.Linear(heads * head_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        h, d = self.heads, self.head_dim
        qkv, a = self.in_proj(x).split([3 * h * d, h], dim=-1)
        q, k, v = self.conv(qkv).view(b, n, 3, h, d).unbind(2)
        return x + self.out_proj(self.scan(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, a).flatten(2))


class AttentionBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, dim = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(o.transpose(1, 2).reshape(b, n, dim))


class HybridModel(nn.Module):
    """embed -> mixer block -> attention block -> mixer block -> head: (B, L) ids -> (B, L, vocab) logits."""

    def __init__(self, vocab: int = 32, dim: int = 32, heads: int = 4, head_dim: int = 8, attn_heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            [MixerBlock(dim, heads, head_dim), AttentionBlock(dim, attn_heads), MixerBlock(dim, heads, head_dim)]
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

"""A tiny Gated DeltaNet model for the state-passing tests: a causal depthwise conv (a halo mixer) and the gated
delta rule (a linear recurrence in flash-linear-attention's convention, initial_state / output_final_state), both
declared with cpcompile.token_mixer(comm=...), around a softmax attention block. The recurrence is a per-token
reference in the inputs' dtype (fp64 models: fp64 throughout, unlike HF's fallback, which computes in fp32)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import cpcompile
from tests.support.hybrid import AttentionBlock, CausalConv


def gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False):
    """Per token: S = exp(g) S; S += beta k (v - k^T S); o = q^T S. q/k (B, L, H, Dk), v (B, L, H, Dv), g (log
    decay) and beta (B, L, H); the state (B, H, Dk, Dv). Returns (o (B, L, H, Dv), final state or None)."""
    b, n, h, dk = key.shape
    state = query.new_zeros(b, h, dk, value.shape[-1]) if initial_state is None else initial_state.to(query.dtype)
    outs = []
    for t in range(n):
        q, k, v = query[:, t], key[:, t], value[:, t]
        state = state * g[:, t].exp()[..., None, None]
        err = v - (k.unsqueeze(-1) * state).sum(-2)  # (B, H, Dv): what the state does not predict yet
        state = state + k.unsqueeze(-1) * (beta[:, t, :, None] * err).unsqueeze(-2)
        outs.append((q.unsqueeze(-1) * state).sum(-2))
    return torch.stack(outs, dim=1), state if output_final_state else None


class GDNLayer(nn.Module):
    """in_proj -> causal conv (SiLU) over q/k/v -> gated delta rule -> out_proj, residual. `comm`: the mixers'."""

    def __init__(self, dim: int, heads: int, key_dim: int, value_dim: int, kernel: int = 4, comm: str = "state"):
        super().__init__()
        self.heads, self.key_dim, self.value_dim = heads, key_dim, value_dim
        width = heads * (2 * key_dim + value_dim)
        self.in_proj = nn.Linear(dim, width + 2 * heads)
        state = comm == "state"
        conv = CausalConv(width, kernel)
        context = (lambda w: w["weight"].shape[-1] - 1) if state else None
        self.conv = cpcompile.token_mixer(conv, heads_dim=2, comm=comm, context=context)
        self.scan = cpcompile.token_mixer(gated_delta_rule, heads_dim=2, comm=comm, state=state or None)
        self.A_log = nn.Parameter(torch.randn(heads) * 0.3)
        self.dt_bias = nn.Parameter(torch.randn(heads) * 0.1)
        self.out_proj = nn.Linear(heads * value_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        h, dk, dv = self.heads, self.key_dim, self.value_dim
        qkv, ba = self.in_proj(x).split([h * (2 * dk + dv), 2 * h], dim=-1)
        q, k, v = self.conv(qkv).split([h * dk, h * dk, h * dv], dim=-1)
        q, k = (F.normalize(t.reshape(b, n, h, dk), dim=-1) for t in (q, k))
        bb, a = ba.chunk(2, dim=-1)
        g = -self.A_log.exp() * F.softplus(a + self.dt_bias)
        o, _ = self.scan(q, k, v.reshape(b, n, h, dv), g, bb.sigmoid())
        return x + self.out_proj(o.flatten(2))


class GDNModel(nn.Module):
    """embed -> GDN layer -> attention block -> GDN layer -> head: (B, L) ids -> (B, L, vocab) logits."""

    def __init__(self, vocab: int = 32, dim: int = 32, heads: int = 2, key_dim: int = 8, value_dim: int = 6,
                 comm: str = "state") -> None:  # fmt: skip
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            [GDNLayer(dim, heads, key_dim, value_dim, comm=comm), AttentionBlock(dim, 4),
             GDNLayer(dim, heads, key_dim, value_dim, comm=comm)]
        )  # fmt: skip
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

"""A tiny Gated DeltaNet model for the state-passing tests: a causal depthwise conv (a halo mixer) and the gated
delta rule (a linear recurrence in flash-linear-attention's convention, initial_state / output_final_state), both
declared with cpcompile.token_mixer(comm=...), around a softmax attention block. The recurrence is a per-token
reference in the inputs' dtype (fp64 models: fp64 throughout, unlike HF's fallback, which computes in fp32)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import cpcompile
from cpcompile.testing.varlen_model import GQA, attend_per_document, varlen_attn
from tests.support.hybrid import AttentionBlock, CausalConv


def gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Per token: S = exp(g) S; S += beta k (v - k^T S); o = q^T S. q/k (B, L, H, Dk), v (B, L, H, Dv), g (log
    decay) and beta (B, L, H); the state (B, H, Dk, Dv). Returns (o (B, L, H, Dv), final state or None).
    `cu_seqlens` (fla's convention): batch 1, packed documents at these offsets, one initial and final state a
    document ((documents, H, Dk, Dv)): the state restarts from the document's own initial state at its first token
    (`packed_gated_delta_rule`)."""
    if cu_seqlens is not None:
        return packed_gated_delta_rule(query, key, value, g, beta, initial_state, output_final_state, cu_seqlens)
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


def document_index(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """(n,) int64: the document of each of the n tokens (the last of equal offsets: empty documents hold none)."""
    cu = cu_seqlens.long()
    return (torch.searchsorted(cu, torch.arange(n, device=cu.device), right=True) - 1).clamp(0, cu.numel() - 2)


def _step(state, q, k, v, g, beta):
    """One token of the gated delta rule on (H, Dk, Dv) state: (new state, output (H, Dv))."""
    state = state * g.exp()[..., None, None]
    err = v - (k.unsqueeze(-1) * state).sum(-2)
    state = state + k.unsqueeze(-1) * (beta[:, None] * err).unsqueeze(-2)
    return state, (q.unsqueeze(-1) * state).sum(-2)


def packed_gated_delta_rule(query, key, value, g, beta, initial_state, output_final_state, cu_seqlens):
    """gated_delta_rule over packed documents (batch 1), traceable (tensor offsets, no host sync; empty
    documents allowed: their final state is their initial one)."""
    _, n, h, dk = key.shape
    cu = cu_seqlens.long()
    docs = cu.numel() - 1
    init = query.new_zeros(docs, h, dk, value.shape[-1]) if initial_state is None else initial_state.to(query.dtype)
    doc = document_index(cu, n)
    pos = torch.arange(n, device=cu.device)
    starts, ends = cu[doc] == pos, cu[doc + 1] == pos + 1
    which = torch.arange(docs, device=cu.device)
    firsts = init.index_select(0, doc)  # (n, H, Dk, Dv): each token's document's initial state
    state, finals, outs = init[0], init, []
    for t in range(n):
        state = torch.where(starts[t], firsts[t], state)
        state, o = _step(state, query[0, t], key[0, t], value[0, t], g[0, t], beta[0, t])
        outs.append(o)
        finals = torch.where(((which == doc[t]) & ends[t])[:, None, None, None], state, finals)
    return torch.stack(outs)[None], finals if output_final_state else None


class PackedCausalConv(CausalConv):
    """CausalConv that also takes packed documents (batch 1, fla's `cu_seqlens`): an output reads only earlier
    tokens of its own document (the taps that reach into an earlier document read zeros)."""

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        if cu_seqlens is None:
            return super().forward(x)
        n, kernel = x.shape[1], self.weight.shape[-1]
        doc = document_index(cu_seqlens, n)
        y = self.bias.expand_as(x)
        for s in range(kernel):  # the tap reading token t - s
            earlier = F.pad(x, (0, 0, s, 0))[:, :n]
            same = (F.pad(doc, (s, 0), value=-1)[:n] == doc).to(x.dtype)
            y = y + earlier * same[None, :, None] * self.weight[:, 0, kernel - 1 - s]
        return F.silu(y)


class GDNLayer(nn.Module):
    """in_proj -> causal conv (SiLU) over q/k/v -> gated delta rule -> out_proj, residual. `comm`: the mixers'."""

    def __init__(
        self, dim: int, heads: int, key_dim: int, value_dim: int, kernel: int = 4, comm: str = "state",
        documents: bool = False,
    ):  # fmt: skip
        super().__init__()
        self.heads, self.key_dim, self.value_dim = heads, key_dim, value_dim
        width = heads * (2 * key_dim + value_dim)
        self.in_proj = nn.Linear(dim, width + 2 * heads)
        state = comm == "state"
        conv = PackedCausalConv(width, kernel) if documents else CausalConv(width, kernel)
        context = (lambda w: w["weight"].shape[-1] - 1) if state else None
        docs = {"documents": "cu_seqlens"} if documents else {}
        self.conv = cpcompile.token_mixer(conv, heads_dim=2, comm=comm, context=context, **docs)
        self.scan = cpcompile.token_mixer(gated_delta_rule, heads_dim=2, comm=comm, state=state or None, **docs)
        self.A_log = nn.Parameter(torch.randn(heads) * 0.3)
        self.dt_bias = nn.Parameter(torch.randn(heads) * 0.1)
        self.out_proj = nn.Linear(heads * value_dim, dim)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        h, dk, dv = self.heads, self.key_dim, self.value_dim
        docs = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        qkv, ba = self.in_proj(x).split([h * (2 * dk + dv), 2 * h], dim=-1)
        q, k, v = self.conv(qkv, **docs).split([h * dk, h * dk, h * dv], dim=-1)
        q, k = (F.normalize(t.reshape(b, n, h, dk), dim=-1) for t in (q, k))
        bb, a = ba.chunk(2, dim=-1)
        g = -self.A_log.exp() * F.softplus(a + self.dt_bias)
        o, _ = self.scan(q, k, v.reshape(b, n, h, dv), g, bb.sigmoid(), **docs)
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


class PackedAttention(nn.Module):
    """Causal softmax attention over packed documents (T, dim): varlen_attn under CP (strategy "thd"), SDPA
    document by document in the one-process reference (`per_document`: varlen_attn has no CPU kernel)."""

    def __init__(self, dim: int, heads: int, max_len: int) -> None:
        super().__init__()
        self.heads, self.max_len, self.per_document = heads, max_len, False
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        t, dim = x.shape
        q, k, v = self.qkv(x).view(t, 3, self.heads, dim // self.heads).unbind(1)
        if self.per_document:
            o = attend_per_document(q, k, v, cu_seqlens, True)
        else:
            o = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, self.max_len, self.max_len, window_size=(-1, 0), **GQA)
        return x + self.out(o.reshape(t, dim))


class PackedGDNModel(nn.Module):
    """GDNModel over packed documents: (T,) ids and the GLOBAL cu_seqlens -> (T, vocab) logits; the GDN layers'
    conv and scan take the documents (token_mixer(documents="cu_seqlens")), the attention is varlen."""

    def __init__(self, max_len: int, vocab: int = 32, dim: int = 32, heads: int = 2, key_dim: int = 8,
                 value_dim: int = 6) -> None:  # fmt: skip
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.gdn1 = GDNLayer(dim, heads, key_dim, value_dim, documents=True)
        self.attn = PackedAttention(dim, 4, max_len)
        self.gdn2 = GDNLayer(dim, heads, key_dim, value_dim, documents=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        x = self.gdn1(self.embed(ids)[None], cu_seqlens)[0]
        x = self.attn(x, cu_seqlens)
        return self.head(self.gdn2(x[None], cu_seqlens)[0])

"""The heads<->tokens exchange of comm="a2a" (Ulysses): q, k and v in ONE all-to-all, the output back in another.

Rank j receives the q heads it owns (layouts.heads.HeadSplit) plus the k/v heads those read, for every rank's
tokens, packed side by side per token, so the executor reads q, k and v as strided views of the received
buffer. GQA with fewer kv heads than ranks replicates each kv head for the ranks that read it, never all heads.
The dense (regions/a2a.py) and packed (regions/a2a_varlen.py) regions share these helpers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...comm.collectives import exchange_first
from ...layouts.heads import HeadSplit
from ...precision import acc_dtype


class _ReplicateHeads(torch.autograd.Function):
    """Repeat each head `replicas` times along dim 1 (GQA with kv_heads < cp: one copy per rank that reads it).

    The copies' gradients come back from different ranks; they are summed in the accumulation dtype (fp32 for
    bf16), rounding once, as the all-gather region's reduce-scatter does.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, replicas: int) -> torch.Tensor:
        ctx.replicas = replicas
        return x.repeat_interleave(replicas, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        summed = grad.unflatten(1, (-1, ctx.replicas)).sum(2, dtype=acc_dtype(grad.dtype))
        return summed.to(grad.dtype), None


def _heads_to_ranks(x: torch.Tensor, world: int) -> torch.Tensor:
    """(B, world*h, n, D) -> (world, n, B, h*D): block j holds rank j's heads, token-major."""
    b, heads, n, d = x.shape
    return x.unflatten(1, (world, heads // world)).permute(1, 3, 0, 2, 4).reshape(world, n, b, heads // world * d)


def thd_as_bhsd(x: torch.Tensor) -> torch.Tensor:
    """Packed (T, H, D) -> a (1, H, T, D) view, the layout these helpers take."""
    return x.transpose(0, 1).unsqueeze(0)


def tokens_as_thd(x: torch.Tensor, heads: int) -> torch.Tensor:
    """A received token-major (T, 1, heads*D) buffer -> a (T, heads, D) view (no copy)."""
    return x.squeeze(1).unflatten(-1, (heads, -1))


def send_lse_back(lse: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    """(h, world*n) lse of every token of this rank's heads -> (world*h, n): every head's lse of this rank's n
    tokens, heads rank-major (one small all-to-all; the lse is not differentiable)."""
    return exchange_first(lse.detach().unflatten(1, (world, -1)).transpose(0, 1), group_name).flatten(0, 1)


def tokens_to_bhsd(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(S, B, heads*D) token-major -> a (B, heads, S, D) view (no copy)."""
    return x.unflatten(-1, (heads, -1)).permute(1, 2, 0, 3)


def replicate_kv(k: torch.Tensor, v: torch.Tensor, split: HeadSplit) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, Hkv, n, D) k/v with each head repeated for the ranks that read it (GQA with Hkv < cp)."""
    if split.kv_replicas == 1:
        return k, v
    return _ReplicateHeads.apply(k, split.kv_replicas), _ReplicateHeads.apply(v, split.kv_replicas)


def send_heads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    split: HeadSplit,
    group_name: str,
    arrange: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """ONE all-to-all of (B, H, n, D) q/k/v (k/v already replicated): each rank gets its heads of every
    rank's n tokens, returned as token-major (cp*n, B, h*D) views of the received buffer (rank-major; `arrange`:
    of that buffer with its tokens rearranged, e.g. into global order)."""
    widths = [split.q_per_rank * q.shape[-1], split.kv_per_rank * k.shape[-1], split.kv_per_rank * v.shape[-1]]
    parts = [_heads_to_ranks(t, split.cp) for t in (q, k, v)]
    tokens = exchange_first(torch.cat(parts, dim=-1), group_name).flatten(0, 1)  # (cp*n, B, W)
    if arrange is not None:
        tokens = arrange(tokens)
    return tokens.split(widths, dim=-1)


def send_tokens_back(out: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    """All-to-all of a token-major (world*n, B, h, Dv) output: (world, n, B, h*Dv), block j = rank j's heads."""
    tokens, b, h, dv = out.shape
    return exchange_first(out.reshape(world, tokens // world, b, h * dv), group_name)


def heads_to_bshd(heads: torch.Tensor, q_heads: int) -> torch.Tensor:
    """(world, n, B, h*Dv) received outputs -> (B, n, q_heads, Dv) memory: the one copy of the output."""
    world, n, b, width = heads.shape
    return heads.permute(2, 1, 0, 3).reshape(b, n, q_heads, world * width // q_heads)

"""Attention's heads<->tokens exchange under comm="a2a" (Ulysses): q, k and v in ONE all-to-all, the output back
in another; `DenseHeads` and `PackedHeads` are the exchanges head_parallel.py runs the attention regions through.

Rank j receives the q heads it owns (layouts.heads.HeadSplit) plus the k/v heads those read, for every rank's
tokens, packed side by side per token, so the executor reads q, k and v as strided views of the received
buffer. GQA with fewer kv heads than ranks replicates each kv head for the ranks that read it, never all heads.
The a2a regions (dense.py, varlen.py, flex.py) and the hierarchical ones share these helpers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from ...comm.collectives import exchange_first
from ...layouts.heads import HeadSplit
from ...precision import acc_dtype
from .head_parallel import exchange_side_by_side


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
    parts = [_heads_to_ranks(t, split.cp) for t in (q, k, v)]  # (cp, n, B, h*D): widths h*D for q, k, v

    def tokens(received: torch.Tensor) -> torch.Tensor:
        flat = received.flatten(0, 1)  # (cp*n, B, W)
        return flat if arrange is None else arrange(flat)

    return tuple(exchange_side_by_side(parts, group_name, tokens))


def send_tokens_back(out: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    """All-to-all of a token-major (world*n, B, h, Dv) output: (world, n, B, h*Dv), block j = rank j's heads."""
    tokens, b, h, dv = out.shape
    return exchange_first(out.reshape(world, tokens // world, b, h * dv), group_name)


def heads_to_bshd(heads: torch.Tensor, q_heads: int) -> torch.Tensor:
    """(world, n, B, h*Dv) received outputs -> (B, n, q_heads, Dv) memory: the one copy of the output."""
    world, n, b, width = heads.shape
    return heads.permute(2, 1, 0, 3).reshape(b, n, q_heads, world * width // q_heads)


@dataclass(frozen=True)
class DenseHeads:
    """The dense attention exchange (head_parallel.HeadExchange): (B, H, L, D) q/k/v, k/v already replicated
    (replicate_kv), in ONE all-to-all per group of local slots (`slots`, schedule.exchange_slots, of `chunk`
    tokens each), each received buffer a (B, h, cp*n, D) view, rank-major. `to_heads` returns
    [q_0, k_0, v_0, q_1, ...] a group; `to_tokens` sends each (B, h, cp*n, Dv) output back as it comes and lands
    them in (B, q_heads, L, Dv), q's layout."""

    split: HeadSplit
    group_name: str
    q_heads: int
    slots: tuple[tuple[int, ...], ...]
    chunk: int

    def to_heads(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        split, received = self.split, []
        for slots in self.slots:
            start, length = slots[0] * self.chunk, len(slots) * self.chunk
            rows = (t if length == t.shape[-2] else t.narrow(-2, start, length) for t in inputs)
            q_b, k_b, v_b = send_heads(*rows, split, self.group_name)
            received += [
                tokens_to_bhsd(q_b, split.q_per_rank),
                tokens_to_bhsd(k_b, split.kv_per_rank),
                tokens_to_bhsd(v_b, split.kv_per_rank),
            ]
        return received

    def to_tokens(self, outputs: Iterable[torch.Tensor]) -> torch.Tensor:
        back = [send_tokens_back(out.permute(2, 0, 1, 3), self.split.cp, self.group_name) for out in outputs]
        heads = torch.cat(back, dim=1) if len(back) > 1 else back[0]  # (cp, L, B, h*Dv): block j = rank j's heads
        return heads_to_bshd(heads, self.q_heads).transpose(1, 2)


@dataclass(frozen=True)
class PackedHeads:
    """The packed-document attention exchange (head_parallel.HeadExchange): (1, H, T, D) views of thd q/k/v
    (thd_as_bhsd; k/v already replicated) in ONE all-to-all, received as token-major (cp*T, 1, h*D) buffers,
    rank-major; `to_tokens` takes (out (cp*T, h, Dv), lse (h, cp*T)) and returns this rank's (T, q_heads, Dv) and,
    when `return_lse`, its (q_heads, T) lse by one more small all-to-all (else None)."""

    split: HeadSplit
    group_name: str
    q_heads: int
    return_lse: bool

    def to_heads(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return list(send_heads(*inputs, self.split, self.group_name))

    def to_tokens(self, outputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, lse = outputs
        heads = send_tokens_back(out.unsqueeze(1), self.split.cp, self.group_name)  # (cp, T, 1, h*Dv)
        out_local = heads_to_bshd(heads, self.q_heads)[0]
        lse_local = send_lse_back(lse, self.split.cp, self.group_name) if self.return_lse else None
        return out_local, lse_local

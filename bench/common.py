"""Shared pieces of the GPU benchmarks: the Llama3-8B attention shape, rank inputs, CUDA-event timing."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

HQ, HKV, D = 32, 8, 128  # Llama3-8B attention
DTYPE = torch.bfloat16


def bshd(b: int, s: int, h: int, d: int = D, device="cuda") -> torch.Tensor:
    """A (B, H, S, D) tensor stored as (B, S, H, D), as a model's q/k/v projections give it (random, not zeros)."""
    return torch.randn(b, s, h, d, device=device, dtype=DTYPE).transpose(1, 2)


def gathered_sources(cp: int, chunk: int, slots: int, device="cuda") -> tuple[list, list]:
    """K/V per local slot laid out exactly as comm.gather_kv delivers them: (cp*C, slots, 2, B, H, D) storage."""
    g = torch.randn(cp * chunk, slots, 2, 1, HKV, D, device=device, dtype=DTYPE)
    ks = [g[:, i, 0].permute(1, 2, 0, 3) for i in range(slots)]
    vs = [g[:, i, 1].permute(1, 2, 0, 3) for i in range(slots)]
    return ks, vs


def time_ms(fn: Callable[[], object], iters: int, warmup: int) -> float:
    """Median wall time on the GPU (CUDA events) of fn over `iters` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def sdpa_full_fwd_bwd(seq: int, backend) -> Callable[[], object]:
    """fwd+bwd of single-GPU SDPA over the full causal sequence on one SDPA backend."""
    from torch.nn.attention import sdpa_kernel

    q, k, v = (bshd(1, seq, h).requires_grad_() for h in (HQ, HKV, HKV))
    dout = bshd(1, seq, HQ)

    def run():
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(dout)
        q.grad = k.grad = v.grad = None

    return run


def causal_flops(seq: int) -> float:
    """fwd+bwd FLOPs of causal attention at the Llama3-8B shape (fwd 2 matmuls, bwd 5, half the square)."""
    return 7 * 2 * seq * seq * HQ * D / 2

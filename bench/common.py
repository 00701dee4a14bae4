"""Shared pieces of the GPU benchmarks: the Llama3-8B attention shape, rank inputs, CUDA-event timing."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

HQ, HKV, D = 32, 8, 128  # Llama3-8B attention
DTYPE = torch.bfloat16


def bshd(b: int, s: int, h: int, d: int = D, device="cuda") -> torch.Tensor:
    """A (B, H, S, D) tensor stored as (B, S, H, D), as a model's q/k/v projections give it (random, not zeros)."""
    return torch.randn(b, s, h, d, device=device, dtype=DTYPE).transpose(1, 2)


def gathered_sources(cp: int, chunk: int, slots: int, device="cuda", hkv: int = HKV) -> tuple[list, list]:
    """K/V per local slot laid out exactly as comm.gather_kv delivers them: (cp*C, slots, 2, B, H, D) storage."""
    g = torch.randn(cp * chunk, slots, 2, 1, hkv, D, device=device, dtype=DTYPE)
    ks = [g[:, i, 0].permute(1, 2, 0, 3) for i in range(slots)]
    vs = [g[:, i, 1].permute(1, 2, 0, 3) for i in range(slots)]
    return ks, vs


HEAD_START_CYCLES = 2_000_000
"""A ~1 ms GPU sleep queued before each timed run, so the host enqueues the run's launches ahead of the GPU,
as it does inside a training step; the events then time GPU work, not Python's launch latency."""


def time_many_ms(fns: list[Callable[[], object]], iters: int, warmup: int) -> list[float]:
    """Median GPU time (CUDA events) of each fn over `iters` runs, the fns interleaved run by run so clock
    drift hits them alike, after `warmup` runs of each."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for fn, ts in zip(fns, times):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(HEAD_START_CYCLES)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ts.append(start.elapsed_time(end))
    return [statistics.median(ts) for ts in times]


HOST_SLEEP_CYCLES = 200_000_000
"""~100 ms of GPU sleep queued before a step whose host time is measured: longer than any step's host time here."""


def queued_host_ms(fn: Callable[[], object], calls: int, reps: int = 3, sleep_cycles: int = HOST_SLEEP_CYCLES) -> float:
    """Median CPU ms a call of `fn`, `calls` calls enqueued in a row behind one GPU sleep of `sleep_cycles` (nothing
    on the host waits for the GPU; keep the calls' launches within the driver's queue): the warm host cost a call."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(sleep_cycles)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) * 1e3 / calls)
    torch.cuda.synchronize()
    return statistics.median(times)


def host_and_gpu_ms(step: Callable[[], object], reps: int = 5) -> tuple[float, float]:
    """(median host ms, median GPU ms) of `step`, each run behind a long GPU sleep: the host time is the CPU time
    from the call to its return (backward included) with nothing on the host waiting for the GPU (a host sync in
    the step would show as the sleep's length); the GPU time is the step's kernels back to back after that head
    start, with no gap the host leaves: the GPU busy time."""
    hosts, gpus = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(HOST_SLEEP_CYCLES)
        start.record()
        t0 = time.perf_counter()
        step()
        hosts.append((time.perf_counter() - t0) * 1e3)
        end.record()
        end.synchronize()
        gpus.append(start.elapsed_time(end))
    return statistics.median(hosts), statistics.median(gpus)


def back_to_back_ms(step: Callable[[], object], steps: int = 20) -> float:
    """ms a step over `steps` run back to back, nothing synchronising between them (a training loop's pace: the
    host's when it is slower than the GPU)."""
    step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def time_ms(fn: Callable[[], object], iters: int, warmup: int) -> float:
    return time_many_ms([fn], iters, warmup)[0]


def sdpa_full_fwd_bwd(seq: int, backend, hq: int = HQ, hkv: int = HKV) -> Callable[[], object]:
    """fwd+bwd of single-GPU SDPA over the full causal sequence on one SDPA backend."""
    from torch.nn.attention import sdpa_kernel

    q, k, v = (bshd(1, seq, h).requires_grad_() for h in (hq, hkv, hkv))
    dout = bshd(1, seq, hq)

    def run():
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(dout)
        q.grad = k.grad = v.grad = None

    return run


def causal_flops(seq: int, hq: int = HQ) -> float:
    """fwd+bwd FLOPs of causal attention at the Llama3-8B shape (fwd 2 matmuls, bwd 5, half the square)."""
    return 7 * 2 * seq * seq * hq * D / 2

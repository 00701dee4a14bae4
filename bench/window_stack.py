"""A Gemma-3-like attention stack under CP: 5 sliding-window layers to 1 global layer, at long context.

    python -m bench.window_stack --out bench/results/window_stack.json                # the H200: S=128K, cp=8
    python -m bench.window_stack --device cpu --seq 256 --cp 4 --window 16 --out /tmp/w.json   # CPU smoke test

Why: the ring is the comm for long context, and most layers of today's open models are windowed. A windowed
layer's queries read at most `window` keys back, so under the ring a rank visits only the steps whose K/V chunk
some row's window reaches (comms/ring/schedule.visited_steps); under all_gather it still gathers every token's K/V.

What runs: the stack (q/k/v/o projections and attention per layer, Gemma 3 12B's attention shape, bf16), one
training step (forward + backward) of ONE rank of a fake process group (collectives allocate their outputs but
move no data, so time is compute only and the peak is the rank's own), per comm, against the same stack over the
whole sequence on one GPU (windowed layers on aten's FlashAttention-2 with the same window, the global layer on
SDPA) compiled with the inner compiler alone. Efficiency = single-GPU step / cp / rank step; memory = the rank's
peak above its static bytes against single-GPU activations / cp. Both sides run in the same process, one after
the other.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time

import torch
import torch.nn.functional as F
from torch import nn

import cpcompile
from bench.memory import fake_group
from cpcompile.comms.ring.schedule import visited_steps
from cpcompile.kernels.flash import FlashKernel
from cpcompile.layouts import get_layout


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int = 3840  # Gemma 3 12B
    hq: int = 16
    hkv: int = 8
    head_dim: int = 256


GEMMA3_12B = Shape()
TINY = Shape(hidden=64, hq=4, hkv=2, head_dim=16)


class _WindowedFlash(torch.autograd.Function):
    """Single-GPU reference of a causal sliding window: FA2 over the whole sequence (a dense mask at 128K would not
    fit); the same kernel the CP regions run windowed blocks on."""

    @staticmethod
    def forward(ctx, q, k, v, left):
        kern = FlashKernel()
        out, lse = kern.forward(q, k, v, True, None, (left, 0))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.left = left
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = FlashKernel().backward(dout, q, k, v, out, lse, True, None, (ctx.left, 0))
        return dq, dk, dv, None


@torch.compiler.disable
def windowed_reference(q, k, v, left: int) -> torch.Tensor:
    if q.is_cuda:
        return _WindowedFlash.apply(q, k, v, left)  # FA2 takes GQA's fewer K/V heads as they are
    return cpcompile.attention(q, k, v, is_causal=True, window=(left, 0))


class Layer(nn.Module):
    """Pre-projection attention layer: x (B, S, hidden) -> (B, S, hidden). `window` 0: global causal."""

    def __init__(self, shape: Shape, window: int) -> None:
        super().__init__()
        h, d = shape.hidden, shape.head_dim
        self.shape, self.window, self.reference = shape, window, False
        self.wq = nn.Linear(h, shape.hq * d, bias=False)
        self.wk = nn.Linear(h, shape.hkv * d, bias=False)
        self.wv = nn.Linear(h, shape.hkv * d, bias=False)
        self.wo = nn.Linear(shape.hq * d, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        sh = self.shape
        q = self.wq(x).view(b, s, sh.hq, sh.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, sh.hkv, sh.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, sh.hkv, sh.head_dim).transpose(1, 2)
        if not self.window:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        elif self.reference:
            a = windowed_reference(q, k, v, self.window - 1)
        else:
            a = cpcompile.attention(q, k, v, is_causal=True, window=(self.window - 1, 0))
        return x + self.wo(a.transpose(1, 2).reshape(b, s, sh.hq * sh.head_dim))


def build(shape: Shape, local: int, window: int, device: str, dtype: torch.dtype) -> nn.Sequential:
    """`local` windowed layers then one global layer (Gemma 3's 5:1), small random weights, grads allocated."""
    torch.manual_seed(0)
    layers = [Layer(shape, window) for _ in range(local)] + [Layer(shape, 0)]
    stack = nn.Sequential(*layers).to(device=device, dtype=dtype)
    for p in stack.parameters():
        p.data.mul_(0.02 / p.data.std().clamp_min(1e-6))
        p.grad = torch.zeros_like(p)
    return stack


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(stack: nn.Module, backend, tokens: int, args) -> dict:
    """Compile (first step), then `--iters` timed steps; the peak of the last one above its static bytes."""
    torch._dynamo.reset()
    gc.collect()
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    step_fn = torch.compile(stack, backend=backend)
    x = torch.randn(1, tokens, args.shape.hidden, device=args.device, dtype=args.dtype, requires_grad=True)
    dout = torch.randn_like(x)

    def step() -> None:
        step_fn(x).backward(dout)

    t0 = time.perf_counter()
    step()
    _sync(args.device)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(args.iters):
        gc.collect()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        static = torch.cuda.memory_allocated() if cuda else None
        t0 = time.perf_counter()
        step()
        _sync(args.device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    times.sort()
    return {
        "step_ms": 1e3 * times[len(times) // 2],
        "compile_s": compile_s,
        "peak_bytes": peak,
        "activation_bytes": None if peak is None else peak - static,
    }


def ring_steps(args) -> int:
    """Ring steps a windowed layer visits (of cp), from the layout's schedule."""
    lay = get_layout(args.layout)
    chunk = args.seq // args.cp // lay.chunks_per_rank
    return len(visited_steps(lay, args.cp, chunk, True, (args.window - 1, 0)))


def run(args) -> list[dict]:
    stack = build(args.shape, args.local, args.window, args.device, args.dtype)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    common = {"S": args.seq, "cp": args.cp, "layout": args.layout, "rank": args.rank, "window": args.window}
    common |= {"layers": f"{args.local}:1", "shape": dataclasses.asdict(args.shape), "device": device}
    common |= {"torch": torch.__version__, "inner": args.inner, "ring_steps_windowed": ring_steps(args)}
    for layer in stack:
        layer.reference = True
    single = measure(stack, args.inner, args.seq, args)
    print(f"single GPU: {single}", flush=True)
    for layer in stack:
        layer.reference = False
    records = []
    for comm in args.comms:
        rec = {**common, "comm": comm, "single_gpu_step_ms": single["step_ms"]}
        rec["single_gpu_activation_bytes"] = single["activation_bytes"]
        try:
            with fake_group(args.rank, args.cp):
                be = cpcompile.backend(strategy=args.layout, comm=comm, inner=args.inner)
                rec |= measure(stack, be, args.seq // args.cp, args)
            rec["efficiency"] = single["step_ms"] / args.cp / rec["step_ms"]
            if rec["activation_bytes"] is not None and single["activation_bytes"]:
                rec["memory_vs_single_over_cp"] = rec["activation_bytes"] / (single["activation_bytes"] / args.cp)
        except Exception as e:  # a refused or failed comm is a row of the results, not the end of the run
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        print(json.dumps(rec), flush=True)
        records.append(rec)
    with open(args.out, "w") as f:
        json.dump({"single_gpu": {**common, **single}, "records": records}, f, indent=1)
    return records


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seq", type=int, default=128 * 1024)
    p.add_argument("--cp", type=int, default=8)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--local", type=int, default=5, help="windowed layers before the global one")
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--comms", default="ring,all_gather,a2a")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--inner", default="inductor")
    args = p.parse_args(argv)
    args.comms = args.comms.split(",")
    args.shape = GEMMA3_12B if args.device == "cuda" else TINY
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    if args.device == "cpu":
        args.inner = "aot_eager"
    run(args)


if __name__ == "__main__":
    main()

"""Demo: train a small Llama-style model with context parallelism and check it against one process.

    python examples/train_cp.py                 # 2 CPU ranks (gloo), or one rank per GPU when GPUs exist
    python examples/train_cp.py --ranks 4 --strategy flat --inner inductor
    python examples/train_cp.py --ranks 4 --comm a2a   # Ulysses: trade heads for sequence around attention

Every rank feeds its shard of each batch (cpcompile.shard_batch); torch.compile with the cpcompile backend
rewrites each attention call into a CP region. At the end the same training runs on one process over the
full sequences and the demo prints how closely the CP run matches it.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from cpcompile.testing.distributed import run_ranks
from cpcompile.testing.model import TinyConfig
from cpcompile.testing.training import make_batches, train


def _bar(step: int, steps: int, loss: float, started: float, width: int = 30) -> None:
    done = (step + 1) * width // steps
    rate = (step + 1) / max(time.time() - started, 1e-9)
    line = f"\r[{'#' * done}{'.' * (width - done)}] step {step + 1}/{steps}  loss {loss:.4f}  {rate:.1f} steps/s"
    print(line, end="" if step + 1 < steps else "\n", file=sys.stderr, flush=True)


def _rank_main(rank: int, world: int, args: argparse.Namespace):
    device = "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    cfg = TinyConfig(layers=args.layers)
    batches = make_batches(cfg, args.steps, args.batch, args.seq, seed=0)
    started = time.time()
    on_step = (lambda i, loss: _bar(i, args.steps, loss, started)) if rank == 0 else None
    res = train(cfg, batches, strategy=args.strategy, comm=args.comm, inner=args.inner, device=device, on_step=on_step)
    return res


def main() -> int:
    gpus = torch.cuda.device_count()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=gpus if gpus > 1 else 2)
    p.add_argument("--strategy", default="zigzag", choices=["flat", "zigzag"])
    p.add_argument("--comm", default="all_gather", choices=["all_gather", "a2a"])
    p.add_argument("--inner", default="inductor" if gpus else "aot_eager", choices=["inductor", "aot_eager", "eager"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()
    args.device = "cuda" if gpus >= args.ranks else "cpu"
    backend = "nccl" if args.device == "cuda" else "gloo"
    print(
        f"cpcompile demo: TinyLlama ({args.layers} layers), {args.steps} steps of {args.batch}x{args.seq} tokens, "
        f"strategy={args.strategy} comm={args.comm} inner={args.inner}, {args.ranks} {args.device} ranks ({backend})"
    )
    results = run_ranks(_rank_main, args.ranks, args, backend=backend, timeout=1800)
    cfg = TinyConfig(layers=args.layers)
    ref = train(cfg, make_batches(cfg, args.steps, args.batch, args.seq, seed=0), strategy=None, inner="eager")
    loss_diff = max(abs(a - b) for r in results for a, b in zip(r.losses, ref.losses))
    weight_diff = max((p - ref.params[n]).abs().max().item() for r in results for n, p in r.params.items())
    print(f"attention nodes rewritten per rank: {[r.rewritten for r in results]}")
    print(f"loss: first {ref.losses[0]:.4f} -> last {ref.losses[-1]:.4f} (single process)")
    print(f"parity with single process: max |loss diff| {loss_diff:.2e}, max |weight diff| {weight_diff:.2e}")
    ok = loss_diff <= 1e-4 and weight_diff <= 1e-3
    print("PARITY OK" if ok else "PARITY MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Example: train torchtitan's Llama3 (its debugmodel flavor, its own modules) with cpcompile, check it against one
process.

    python examples/train_torchtitan.py                          # packed documents, VarlenAttention, thd, 2 ranks
    python examples/train_torchtitan.py --strategy thd_zigzag
    python examples/train_torchtitan.py --attention sdpa         # dense causal SDPA, zigzag
    python examples/train_torchtitan.py --ranks 3 --comm a2a --layers 2

torchtitan's own CP takes FlexAttention only; here its VarlenAttention (packed documents) and its
ScaledDotProductAttention run under cpcompile. Every rank shards each GLOBAL batch with
cpcompile.integrations.torchtitan.shard_batch: its tokens, their GLOBAL positions (RoPE), and varlen metadata
built from the GLOBAL positions, with cu_seqlens padded to a fixed length so new documents never recompile.
Random init and synthetic tokens (nothing is downloaded); CPU ranks (gloo). Needs torchtitan (and triton,
which torchtitan imports even on CPU): pip install -e '.[test]'.
"""

from __future__ import annotations

import argparse
import sys
import time

from cpcompile.integrations.rows import pack_rows
from cpcompile.testing.distributed import run_ranks
from cpcompile.testing.titan_llama import FLAVOR, titan_batches, train_titan


def _batches(args: argparse.Namespace) -> list[dict]:
    return titan_batches(args.steps, args.batch, args.seq, documents=args.attention == "varlen", seed=0)


def _rank_main(rank: int, world: int, args: argparse.Namespace):
    started = time.time()

    def on_step(step: int, loss: float, padding: int) -> None:
        if rank == 0:
            note = f" (compiling included: {time.time() - started:.1f} s)" if step == 0 else ""
            print(f"step {step + 1}/{args.steps}  loss {loss:.4f}{note}", file=sys.stderr, flush=True)

    return train_titan(
        _batches(args), attention=args.attention, strategy=args.strategy, comm=args.comm, inner=args.inner,
        layers=args.layers, max_documents=args.max_documents, on_step=on_step,
    )  # fmt: skip


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    p.add_argument(
        "--attention",
        default="varlen",
        choices=["varlen", "sdpa"],
        help="torchtitan's VarlenAttention over packed documents, or its causal ScaledDotProductAttention",
    )
    p.add_argument(
        "--strategy",
        choices=["thd", "thd_zigzag", "flat", "zigzag"],
        help="token layout (default: thd for varlen, zigzag for sdpa)%(default).0s",
    )
    p.add_argument("--comm", default="all_gather", choices=["all_gather", "a2a"], help="all_gather of K/V, or a2a")
    p.add_argument("--ranks", type=int, default=2, help="CP ranks (CPU processes)")
    p.add_argument(
        "--inner",
        default="aot_eager",
        choices=["aot_eager", "inductor", "eager"],
        help="the compiler cpcompile hands the rewritten graph to",
    )
    p.add_argument("--steps", type=int, default=5, help="training steps")
    p.add_argument("--seq", type=int, default=128, help="tokens per row")
    p.add_argument("--batch", type=int, default=2, help="rows per batch")
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all 6)%(default).0s")
    p.add_argument(
        "--max-documents",
        type=int,
        default=64,
        help="varlen: the most documents a batch holds (fixes the cu_seqlens length)",
    )
    args = p.parse_args()
    args.strategy = args.strategy or ("thd" if args.attention == "varlen" else "zigzag")
    return args


def main() -> int:
    args = _parse()
    print(
        f"torchtitan Llama3 {FLAVOR} ({args.layers or 'all'} layers, {args.attention} attention), {args.steps} steps "
        f"of {args.batch}x{args.seq} tokens, strategy={args.strategy} comm={args.comm} inner={args.inner}, "
        f"{args.ranks} CPU ranks"
    )
    full = pack_rows(**_batches(args)[0], strategy=args.strategy, cp=args.ranks, max_documents=args.max_documents)
    if full.padding:
        print(f"padding: {full.padding} tokens added for {args.strategy} on {args.ranks} ranks (labels ignored)")
    print(f"compiling: each rank traces the model, cpcompile rewrites its attention, {args.inner} compiles it ...")
    results = run_ranks(_rank_main, args.ranks, args, timeout=1800)
    ref = train_titan(_batches(args), attention=args.attention, layers=args.layers)
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

"""Example: train torchtitan's Llama3 (its debugmodel flavor, its own modules) with cpcompile, check it against one
process.

    python examples/train_torchtitan.py                          # packed documents, VarlenAttention, thd, 2 ranks
    python examples/train_torchtitan.py --strategy thd_zigzag
    python examples/train_torchtitan.py --attention sdpa         # dense causal SDPA, zigzag
    python examples/train_torchtitan.py --strategy thd_balanced  # equal tokens and work a rank, any documents
    python examples/train_torchtitan.py --comm ring              # K/V passed around the ranks
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

from _demo import Progress, refusal, report_parity, run_or_explain  # examples/_demo.py: no torch import


def _batches(args: argparse.Namespace) -> list[dict]:
    from cpcompile.testing.titan_llama import titan_batches

    return titan_batches(args.steps, args.batch, args.seq, documents=args.attention == "varlen", seed=0)


def _rank_main(rank: int, world: int, args: argparse.Namespace):
    from cpcompile.testing.titan_llama import train_titan

    progress = Progress(args.steps, args.started) if rank == 0 else None
    try:
        return train_titan(
            _batches(args), attention=args.attention, strategy=args.strategy, comm=args.comm, inner=args.inner,
            layers=args.layers, max_documents=args.max_documents,
            on_step=None if progress is None else lambda step, loss, padding: progress(step, loss),
        )  # fmt: skip
    except Exception as e:
        refused = refusal(e)  # every rank refuses alike: report it as one line, not a traceback per rank
        if refused is None:
            raise
        return refused


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
        choices=["thd", "thd_zigzag", "thd_balanced", "flat", "zigzag"],
        help="token layout (default: thd for varlen, zigzag for sdpa)%(default).0s",
    )
    p.add_argument("--comm", default="all_gather", choices=["all_gather", "a2a", "ring"],
                   help="all_gather of K/V, a2a (Ulysses: heads for sequence), or ring (K/V chunks passed around "
                   "the ranks: the least memory)")  # fmt: skip
    p.add_argument("--ranks", type=int, default=2, help="CP ranks (CPU processes)")
    p.add_argument(
        "--inner",
        default="aot_eager",
        choices=["aot_eager", "inductor", "eager"],
        help="the compiler cpcompile hands the rewritten graph to",
    )
    p.add_argument("--verbose", action="store_true", help="print the whole traceback of an error")
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
    if (args.strategy.startswith("thd")) != (args.attention == "varlen"):
        p.error(f"--strategy {args.strategy} does not fit --attention {args.attention}: varlen takes thd, "
                "thd_zigzag or thd_balanced; sdpa takes flat or zigzag")  # fmt: skip
    return args


def main() -> int:
    args = _parse()
    from cpcompile.integrations.rows import pack_rows
    from cpcompile.testing.distributed import run_ranks
    from cpcompile.testing.titan_llama import FLAVOR, train_titan

    print(
        f"torchtitan Llama3 {FLAVOR} ({args.layers or 'all'} layers, {args.attention} attention), {args.steps} steps "
        f"of {args.batch}x{args.seq} tokens, strategy={args.strategy} comm={args.comm} inner={args.inner}, "
        f"{args.ranks} CPU ranks"
    )
    full = pack_rows(**_batches(args)[0], strategy=args.strategy, cp=args.ranks, max_documents=args.max_documents)
    if full.padding:
        print(f"padding: {full.padding} tokens added for {args.strategy} on {args.ranks} ranks (labels ignored)")
    print(f"starting {args.ranks} ranks; each traces the model, cpcompile rewrites its attention, {args.inner} "
          "compiles it ...", flush=True)  # fmt: skip
    args.started = time.time()
    results = run_or_explain(lambda: run_ranks(_rank_main, args.ranks, args, timeout=1800), args.verbose)
    if results is None:
        return 2
    print("the same training on one process, for the comparison ...", flush=True)
    ref = train_titan(_batches(args), attention=args.attention, layers=args.layers)
    return 0 if report_parity(results, ref) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Demo: train a small Llama-style model with context parallelism and check it against one process.

    python examples/train_cp.py                  # 2 CPU ranks (gloo), or one rank per GPU when GPUs exist
    python examples/train_cp.py --ranks 4 --strategy flat --inner inductor
    python examples/train_cp.py --ranks 4 --comm a2a     # Ulysses: trade heads for sequence around attention
    python examples/train_cp.py --packed --ranks 3       # packed documents through varlen_attn (thd)
    python examples/train_cp.py --packed --strategy thd_balanced   # equal tokens and work a rank, any documents
    python examples/train_cp.py --comm ring              # K/V passed around the ranks: the least memory
    python examples/train_cp.py --model hf-llama         # transformers' LlamaForCausalLM (needs transformers)
    python examples/train_cp.py --verify                 # first cpcompile.verify: the first batch both ways

Every rank feeds its shard of each batch; torch.compile with the cpcompile backend rewrites each attention call
into a CP region. Sequences the layout cannot split are padded (labels ignored) and the demo says so. At the
end the same training runs on one process over the full, unpadded sequences and the demo prints how closely
the CP run matches it; a refusal is one line (--verbose: the traceback). torchtitan's Llama3:
examples/train_torchtitan.py. The scripts to copy for your own training: examples/torchrun/.
"""

from __future__ import annotations

import argparse
import sys
import time

from _demo import Progress, refusal, report_parity, run_or_explain  # examples/_demo.py: no torch import

DENSE, PACKED = ("flat", "zigzag"), ("thd", "thd_zigzag", "thd_balanced")
LR = {"tiny": 0.5, "hf-llama": 0.1}
"""Plain SGD (weight error tracks gradient error) at a rate each model trains stably with for the default steps:
HF's Llama (init std 0.02) diverges at 0.5 after a few steps, and two diverging runs no longer agree."""


def _dense_batches(args: argparse.Namespace, cfg, cp: int) -> list[dict]:
    """The demo's batches, padded for the layout on cp ranks (cp=1: as they are)."""
    from cpcompile.integrations.rows import pack_rows
    from cpcompile.testing.training import make_batches

    batches = make_batches(cfg, args.steps, args.batch, args.seq, seed=0)
    if cp == 1:
        return batches
    out = []
    for b in batches:
        full = pack_rows(b["input_ids"], b["labels"], b["position_ids"], strategy=args.strategy, cp=cp)
        out.append({"input_ids": full.tokens, "labels": full.labels, "position_ids": full.positions})
    return out


def _packed_batches(args: argparse.Namespace, cfg) -> list[dict]:
    from cpcompile.testing.packed_training import chain_rows

    return chain_rows(cfg.vocab, args.steps, args.batch, args.seq, documents=True, seed=0)


def _train(args: argparse.Namespace, cfg, strategy: str | None, device: str, on_step=None):
    lr = args.lr if args.lr is not None else LR[args.model]
    inner = args.inner if strategy else "eager"
    if args.packed:
        from cpcompile.testing.packed_training import train_packed

        return train_packed(
            cfg, _packed_batches(args, cfg), strategy=strategy, comm=args.comm, inner=inner, lr=lr,
            max_documents=args.max_documents, device=device, on_step=on_step,
        )  # fmt: skip
    from cpcompile.testing.training import train

    cp = args.ranks if strategy else 1
    return train(
        cfg, _dense_batches(args, cfg, cp), strategy=strategy, comm=args.comm, inner=inner, lr=lr,
        device=device, on_step=on_step, model=args.model,
    )  # fmt: skip


def _config(args: argparse.Namespace):
    from cpcompile.testing.model import TinyConfig

    return TinyConfig(layers=args.layers)


def _rank_main(rank: int, world: int, args: argparse.Namespace):
    import torch

    device = "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    on_step = Progress(args.steps, args.started) if rank == 0 else None
    try:
        return _train(args, _config(args), args.strategy, device, on_step)
    except Exception as e:
        refused = refusal(e)  # every rank refuses alike: report it as one line, not a traceback per rank
        if refused is None:
            raise
        return refused


def _packed_forward(model, batch: dict):
    from cpcompile.testing.varlen_model import VarlenTinyLlama

    if isinstance(model, VarlenTinyLlama):  # the one-process run: varlen_attn has no CPU kernel, SDPA per document
        model.use_per_document_sdpa()
    return model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"])


def _tiny_forward(model, batch: dict):
    return model(batch["input_ids"], batch["position_ids"])


def _hf_forward(model, batch: dict):
    return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits


def _verify_rank(rank: int, world: int, args: argparse.Namespace) -> bool:
    """cpcompile.verify on the first batch: the model sharded through the compiled model vs whole on one process."""
    import torch

    import cpcompile
    from cpcompile.integrations.rows import pack_rows
    from cpcompile.testing.model import TinyConfig, TinyLlama, token_loss_sum
    from cpcompile.testing.varlen_model import VarlenTinyLlama

    device = f"cuda:{rank}" if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    cfg = TinyConfig(layers=args.layers)
    torch.manual_seed(0)
    if args.packed:
        full = pack_rows(**_packed_batches(args, cfg)[0], strategy=args.strategy, cp=world,
                         max_documents=args.max_documents)  # fmt: skip
        model = VarlenTinyLlama(cfg, causal=True, max_len=full.max_seqlen)
        batch = {"input_ids": full.tokens[0], "position_ids": full.positions[0], "labels": full.labels[0],
                 "cu_seqlens": full.cu_seqlens}  # fmt: skip
        forward, seq_dim, count = _packed_forward, 0, full.num_tokens
    else:
        if args.model == "hf-llama":
            from cpcompile.testing.hf_llama import hf_llama

            model, forward = hf_llama(cfg), _hf_forward
        else:
            model, forward = TinyLlama(cfg), _tiny_forward
        batch, seq_dim = _dense_batches(args, cfg, world)[0], 1
        count = int((batch["labels"] != -100).sum())
    report = cpcompile.verify(
        model.to(device), {k: v.to(device) for k, v in batch.items()},
        backend=cpcompile.backend(strategy=args.strategy, comm=args.comm, inner=args.inner), forward=forward,
        loss_fn=lambda logits, b: token_loss_sum(logits.reshape(-1, logits.shape[-1])[None], b["labels"].reshape(1, -1))
        / count, seq_dim=seq_dim,
    )  # fmt: skip
    return report.passed


def _layout_line(args: argparse.Namespace, cfg) -> str | None:
    """What the layout pads or packs, said before training (None when a dense batch needs nothing)."""
    from cpcompile.integrations.rows import pack_rows

    if args.packed:
        full = pack_rows(**_packed_batches(args, cfg)[0], strategy=args.strategy, cp=args.ranks,
                         max_documents=args.max_documents)  # fmt: skip
        rows = f"{args.batch} rows of {args.seq} tokens packed into one buffer of {full.tokens.shape[1]} tokens"
        if not full.padding:
            return f"packing: {rows} (nothing padded)"
        if args.strategy == "thd_zigzag":
            rule = f"thd_zigzag pads every document to a multiple of {2 * args.ranks}, to a fixed total"
        else:
            rule = f"{args.strategy} on {args.ranks} ranks needs a multiple of {args.ranks}"
        return f"packing: {rows}, {full.padding} of them padding ({rule}; padding labels are ignored)"
    b = _dense_batches(args, cfg, 1)[0]
    full = pack_rows(b["input_ids"], b["labels"], b["position_ids"], strategy=args.strategy, cp=args.ranks)
    if not full.padding:
        return None
    need = args.ranks * (2 if args.strategy == "zigzag" else 1)
    return (
        f"padding: each sequence {args.seq} -> {full.tokens.shape[1]} tokens ({args.strategy} on {args.ranks} ranks "
        f"needs a multiple of {need}; padding labels are ignored)"
    )


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    p.add_argument("--ranks", type=int, help="CP ranks (processes); default: one per GPU with 2+ GPUs, else 2")
    p.add_argument("--packed", action="store_true", help="packed documents: each batch's rows hold random documents, "
                   "attention is varlen_attn over the GLOBAL cu_seqlens (TinyLlama only)")  # fmt: skip
    p.add_argument("--strategy", choices=DENSE + PACKED,
                   help="token layout (default: zigzag; thd with --packed)%(default).0s")  # fmt: skip
    p.add_argument("--comm", default="all_gather", choices=["all_gather", "a2a", "ring"],
                   help="all_gather of K/V, a2a (Ulysses: heads for sequence), or ring (K/V chunks passed around "
                   "the ranks while each step computes: the least memory)")  # fmt: skip
    p.add_argument(
        "--model",
        default="tiny",
        choices=tuple(LR),
        help="tiny: the built-in TinyLlama; hf-llama: transformers' LlamaForCausalLM of its sizes "
        "(attn_implementation=cpcompile)",
    )
    p.add_argument("--inner", choices=["inductor", "aot_eager", "eager"],
                   help="the compiler cpcompile hands the rewritten graph to; default: inductor on GPUs, "
                   "aot_eager on CPU (faster to compile)")  # fmt: skip
    p.add_argument("--lr", type=float, help="SGD learning rate; default: 0.5 for tiny, 0.1 for hf-llama (stable)")
    p.add_argument("--verbose", action="store_true", help="print the whole traceback of an error")
    p.add_argument("--steps", type=int, default=20, help="training steps")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence (row)")
    p.add_argument("--batch", type=int, default=2, help="sequences (rows) per batch")
    p.add_argument("--layers", type=int, default=2, help="transformer layers")
    p.add_argument("--verify", action="store_true", help="first run cpcompile.verify on the first batch (logits, "
                   "loss and every gradient, CP against one process) and stop on a mismatch")  # fmt: skip
    p.add_argument("--max-documents", type=int, default=64,
                   help="--packed: the most documents a batch holds (fixes the cu_seqlens length)")  # fmt: skip
    args = p.parse_args()
    args.strategy = args.strategy or ("thd" if args.packed else "zigzag")
    if (args.strategy in PACKED) != args.packed:
        p.error(f"--strategy {args.strategy} is for {'un' if args.packed else ''}packed sequences: "
                f"use one of {', '.join(PACKED if args.packed else DENSE)}")  # fmt: skip
    if args.packed and args.model != "tiny":
        p.error("--packed runs the built-in TinyLlama over varlen_attn only (--model tiny)")
    import torch  # after argparse: --help and usage errors never wait for it

    gpus = torch.cuda.device_count()
    args.ranks = args.ranks or (gpus if gpus > 1 else 2)
    args.inner = args.inner or ("inductor" if gpus else "aot_eager")
    args.device = "cuda" if gpus >= args.ranks else "cpu"
    return args


def main() -> int:
    args = _parse()
    from cpcompile.testing.distributed import run_ranks

    cfg = _config(args)
    backend = "nccl" if args.device == "cuda" else "gloo"
    what = f"{'packed documents, ' if args.packed else ''}{args.steps} steps of {args.batch}x{args.seq} tokens"
    print(
        f"cpcompile demo: {'TinyLlama' if args.model == 'tiny' else 'HF LlamaForCausalLM'} ({args.layers} layers), "
        f"{what}, strategy={args.strategy} comm={args.comm} inner={args.inner}, {args.ranks} {args.device} ranks "
        f"({backend})"
    )
    layout = _layout_line(args, cfg)
    if layout:
        print(layout)
    if args.verify:
        print("cpcompile.verify on the first batch: sharded through the compiled model vs whole on one process")
        from cpcompile.testing.distributed import run_ranks

        if not all(run_ranks(_verify_rank, args.ranks, args, backend=backend, timeout=1800)):
            print("VERIFY FAILED: not training")
            return 1
    print(f"starting {args.ranks} ranks; each traces the model, cpcompile rewrites its attention, {args.inner} "
          "compiles it ...", flush=True)  # fmt: skip
    args.started = time.time()
    results = run_or_explain(lambda: run_ranks(_rank_main, args.ranks, args, backend=backend, timeout=1800),
                             args.verbose)  # fmt: skip
    if results is None:
        return 2
    print("the same training on one process, for the comparison ...", flush=True)
    return 0 if report_parity(results, _train(args, cfg, None, "cpu")) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Single-GPU benchmark of a CP rank's attention: slowest rank vs the ideal (single-GPU cuDNN time / cp).

For every layout x kernel x S x cp it runs the block executor ops (forward and backward, merges and copies
included, no communication) on each rank's inputs, shaped as the all-gather delivers them, and takes the
slowest rank. It also times the same kernel calls alone, so the merge/copy overhead is measured, not
guessed. Llama3-8B attention (Hq=32, Hkv=8, D=128), bf16, causal, batch 1. CUDA events, warm-up, median.

    python -m bench.single_gpu --out bench/results/single_gpu.json [--seqs 32768,65536] [--cps 2,4,8]

Packed documents (--layouts thd,thd_zigzag; bench/thd_cases.py): the varlen executor ops on each rank's
packed inputs for realistic document-length mixes (--mixes), against the ideal = single-GPU FA2 varlen fwd+bwd
of every document in full over the whole packed sequence, / cp.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

from bench import thd_cases
from bench.common import (
    DTYPE,
    HKV,
    HQ,
    D,
    bshd,
    causal_flops,
    gathered_sources,
    sdpa_full_fwd_bwd,
    time_many_ms,
    time_ms,
)
from cpcompile import executor  # (registers torch.ops.cpcompile.*)
from cpcompile.executor import streams
from cpcompile.kernels import get_kernel
from cpcompile.layouts import get_layout

SCALE = 1 / math.sqrt(D)


def rank_case(layout: str, seq: int, cp: int, rank: int):
    lay = get_layout(layout)
    local = seq // cp
    chunk = local // lay.chunks_per_rank
    q, k, v, dout = bshd(1, local, HQ), bshd(1, local, HKV), bshd(1, local, HKV), bshd(1, local, HQ)
    gks, gvs = gathered_sources(cp, chunk, lay.chunks_per_rank)
    blocks = executor.encode_dense(lay.blocks(cp, rank, chunk, True))
    return q, [k, *gks], [v, *gvs], dout, blocks


def region_fn(q, ks, vs, dout, blocks, kernel):
    ops = torch.ops.cpcompile

    def run():
        out, lse = ops.attend_blocks(q, ks, vs, blocks, SCALE, kernel)
        ops.attend_blocks_backward(dout, q, ks, vs, out, lse, blocks, SCALE, kernel)

    return run


def kernels_only_fn(q, ks, vs, dout, blocks, kernel):
    """The same kernel calls the executor makes, with no merge, assembly or copies around them."""
    impl = get_kernel(kernel)
    out, lse = torch.ops.cpcompile.attend_blocks(q, ks, vs, blocks, SCALE, kernel)
    _, calls, lanes = executor.planned_calls(tuple(blocks), q.shape[0])

    fwd = executor.forward_thunks(impl, q, ks, vs, calls, SCALE)
    bwd = executor.backward_thunks(impl, dout, q, ks, vs, out, lse, calls, SCALE)

    def run():  # scheduled on streams exactly as the executor schedules them
        streams.run_calls(q.device, lanes, fwd)
        streams.run_calls(q.device, lanes, bwd)

    return run


def without_streams(fn):
    """fn with the executor's two-stream scheduling switched off (A/B in the same interleaved timing)."""

    def run():
        streams.ENABLED = False
        try:
            fn()
        finally:
            streams.ENABLED = True

    return run


def ideal_ms(seq: int, iters: int, warmup: int) -> tuple[float, str]:
    from torch.nn.attention import SDPBackend

    try:
        return time_ms(sdpa_full_fwd_bwd(seq, SDPBackend.CUDNN_ATTENTION), iters, warmup), "sdpa_cudnn"
    except RuntimeError as e:  # cuDNN SDPA refused the shape: say so in the record
        print(f"  cuDNN SDPA refused S={seq}: {str(e)[:200]}", flush=True)
        return time_ms(sdpa_full_fwd_bwd(seq, SDPBackend.FLASH_ATTENTION), iters, warmup), "sdpa_flash"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="32768,65536,131072")
    ap.add_argument("--cps", default="2,4,8")
    ap.add_argument("--layouts", default="zigzag,flat,thd,thd_zigzag")
    ap.add_argument("--mixes", default=",".join(thd_cases.MIXES))
    ap.add_argument("--thd-kernels", default="flash_varlen")
    ap.add_argument("--thd-comms", default="all_gather,a2a", help="a2a: thd only (thd_zigzag+a2a is refused)")
    ap.add_argument("--kernels", default="cudnn,flash")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--overhead-kernels", default="cudnn", help="kernels whose kernels-only time is measured")
    ap.add_argument("--out", default="bench/results/single_gpu.json")
    ap.add_argument("--streams-ab", action="store_true", help="also time the executor with one stream (A/B)")
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    records = json.load(open(args.out)) if os.path.exists(args.out) else []
    layouts = args.layouts.split(",")
    dense = [lay for lay in layouts if not lay.startswith("thd")]
    if len(dense) < len(layouts):
        records = thd_sweep(args, [lay for lay in layouts if lay.startswith("thd")], records, device)
    for seq in [int(s) for s in args.seqs.split(",")] if dense else []:
        iters = args.iters if seq < 131072 else max(3, args.iters - 2)
        ideal_full, ideal_src = ideal_ms(seq, iters, args.warmup)
        tflops = causal_flops(seq) / ideal_full / 1e9
        print(f"S={seq}: single-GPU {ideal_src} fwd+bwd {ideal_full:.2f} ms ({tflops:.0f} TFLOP/s)", flush=True)
        for cp in [int(c) for c in args.cps.split(",")]:
            for layout in dense:
                for kernel in args.kernels.split(","):
                    t0 = time.time()
                    per_rank, kernels_only, one_stream = [], [], []
                    for rank in range(cp):
                        case = rank_case(layout, seq, cp, rank)
                        fns = [region_fn(*case, kernel)]
                        if args.streams_ab:
                            fns.append(without_streams(fns[0]))
                        if kernel in args.overhead_kernels.split(","):
                            fns.append(kernels_only_fn(*case, kernel))
                        ms = time_many_ms(fns, iters, args.warmup)
                        per_rank.append(ms.pop(0))
                        if args.streams_ab:
                            one_stream.append(ms.pop(0))
                        kernels_only.extend(ms)
                        del case, fns
                    slow = max(range(cp), key=lambda r: per_rank[r])
                    ideal = ideal_full / cp
                    rec = dict(
                        layout=layout, comm="all_gather", kernel=kernel, S=seq, cp=cp,
                        slowest_rank=slow, slowest_rank_ms=per_rank[slow], ideal_ms=ideal,
                        efficiency=ideal / per_rank[slow], per_rank_ms=per_rank,
                        ideal_full_ms=ideal_full, ideal_source=ideal_src,
                        hq=HQ, hkv=HKV, head_dim=D, dtype=str(DTYPE), batch=1, iters=iters,
                        merge=os.environ.get("CPCOMPILE_MERGE", "auto"), device=device,
                        torch=torch.__version__, measured_at=_now(),
                    )  # fmt: skip
                    if one_stream:  # the same executor with every call on one stream, timed interleaved
                        rec["one_stream_ms"] = one_stream
                        rec["one_stream_efficiency"] = ideal / max(one_stream)
                    if kernels_only:
                        rec["kernels_only_ms"] = kernels_only
                        rec["overhead_frac"] = (per_rank[slow] - kernels_only[slow]) / per_rank[slow]
                    records = [r for r in records if _key(r) != _key(rec)] + [rec]
                    with open(args.out, "w") as f:
                        json.dump(records, f, indent=1)
                    extra = f" overhead {100 * rec['overhead_frac']:.2f}%" if kernels_only else ""
                    extra += f" one-stream eff {rec['one_stream_efficiency']:.3f}" if one_stream else ""
                    print(
                        f"  {layout:7s} {kernel:6s} cp={cp} slowest rank {slow}: {per_rank[slow]:8.2f} ms, "
                        f"ideal {ideal:8.2f} ms, eff {rec['efficiency']:.3f}{extra} [{time.time() - t0:.0f}s]",
                        flush=True,
                    )
                    torch.cuda.empty_cache()


def thd_sweep(args, layouts: list[str], records: list[dict], device: str) -> list[dict]:
    """THD records: per mix x S, the single-GPU ideal once, then every cp x layout x varlen kernel."""
    for mix in args.mixes.split(","):
        for seq in [int(s) for s in args.seqs.split(",")]:
            lengths = thd_cases.doc_lengths(seq, mix)
            ideal_full = time_ms(thd_cases.full_fn(lengths), args.iters, args.warmup)
            tflops = thd_cases.doc_flops(lengths) / ideal_full / 1e9
            print(f"{mix} S={seq}: {len(lengths)} docs (longest {max(lengths)}), single-GPU flash varlen fwd+bwd "
                  f"{ideal_full:.2f} ms ({tflops:.0f} TFLOP/s)", flush=True)  # fmt: skip
            for cp in [int(c) for c in args.cps.split(",")]:
                runs = [(lay, "all_gather") for lay in layouts if "all_gather" in args.thd_comms.split(",")]
                runs += [("thd", "a2a")] if "thd" in layouts and "a2a" in args.thd_comms.split(",") else []
                for layout, comm in runs:
                    for kernel in args.thd_kernels.split(","):
                        per_rank, kernels_only, eager = [], [], []
                        for rank in range(cp if comm == "all_gather" else 1):  # a2a: every rank the same
                            if comm == "a2a":  # region compiled by Inductor (as in a model), kernel alone, eager
                                case = thd_cases.a2a_rank_case(lengths, cp)
                                fns = [thd_cases.a2a_region_fn(*case, cp, kernel, compiled=True)]
                                fns.append(thd_cases.a2a_kernels_only_fn(*case, cp, kernel))
                                fns.append(thd_cases.a2a_region_fn(*case, cp, kernel))
                            else:
                                case = thd_cases.rank_case(layout, lengths, cp, rank)
                                fns = [thd_cases.region_fn(*case, kernel), thd_cases.kernels_only_fn(*case, kernel)]
                            region, bare, *eager_ms = time_many_ms(fns, args.iters, args.warmup)
                            per_rank.append(region)
                            kernels_only.append(bare)
                            eager.extend(eager_ms)
                            del case, fns
                        slow = max(range(len(per_rank)), key=lambda r: per_rank[r])
                        ideal = ideal_full / cp
                        rec = dict(
                            layout=layout, comm=comm, kernel=kernel, S=seq, cp=cp, mix=mix,
                            slowest_rank=slow, slowest_rank_ms=per_rank[slow], ideal_ms=ideal,
                            efficiency=ideal / per_rank[slow], per_rank_ms=per_rank, kernels_only_ms=kernels_only,
                            overhead_frac=(per_rank[slow] - kernels_only[slow]) / per_rank[slow],
                            ideal_full_ms=ideal_full, ideal_source="flash_varlen per-document, full packed sequence",
                            n_docs=len(lengths), longest_doc=max(lengths), doc_tflops_ideal=tflops,
                            hq=HQ, hkv=HKV, head_dim=D, dtype=str(DTYPE), batch=1, iters=args.iters,
                            device=device, torch=torch.__version__, measured_at=_now(),
                        )  # fmt: skip
                        if eager:  # the same a2a region run eagerly: every pack/unpack its own copy
                            rec["eager_region_ms"] = eager[slow]
                        records = [r for r in records if _key(r) != _key(rec)] + [rec]
                        with open(args.out, "w") as f:
                            json.dump(records, f, indent=1)
                        what = f"{layout:10s} {comm:10s} {kernel} cp={cp} slowest rank {slow}"
                        eff, over = rec["efficiency"], 100 * rec["overhead_frac"]
                        times = f"{per_rank[slow]:8.2f} ms, ideal {ideal:8.2f} ms"
                        more = f", eager region {eager[slow]:.2f} ms" if eager else ""
                        print(f"  {what}: {times}, eff {eff:.3f} overhead {over:.1f}%{more}", flush=True)
                        torch.cuda.empty_cache()
    return records


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())


def _key(r: dict) -> tuple:
    return (r["layout"], r["comm"], r["kernel"], r["S"], r["cp"], r.get("merge", "auto"), r.get("mix"))


if __name__ == "__main__":
    main()

"""Single-GPU benchmark of a CP rank's attention: slowest rank vs the ideal (single-GPU cuDNN time / cp).

For every layout x kernel x S x cp it runs the block executor ops (forward and backward, merges and copies
included, no communication) on each rank's inputs, shaped as the all-gather delivers them, and takes the
slowest rank. It also times the same kernel calls alone, so the merge/copy overhead is measured, not
guessed. Llama3-8B attention (Hq=32, Hkv=8, D=128) and MHA (--heads gqa,mha: Hq=Hkv=32), bf16, causal, batch 1.
CUDA events, warm-up, median.

    python -m bench.single_gpu --out bench/results/single_gpu.json [--seqs 32768,65536] [--cps 2,4,8] [--quick]

Packed documents (--layouts thd,thd_zigzag,thd_balanced; bench/thd_cases.py): the varlen executor ops on each rank's
packed inputs for realistic document-length mixes (--mixes), on --thd-kernels ("auto": cudnn_varlen where
cudnn-frontend is installed, else flash_varlen), against the ideal = the fastest single-GPU kernel's fwd+bwd of
every document in full (cuDNN THD top-left over the whole packed sequence, the documents in <= 8K chunks, or
FA2 varlen, timed together: `ideal_source`; FA2's and cuDNN's bottom-right times kept as columns), / cp.
cudnn_varlen's own split of a block of cut pieces (from `split_min_rows` q rows, kernels/cudnn_split.py) runs with
its merge compiled, as a region's graph runs it (`thd_cases.fused_split_merge`). cudnn_varlen all_gather rows also
time the rank's block split by shape (`kernels_split_ms`). all_gather rows' region time (`per_rank_ms`) runs its
metadata and ops eagerly; `compiled_region_ms` (per rank) times the region itself compiled by Inductor as in a
model, its collectives local (bench/thd_region.py; one compile per rank and case: --no-compiled-region skips it).
Packed rows' kernels alone (`kernels_only_ms`) run with each block's metadata built beforehand, as a region builds
it once per batch (`kernels_prepared`; records without it built it in every timed call, which a cuDNN call's host
time can dominate). all_gather rows also record the balance ceiling (mean / max rank work); thd_balanced rows the
host time of its per-batch plan (`plan_ms`). --thd-comms a2a (thd, thd_balanced): the a2a region with its
all-to-alls as identity, one rank; selective (thd, thd_balanced): its region with its exchange as identity, every
rank. thd_balanced's all_gather rows alone (about 2 minutes on an H200 with --no-compiled-region; each rank's
compile adds to it):

    python -m bench.single_gpu --layouts thd_balanced --seqs 32768,65536,131072 --cps 2,4,8 \
        --mixes docs-median-1K,docs-median-8K --thd-comms all_gather --thd-kernels cudnn_varlen
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

from bench import thd_cases, thd_region
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
from cpcompile.comms.registry import get_comm
from cpcompile.executor import streams
from cpcompile.kernels import get_kernel, resolve_kernel
from cpcompile.kernels.cudnn_varlen import SPLIT_MIN_ROWS
from cpcompile.layouts import get_layout, get_packed_layout

SCALE = 1 / math.sqrt(D)
HEADS = {"gqa": (HQ, HKV), "mha": (HQ, HQ)}
"""--heads: (q heads, kv heads) at D=128: Llama3-8B GQA and MHA."""
RUNS = {
    "full": {"seqs": "32768,65536,131072", "cps": "2,4,8", "iters": 7},
    "quick": {"seqs": "32768,131072", "cps": "2,8", "iters": 5},
}
"""Defaults of --seqs/--cps/--iters, and with --quick (a subset for a short GPU run)."""


def rank_case(layout: str, seq: int, cp: int, rank: int, hq: int = HQ, hkv: int = HKV):
    lay = get_layout(layout)
    local = seq // cp
    chunk = local // lay.chunks_per_rank
    q, k, v, dout = bshd(1, local, hq), bshd(1, local, hkv), bshd(1, local, hkv), bshd(1, local, hq)
    gks, gvs = gathered_sources(cp, chunk, lay.chunks_per_rank, hkv=hkv)
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


def ideal_ms(seq: int, iters: int, warmup: int, hq: int = HQ, hkv: int = HKV) -> tuple[float, str]:
    from torch.nn.attention import SDPBackend

    try:
        return time_ms(sdpa_full_fwd_bwd(seq, SDPBackend.CUDNN_ATTENTION, hq, hkv), iters, warmup), "sdpa_cudnn"
    except RuntimeError as e:  # cuDNN SDPA refused the shape: say so in the record
        print(f"  cuDNN SDPA refused S={seq}: {str(e)[:200]}", flush=True)
        return time_ms(sdpa_full_fwd_bwd(seq, SDPBackend.FLASH_ATTENTION, hq, hkv), iters, warmup), "sdpa_flash"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", help=f"default {RUNS['full']['seqs']} (--quick: {RUNS['quick']['seqs']})")
    ap.add_argument("--cps", help=f"default {RUNS['full']['cps']} (--quick: {RUNS['quick']['cps']})")
    ap.add_argument("--quick", action="store_true", help="fewer S, cp and iterations (see RUNS)")
    ap.add_argument("--heads", default="gqa", help="dense head configs: gqa (32/8), mha (32/32)")
    ap.add_argument("--layouts", default="zigzag,flat,thd,thd_zigzag")
    ap.add_argument("--mixes", default=",".join(thd_cases.MIXES))
    ap.add_argument("--thd-kernels", default="auto", help="varlen providers; auto = what kernel='auto' picks")
    ap.add_argument("--thd-comms", default="all_gather,a2a", help="all_gather, a2a, selective (as each allows)")
    ap.add_argument("--no-compiled-region", action="store_true", help="all_gather THD: skip the compiled region")
    ap.add_argument("--kernels", default="cudnn,flash")
    ap.add_argument("--iters", type=int)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--overhead-kernels", default="cudnn", help="kernels whose kernels-only time is measured")
    ap.add_argument("--out", default="bench/results/single_gpu.json")
    ap.add_argument("--streams-ab", action="store_true", help="also time the executor with one stream (A/B)")
    args = ap.parse_args()
    for name, value in RUNS["quick" if args.quick else "full"].items():
        setattr(args, name, value if getattr(args, name) is None else getattr(args, name))
    device = torch.cuda.get_device_name()
    records = json.load(open(args.out)) if os.path.exists(args.out) else []
    layouts = args.layouts.split(",")
    dense = [lay for lay in layouts if not lay.startswith("thd")]
    if len(dense) < len(layouts):
        records = thd_sweep(args, [lay for lay in layouts if lay.startswith("thd")], records, device)
    cases = [(h, int(s)) for h in args.heads.split(",") for s in args.seqs.split(",")] if dense else []
    for heads, seq in cases:
        hq, hkv = HEADS[heads]
        iters = args.iters if seq < 131072 else max(3, args.iters - 2)
        ideal_full, ideal_src = ideal_ms(seq, iters, args.warmup, hq, hkv)
        tflops = causal_flops(seq, hq) / ideal_full / 1e9
        print(f"{heads} S={seq}: single-GPU {ideal_src} fwd+bwd {ideal_full:.2f} ms ({tflops:.0f} TFLOP/s)", flush=True)
        for cp in [int(c) for c in args.cps.split(",")]:
            for layout in dense:
                for kernel in args.kernels.split(","):
                    t0 = time.time()
                    per_rank, kernels_only, one_stream = [], [], []
                    for rank in range(cp):
                        case = rank_case(layout, seq, cp, rank, hq, hkv)
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
                        hq=hq, hkv=hkv, head_dim=D, dtype=str(DTYPE), batch=1, iters=iters,
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
                        f"  {heads} {layout:7s} {kernel:6s} cp={cp} slowest rank {slow}: {per_rank[slow]:8.2f} ms, "
                        f"ideal {ideal:8.2f} ms, eff {rec['efficiency']:.3f}{extra} [{time.time() - t0:.0f}s]",
                        flush=True,
                    )
                    torch.cuda.empty_cache()


WINDOW = (4096, -1)
"""The sliding window (flash's left, causal) whose two cuDNN anchors are timed over whole documents."""


def thd_ideal(lengths: list[int], args, with_cudnn: bool) -> dict:
    """Single-GPU fwd+bwd of every document in full, timed together: FA2 varlen and, where cuDNN THD runs, its
    top-left call over the whole packed sequence and the documents cut into <= 8K chunks. The ideal is the
    fastest of them (`ideal_source`). Columns beside it: cuDNN's bottom-right band over the same whole documents,
    and both anchors under a 4K sliding window (square ranges: the same masks)."""
    fns = {"fa2": thd_cases.full_fn(lengths)}
    if with_cudnn:
        fns["cudnn_top_left"] = thd_cases.provider_full_fn(lengths, "cudnn_varlen")
        fns["cudnn_chunks_8k"] = thd_cases.chunked_full_fn(lengths, "cudnn_varlen")
        fns["cudnn_bottom_right"] = thd_cases.provider_full_fn(lengths, "cudnn_varlen", "bottom_right")
        for anchor in ("top_left", "bottom_right"):
            fns[f"cudnn_window_{anchor}"] = thd_cases.provider_full_fn(lengths, "cudnn_varlen", anchor, WINDOW)
    ms = dict(zip(fns, time_many_ms(list(fns.values()), args.iters, args.warmup)))
    sources = {
        "cudnn_top_left": "cudnn_varlen top-left, whole packed sequence",
        "cudnn_chunks_8k": "cudnn_varlen documents in <= 8K chunks",
        "fa2": "flash_varlen per-document, whole packed sequence",
    }
    best = min(sources.keys() & ms.keys(), key=ms.get)
    rec = dict(ideal_full_ms=ms[best], ideal_source=sources[best], ideal_fa2_full_ms=ms["fa2"],
               ideal_cudnn_full_ms=ms.get("cudnn_top_left"), ideal_chunked_full_ms=ms.get("cudnn_chunks_8k"),
               cudnn_bottom_right_full_ms=ms.get("cudnn_bottom_right"))  # fmt: skip
    if with_cudnn:
        anchors = {a: ms[f"cudnn_window_{a}"] for a in ("top_left", "bottom_right")}
        rec["cudnn_window_full_ms"] = {"window": list(WINDOW), **anchors}
    return rec


def _varlen_kernels(names: str) -> list[str]:
    """The varlen providers named ("auto": the one kernel='auto' picks here) that can run on this GPU."""
    cuda, out = torch.device("cuda"), []
    for name in names.split(","):
        try:
            out.append(resolve_kernel(name, cuda, DTYPE, D, varlen=True))
        except Exception as e:  # CPCompileError: the provider cannot run here (e.g. cudnn-frontend absent)
            print(f"  skipping varlen kernel {name}: {e}", flush=True)
    return list(dict.fromkeys(out))


def _thd_rank_times(layout: str, comm: str, lengths: list[int], cp: int, kernel: str, args) -> dict:
    """Per rank: the region's time, its kernel calls alone, its rank work (all_gather), a2a's eager region,
    all_gather's region compiled (thd_region.py)."""
    per_rank, kernels_only, eager, work, split, compiled = [], [], [], [], [], []
    for rank in range(1 if comm == "a2a" else cp):  # a2a: every rank the same
        if comm == "a2a":  # region compiled by Inductor (as in a model), kernel alone, eager
            case = thd_cases.a2a_rank_case(lengths, cp, layout)
            fns = [thd_cases.a2a_region_fn(*case, cp, kernel, compiled=True, layout=layout)]
            fns.append(thd_cases.a2a_kernels_only_fn(*case, cp, kernel, layout))
            fns.append(thd_cases.a2a_region_fn(*case, cp, kernel, layout=layout))
        elif comm == "selective":  # the region (eager, exchange as identity), and all_gather's kernel call
            case = thd_cases.rank_case(layout, lengths, cp, rank)
            fns = [thd_cases.selective_region_fn(layout, lengths, cp, rank, kernel)]
            fns.append(thd_cases.kernels_only_fn(*case, kernel))
            work.append(thd_cases.rank_work(case[4]))
        else:
            case = thd_cases.rank_case(layout, lengths, cp, rank)
            fns = [thd_cases.region_fn(*case, kernel), thd_cases.kernels_only_fn(*case, kernel)]
            if not args.no_compiled_region:  # the region itself, Inductor-compiled as in a model, collectives local
                fns.append(thd_region.compiled_region_fn(thd_region.rank_case(layout, lengths, cp, rank), kernel))
            if kernel == "cudnn_varlen":  # a mixed block split by shape into a top-left and a bottom-right call
                fns.append(thd_cases.split_kernels_fn(*case, kernel))
            work.append(thd_cases.rank_work(case[4]))
        region, bare, *more = time_many_ms(fns, args.iters, args.warmup)
        per_rank.append(region)
        kernels_only.append(bare)
        if comm == "all_gather" and not args.no_compiled_region:
            compiled.append(more.pop(0))
        (eager if comm == "a2a" else split).extend(more)
        del case, fns
    return dict(per_rank=per_rank, kernels_only=kernels_only, eager=eager, work=work, split=split, compiled=compiled)


def thd_sweep(args, layouts: list[str], records: list[dict], device: str) -> list[dict]:
    """THD records: per mix x S, the single-GPU ideal once, then every cp x layout x varlen kernel."""
    kernels, with_cudnn = _varlen_kernels(args.thd_kernels), _varlen_kernels("cudnn_varlen") == ["cudnn_varlen"]
    comms = args.thd_comms.split(",")
    if not set(comms) <= {"all_gather", "a2a", "selective"}:  # the comms _thd_rank_times has a rank's work for
        raise SystemExit(f"--thd-comms: all_gather, a2a or selective, not {args.thd_comms!r}")
    with thd_cases.fused_split_merge():  # cudnn_varlen's split merged as a region's graph merges it
        return _thd_sweep(args, layouts, records, device, kernels, with_cudnn, comms)


def _thd_sweep(args, layouts, records, device, kernels, with_cudnn, comms) -> list[dict]:
    """thd_sweep's loops (its arguments checked, cudnn_varlen's split merge compiled)."""
    for mix in args.mixes.split(","):
        for seq in [int(s) for s in args.seqs.split(",")]:
            lengths = thd_cases.doc_lengths(seq, mix)
            ideal = thd_ideal(lengths, args, with_cudnn)
            tflops = thd_cases.doc_flops(lengths) / ideal["ideal_full_ms"] / 1e9
            print(f"{mix} S={seq}: {len(lengths)} docs (longest {max(lengths)}), single-GPU fwd+bwd ms: "
                  f"{ {k: v for k, v in ideal.items() if k != 'ideal_source'} }; ideal {ideal['ideal_source']} "
                  f"({tflops:.0f} TFLOP/s)", flush=True)  # fmt: skip
            for cp in [int(c) for c in args.cps.split(",")]:
                # every comm asked for, on the layouts it serves (its registry entry's capabilities)
                runs = [(lay, c) for c in comms for lay in layouts if lay in get_comm(c).capabilities.packed_layouts]
                for (layout, comm), kernel in [(run, k) for run in runs for k in kernels]:
                    t0 = time.time()
                    t = _thd_rank_times(layout, comm, lengths, cp, kernel, args)
                    per_rank, bare = t["per_rank"], t["kernels_only"]
                    slow = max(range(len(per_rank)), key=lambda r: per_rank[r])
                    rec = dict(
                        layout=layout, comm=comm, kernel=kernel, S=seq, cp=cp, mix=mix,
                        slowest_rank=slow, slowest_rank_ms=per_rank[slow], ideal_ms=ideal["ideal_full_ms"] / cp,
                        efficiency=ideal["ideal_full_ms"] / cp / per_rank[slow],
                        efficiency_vs_fa2=ideal["ideal_fa2_full_ms"] / cp / per_rank[slow],
                        per_rank_ms=per_rank, kernels_only_ms=bare,
                        overhead_frac=(per_rank[slow] - bare[slow]) / per_rank[slow], **ideal,
                        n_docs=len(lengths), longest_doc=max(lengths), doc_tflops_ideal=tflops,
                        hq=HQ, hkv=HKV, head_dim=D, dtype=str(DTYPE), batch=1, iters=args.iters,
                        device=device, torch=torch.__version__, measured_at=_now(),
                    )  # fmt: skip
                    rec["kernels_prepared"] = True  # kernels alone with their metadata built beforehand
                    if kernel == "cudnn_varlen":  # which provider ran: blocks of cut pieces split from these rows
                        rec["split_min_rows"] = SPLIT_MIN_ROWS
                    if get_packed_layout(layout).carries_plan:  # thd_balanced: the data loader's cost a batch
                        rec["plan_ms"] = thd_cases.model_cu(layout, lengths, cp)[1]
                    if t["work"]:  # all_gather: ranks do unequal work; time follows work at best
                        rec["rank_work"] = t["work"]
                        rec["balance_ceiling"] = sum(t["work"]) / len(t["work"]) / max(t["work"])
                    if t["eager"]:  # the same a2a region run eagerly: every pack/unpack its own copy
                        rec["eager_region_ms"] = t["eager"][slow]
                    if t["split"]:  # the kernel calls split by shape (square top-left, rest bottom-right)
                        rec["kernels_split_ms"] = t["split"]
                    if t["compiled"]:  # all_gather's region compiled by Inductor, as in a model, per rank
                        rec["compiled_region_ms"] = t["compiled"]
                    records = [r for r in records if _key(r) != _key(rec)] + [rec]
                    with open(args.out, "w") as f:
                        json.dump(records, f, indent=1)
                    what = f"{layout:10s} {comm:10s} {kernel} cp={cp} slowest rank {slow}"
                    eff, over = rec["efficiency"], 100 * rec["overhead_frac"]
                    times = f"{per_rank[slow]:8.2f} ms, ideal {rec['ideal_ms']:8.2f} ms"
                    more = f", ceiling {rec['balance_ceiling']:.3f}" if "balance_ceiling" in rec else ""
                    more += f", eager region {t['eager'][slow]:.2f} ms" if t["eager"] else ""
                    more += f", compiled region {max(t['compiled']):.2f} ms" if t["compiled"] else ""
                    more += f", kernels {bare[slow]:.2f} / split {t['split'][slow]:.2f} ms" if t["split"] else ""
                    more += f", eff vs FA2 ideal {rec['efficiency_vs_fa2']:.3f} [{time.time() - t0:.0f}s]"
                    print(f"  {what}: {times}, eff {eff:.3f} overhead {over:.1f}%{more}", flush=True)
                    torch.cuda.empty_cache()
    return records


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())


def _key(r: dict) -> tuple:
    heads = (r.get("hq", HQ), r.get("hkv", HKV), r.get("head_dim", D))
    return (r["layout"], r["comm"], r["kernel"], r["S"], r["cp"], r.get("merge", "auto"), r.get("mix"), heads)


if __name__ == "__main__":
    main()

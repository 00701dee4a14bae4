"""Single-GPU benchmark of a CP rank's FlexAttention: the slowest rank vs the ideal (single-GPU flex time / cp).

What each rank's flex region runs, without the collective: torch.compile'd (Inductor) flex_attention forward +
backward of the rank's q buffer against the key buffer as the collective delivers it, with the mask_mod at
global positions and the block tables derived from the global BlockMask (cpcompile.layouts.flex, exactly the
region's math; the tables are derived once outside the timed call: a few small int ops per graph). Layouts /
comms: zigzag + all_gather (this rank's L tokens x all S keys, strided views of a gathered (S, 2, B, H, D)
buffer) and a2a (Hq/cp heads of all S tokens, in rank-major order). Llama3-8B attention (Hq=32, Hkv=8, D=128),
bf16, batch 1; masks: causal, and causal documents (torchtitan's document mask, a fixed mix of lengths).
CUDA events, warm-up, median. One Inductor compile per (mask, S, cp, comm): the ranks share it (their
positions and tables are inputs).

    python -m bench.flex --out bench/results/flex.json [--seqs 32768,131072] [--cps 2,8] [--masks causal,document]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from bench.common import DTYPE, HKV, HQ, D, time_ms
from cpcompile.layouts import get_layout
from cpcompile.layouts.flex import Positions, derive_tables, rank_major_chunks

DOC_MIX = (8192, 2048, 4096, 16384, 1024, 8192, 4096, 12288)
"""Document lengths, repeated to fill the sequence (the last one cut)."""
for _name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
    if hasattr(torch._dynamo.config, _name):  # one compile per shape: never fall back to eager flex (dense math)
        setattr(torch._dynamo.config, _name, 256)
COMPILED = torch.compile(flex_attention, dynamic=False)


def _docs(seq: int) -> torch.Tensor:
    ids, total, i = [], 0, 0
    while total < seq:
        n = min(DOC_MIX[i % len(DOC_MIX)], seq - total)
        ids.append(torch.full((n,), i, dtype=torch.int32))
        total, i = total + n, i + 1
    return torch.cat(ids).cuda()


def _mask_mod(kind: str, seq: int):
    if kind == "causal":
        return lambda b, h, q, k: q >= k
    docs = _docs(seq)
    return lambda b, h, q, k: (q >= k) & (docs[q] == docs[k])


def _at_global(mask_mod, qpos: Positions, kvpos: Positions):
    """The global mask_mod at the buffers' global positions (regions/flex_call.py's wrapper, closures
    instead of buffers)."""
    qt, kt = (p.table(torch.device("cuda")) if p.offset is None else None for p in (qpos, kvpos))
    return lambda b, h, q, k: mask_mod(b, h, qpos.apply(q, qt), kvpos.apply(k, kt))


def _fwd_bwd(q, k, v, dout, block_mask):
    def run():
        out = COMPILED(q, k, v, block_mask=block_mask, enable_gqa=True)
        return torch.autograd.grad(out, (q, k, v), dout)

    return run


def _rand(*shape):
    return torch.randn(*shape, device="cuda", dtype=DTYPE)


def single_gpu_ms(kind: str, seq: int, iters: int) -> tuple[float, BlockMask]:
    bm = create_block_mask(_mask_mod(kind, seq), 1, None, seq, seq, device="cuda", _compile=True)
    q, k, v = (_rand(1, h, seq, D).requires_grad_() for h in (HQ, HKV, HKV))
    return time_ms(_fwd_bwd(q, k, v, _rand(1, HQ, seq, D), bm), iters, 2), bm


def rank_ms(kind: str, seq: int, cp: int, rank: int, comm: str, global_bm: BlockMask, iters: int) -> float:
    lay = get_layout("zigzag")
    chunk = seq // cp // 2
    kvpos = Positions(tuple(rank_major_chunks(lay, cp)), chunk)
    block = tuple(global_bm.BLOCK_SIZE)
    tables = global_bm.as_tuple()[2:10]
    if comm == "all_gather":
        qpos, hq, hkv, heads = Positions(tuple(lay.rank_chunks(rank, cp)), chunk), HQ, HKV, None
        gathered = _rand(seq, 2, 1, HKV, D).requires_grad_()
        k, v = (gathered[:, i].permute(1, 2, 0, 3) for i in (0, 1))
    else:
        qpos, hq, hkv, heads = kvpos, HQ // cp, max(HKV // cp, 1), (rank * HQ // cp, HQ // cp)
        k, v = (_rand(1, hkv, seq, D).requires_grad_() for _ in range(2))
    derived = derive_tables(tables, qpos, kvpos, block, heads)
    bm = BlockMask((qpos.tokens, seq), *derived, block, _at_global(_mask_mod(kind, seq), qpos, kvpos))
    q = _rand(1, hq, qpos.tokens, D).requires_grad_()
    return time_ms(_fwd_bwd(q, k, v, _rand(1, hq, qpos.tokens, D), bm), iters, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/flex.json")
    ap.add_argument("--seqs", default="32768,65536,131072")
    ap.add_argument("--cps", default="2,4,8")
    ap.add_argument("--masks", default="causal,document")
    ap.add_argument("--comms", default="all_gather,a2a")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    rows, start = [], time.time()
    meta = dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(), shape=dict(hq=HQ, hkv=HKV, d=D))
    for kind in args.masks.split(","):
        for seq in map(int, args.seqs.split(",")):
            single, bm = single_gpu_ms(kind, seq, args.iters)
            print(f"{kind} S={seq} single-GPU flex fwd+bwd {single:.2f} ms", flush=True)
            for cp in map(int, args.cps.split(",")):
                for comm in args.comms.split(","):
                    ranks = range(cp) if comm == "all_gather" else range(1)  # a2a ranks run the same work
                    row = dict(mask=kind, seq=seq, cp=cp, comm=comm, single_ms=single, ideal_ms=single / cp)
                    try:
                        times = [rank_ms(kind, seq, cp, r, comm, bm, args.iters) for r in ranks]
                        row.update(rank_ms=times, slowest_ms=max(times), efficiency=single / cp / max(times))
                    except Exception as e:  # noqa: BLE001  (one failed row must not lose the others)
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
                    with open(args.out, "w") as f:
                        json.dump(dict(meta, rows=rows, wall_s=time.time() - start), f, indent=1)


if __name__ == "__main__":
    main()

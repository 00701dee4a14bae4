"""Where a zigzag rank's bf16 dq error comes from (GPU, one process, executor ops called directly).

Rank `--rank` of cp=`--cp` over the GPU test's gqa-b2 shape and seed: per local chunk (early, late), the max
|dq - fp64| of cpcompile's blocks on cuDNN against single-GPU bf16 SDPA (the bf16 rule's baseline) and the
rule's allowed error. Prints one line a chunk; nothing is written. Log: bench/results/logs/dq_error_probe_h200.txt.

    python -m bench.probes.dq_error_probe [--cp 4] [--rank 1] [--shape 2,4,2,384,128] [--seed 7]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import cpcompile.executor  # noqa: F401  (registers torch.ops.cpcompile.*)
from cpcompile.layouts import get_layout
from cpcompile.testing.rank_inputs import rank_inputs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--shape", default="2,4,2,384,128")
    ap.add_argument("--seed", type=int, default=7, help="tests/gpu/test_gpu.py's seed")
    args = ap.parse_args()
    b, hq, hkv, s, d = (int(x) for x in args.shape.split(","))
    g = torch.Generator().manual_seed(args.seed)
    q = torch.randn(b, hq, s, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64)
    dout = torch.randn(b, hq, s, d, generator=g, dtype=torch.float64)

    def full(dtype):
        leaves = [t.to("cuda", dtype).requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        out.backward(dout.to("cuda", dtype))
        return leaves[0].grad.double().cpu()

    exact, low = full(torch.float64), full(torch.bfloat16)
    lay = get_layout("zigzag")
    chunk = s // lay.num_chunks(args.cp)
    bf = lambda t: t.to("cuda", torch.bfloat16)  # noqa: E731
    idx, ql, ks, vs, dl, blocks = rank_inputs("zigzag", args.cp, args.rank, *(bf(t) for t in (q, k, v, dout)))
    ops = torch.ops.cpcompile
    out, lse = ops.attend_blocks(ql, ks, vs, blocks, d**-0.5, "cudnn")
    dq = ops.attend_blocks_backward(dl, ql, ks, vs, out, lse, blocks, d**-0.5, "cudnn")[0].double().cpu()
    ref, base = exact[:, :, idx], low[:, :, idx]
    for i, c in enumerate(lay.rank_chunks(args.rank, args.cp)):
        rows = slice(i * chunk, (i + 1) * chunk)
        err = (dq[:, :, rows] - ref[:, :, rows]).abs().max().item()
        base_err = (base[:, :, rows] - ref[:, :, rows]).abs().max().item()
        print(f"rank {args.rank} chunk {c}: baseline {base_err:.4g} allowed {2 * base_err + 2e-3:.4g} "
              f"cpcompile {err:.4g}")  # fmt: skip


if __name__ == "__main__":
    main()

"""Varlen probe (GPU): aten varlen op schemas, FA2 varlen vs cuDNN ragged (`_cudnn_attention_forward` with
cu_seqlens) fwd+bwd on one packed document mix, and whether their outputs agree. Decides the varlen provider.

    python -m bench.probes.varlen_probe [S=32768] [mix=docs-median-1K]

Log: bench/results/logs/varlen_probe_h200.txt.
"""

from __future__ import annotations

import sys

import torch

from bench import thd_cases
from bench.common import HKV, HQ, time_ms

aten = torch.ops.aten


def fns(q, k, v, dout, cu, longest: int, scale: float):
    """fwd+bwd closures of FA2 varlen and cuDNN ragged over the same packed documents; each returns out."""
    rng, unused = torch.zeros(2, dtype=torch.uint64, device="cuda"), q.new_empty(0)
    lens = (cu, cu, longest, longest)

    def fa2():
        out, lse, *_ = aten._flash_attention_forward(q, k, v, *lens, 0.0, True, False, scale=scale)
        aten._flash_attention_backward(dout, q, k, v, out, lse, *lens, 0.0, True, rng, unused, scale=scale)
        return out

    def cudnn():
        r = aten._cudnn_attention_forward(q, k, v, None, *lens, True, 0.0, True, False, scale=scale)
        aten._cudnn_attention_backward(dout, q, k, v, r[0], r[1], r[6], r[7], None, *lens, 0.0, True, scale=scale)
        return r[0]

    return fa2, cudnn


def main(seq: int = 32768, mix: str = "docs-median-1K") -> None:
    for op in ("_flash_attention_forward", "_flash_attention_backward", "_cudnn_attention_forward",
               "_cudnn_attention_backward"):  # fmt: skip
        print(getattr(aten, op).default._schema if hasattr(aten, op) else f"{op}: absent", flush=True)
    lengths = thd_cases.doc_lengths(seq, mix)
    cu, longest = thd_cases.cu_seqlens(lengths), max(lengths)
    flops = thd_cases.doc_flops(lengths)
    for hkv in (HKV, HQ):
        q, k, v, dout = (thd_cases.packed(seq, h) for h in (HQ, hkv, hkv, HQ))
        fa2, cudnn = fns(q, k, v, dout, cu, longest, thd_cases.SCALE)
        ms = time_ms(fa2, 7, 2)
        print(f"Hkv={hkv} S={seq} {mix}: FA2 varlen fwd+bwd {ms:.2f} ms ({flops / ms / 1e9:.0f} TFLOP/s)", flush=True)
        try:
            err = ((cudnn().float() - fa2().float()).abs().max()).item()
            ms_c = time_ms(cudnn, 7, 2)
            print(f"  cuDNN ragged fwd+bwd {ms_c:.2f} ms ({flops / ms_c / 1e9:.0f} TFLOP/s), max |out diff| {err:.3g}")
        except Exception as e:  # noqa: BLE001  report and go on: this is a probe
            print(f"  cuDNN ragged failed: {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main(*[int(a) if a.isdigit() else a for a in sys.argv[1:]])

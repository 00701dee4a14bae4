"""Dense CP blocks on cudnn-frontend's torch ops (`torch.ops.cudnn.sdpa_fwd/_bwd`, BHSD) against aten's cuDNN
SDPA ops (the `cudnn` provider): which is faster, and in what dtype each backward returns dq/dk/dv (a kernel
that returned fp32 partials would spare CP the bf16 rounding of every partial; see docs/architecture.md).

Per head config (gqa: Llama3-8B 32/8, mha: 32/32, mla: 32/32 with q/k 192, v 128) and local length L, the two
block kinds a rank runs: a causal square (L x L, contiguous K/V) and an unmasked rectangle (L x 2L, K/V strided
views of a (2L, slots, 2, B, H, D) all-gather buffer, as the executor passes them); fwd+bwd, CUDA events, median.
A provider that refuses a case records its error. Needs nvidia-cudnn-frontend >= 1.32 (pip install 'cpcompile[cudnn]').

    python -m bench.probes.cudnn_fe_probe --lengths 4096,16384 --out bench/results/cudnn_fe_probe.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

from bench.common import DTYPE, time_many_ms
from cpcompile.kernels import get_kernel

HEADS = {"gqa": (32, 8, 128, 128), "mha": (32, 32, 128, 128), "mla": (32, 32, 192, 128)}
"""name: (q heads, kv heads, q/k head dim, v head dim)."""


def _bshd(s: int, h: int, d: int) -> torch.Tensor:
    return torch.randn(1, s, h, d, device="cuda", dtype=DTYPE).transpose(1, 2)


def block_inputs(kind: str, length: int, hq: int, hkv: int, d: int, dv: int):
    """q, k, v, dout of one block: "square" (causal, local K/V) or "rect" (unmasked, gathered K/V views)."""
    q, dout = _bshd(length, hq, d), _bshd(length, hq, dv)
    if kind == "square":
        return q, _bshd(length, hkv, d), _bshd(length, hkv, dv), dout
    width = d if d == dv else d + dv  # K and V stacked, or side by side (MLA), as executor.packed_kv packs them
    shape = (2 * length, 2, 2, 1, hkv, d) if d == dv else (2 * length, 2, 1, hkv, width)
    gathered = torch.randn(shape, device="cuda", dtype=DTYPE)
    slot = gathered[:, 0]
    k, v = (slot[:, 0], slot[:, 1]) if d == dv else (slot[..., :d], slot[..., d:])
    return q, k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), dout


def aten_fn(q, k, v, dout, causal: bool, scale: float):
    impl = get_kernel("cudnn")

    def run():
        out, lse = impl.forward(q, k, v, causal, scale)
        return impl.backward(dout, q, k, v, out, lse, causal, scale)

    return run


def frontend_fn(q, k, v, dout, causal: bool, scale: float):
    import cudnn.sdpa.fwd.torch_op  # noqa: F401  (registers torch.ops.cudnn.sdpa_fwd / sdpa_bwd)

    ops = torch.ops.cudnn

    def run():
        out, stats = ops.sdpa_fwd(q, k, v, scale, is_causal=causal, return_lse=True)
        grad = dout if dout.stride() == out.stride() else torch.empty_like(out).copy_(dout)
        return ops.sdpa_bwd(grad, q, k, v, out, stats, scale, is_causal=causal)

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="4096,16384", help="local lengths L (a rank's q rows)")
    ap.add_argument("--heads", default="gqa,mha,mla")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default="bench/results/cudnn_fe_probe.json")
    args = ap.parse_args()
    records = []
    for name in args.heads.split(","):
        hq, hkv, d, dv = HEADS[name]
        for length in [int(x) for x in args.lengths.split(",")]:
            for kind in ("square", "rect"):
                causal, scale = kind == "square", 1 / math.sqrt(d)
                q, k, v, dout = block_inputs(kind, length, hq, hkv, d, dv)
                rec = dict(heads=name, hq=hq, hkv=hkv, d_qk=d, d_v=dv, L=length, kind=kind, causal=causal)
                fns, grads = {}, {}
                for provider, make in (("aten_cudnn", aten_fn), ("frontend", frontend_fn)):
                    try:
                        fn = make(q, k, v, dout, causal, scale)
                        grads[provider] = fn()
                        fns[provider] = fn
                        rec[f"{provider}_grad_dtypes"] = [str(g.dtype) for g in grads[provider]]
                    except Exception as e:  # refused shape / stride / missing package: record why
                        rec[f"{provider}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                times = time_many_ms(list(fns.values()), args.iters, args.warmup) if fns else []
                for provider, ms in zip(fns, times):
                    rec[f"{provider}_ms"] = ms
                if len(grads) == 2:  # the two should agree to bf16 level
                    diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(*grads.values())]
                    rec["max_abs_diff_dq_dk_dv"] = diffs
                    rec["frontend_speedup"] = rec["aten_cudnn_ms"] / rec["frontend_ms"]
                rec.update(device=torch.cuda.get_device_name(), torch=torch.__version__, measured_at=_now())
                records.append(rec)
                shown = {k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in rec.items() if k.endswith("_ms")}
                errors = {k: v for k, v in rec.items() if k.endswith("_error")}
                print(f"{name} L={length} {kind}: {shown} speedup {rec.get('frontend_speedup', '-')} "
                      f"grads {rec.get('aten_cudnn_grad_dtypes')} / {rec.get('frontend_grad_dtypes')} "
                      f"diff {rec.get('max_abs_diff_dq_dk_dv')} {errors or ''}", flush=True)  # fmt: skip
                del q, k, v, dout, fns, grads
                torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())


if __name__ == "__main__":
    main()

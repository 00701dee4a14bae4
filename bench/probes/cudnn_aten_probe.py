"""Can aten's cuDNN ragged ops replace the cudnn-frontend op behind `cudnn_varlen`? Packed causal fwd+bwd at the
Llama3-8B attention shape (32 q / 8 kv heads, head dim 128, bf16), q/k/v sharing int32 cu_seqlens (whole documents:
square, so top-left = bottom-right), per (T, mix) case, with: flash_varlen and cudnn_varlen, cpcompile's providers as
the executor calls them (tiled, square, `prepared` once per batch, outside the timed call); aten_cudnn,
`aten._cudnn_attention_forward/_backward` with 8-head k/v (native GQA?) and the LSE taken to cpcompile's (Hq, Tq)
and back as the executor would; aten_cudnn_expand, the same with k/v repeat_interleave'd to 32 heads, dk/dv summed.

Per row: max |error| of out/lse/dq/dk/dv against flash_varlen and cudnn_varlen (flagged above 2e-2), the LSE
shape/strides returned, host ms of one fwd+bwd (and fwd alone) behind a long GPU sleep and the GPU ms after that
head start (bench.common.host_and_gpu_ms), profiler kernel ms, synced wall ms of one call, back-to-back pace, and
the first call's synced ms (graph builds). aten calls bind by schema argument names (ALIASES: torch 2.11 and 2.13
spell them alike); the LSE layout is detected at run time (torch versions differ: (T, Hq, 1) or (Hq, T)).

    python -m bench.probes.cudnn_aten_probe [--totals 4096,16384] [--mixes docs-1K,one-doc] [--out f.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import time
import traceback
from functools import partial

import torch

from bench.common import DTYPE, HKV, HQ, D, back_to_back_ms, host_and_gpu_ms
from cpcompile.kernels import get_varlen_kernel

TOL = 2e-2
METHODS = ("flash_varlen", "cudnn_varlen", "aten_cudnn", "aten_cudnn_expand")
OPS = ("_cudnn_attention_forward", "_cudnn_attention_backward", "_flash_attention_forward")
ALIASES = {"cumulative_sequence_length_q": "cum_seq_q", "cumulative_sequence_length_k": "cum_seq_k",
           "cumulative_sequence_length_kv": "cum_seq_k", "cum_seq_kv": "cum_seq_k", "max_seqlen_batch_q": "max_q",
           "max_seqlen_batch_k": "max_k", "max_seqlen_batch_kv": "max_k", "max_kv": "max_k"}  # fmt: skip
# ^ schema argument name -> the name this probe supplies it under (other torch versions' spellings)
_REQUIRED = object()
DEVICE = "cuda"  # "cpu" only to smoke-test the bookkeeping with stand-in kernels


def doc_lengths(total: int, mix: str, seed: int = 0) -> list[int]:
    """Document lengths: one-doc [total]; docs-1K uniform in 512..1536 (multiples of 16), the last filling T."""
    if mix == "one-doc":
        return [total]
    assert mix == "docs-1K", mix
    rng, lengths, left = random.Random(seed), [], total
    while left:
        n = min(left, rng.randrange(512, 1537, 16))
        n = left if left - n < 256 else n
        lengths.append(n)
        left -= n
    return lengths


def bind(name: str):
    """call(values) -> the op's outputs, its arguments taken by schema name from `values` (ALIASES for other
    spellings; schema defaults where absent). Raises a clear error for a required argument this probe lacks."""
    op = getattr(torch.ops.aten, name).default
    plan = [(a.name, ALIASES.get(a.name, a.name), a.kwarg_only, a.default_value if a.has_default_value() else _REQUIRED)
            for a in op._schema.arguments]  # fmt: skip

    def call(values: dict):
        args, kwargs = [], {}
        for arg, key, kw_only, default in plan:
            if key not in values and default is _REQUIRED:
                raise TypeError(f"no value for required argument {arg!r} of {op._schema}")
            if kw_only:
                if key in values:
                    kwargs[arg] = values[key]
            else:
                args.append(values.get(key, default))
        return op(*args, **kwargs)

    return call


def lse_layout(lse: torch.Tensor, hq: int, t: int) -> str:
    """The aten op's LSE layout: "HT" (FA2's, cpcompile's), "TH1" (cuDNN's token-major stats) or "TH"."""
    for layout, shape in (("HT", (hq, t)), ("TH1", (t, hq, 1)), ("TH", (t, hq))):
        if tuple(lse.shape) == shape:
            return layout
    raise ValueError(f"unknown LSE layout {tuple(lse.shape)} strides {lse.stride()} for Hq={hq}, T={t}")


def to_ours(lse: torch.Tensor, layout: str) -> torch.Tensor:
    """The op's LSE as cpcompile's (Hq, Tq) (a view)."""
    return {"HT": lambda: lse, "TH1": lambda: lse.squeeze(-1).t(), "TH": lambda: lse.t()}[layout]()


def from_ours(lse: torch.Tensor, layout: str) -> torch.Tensor:
    """cpcompile's (Hq, Tq) LSE (the final merged one, any strides) as the op's backward takes it (contiguous)."""
    if layout == "HT":
        return lse.contiguous()
    t_major = lse.t().contiguous()
    return t_major.unsqueeze(-1) if layout == "TH1" else t_major


def kernel_method(name: str, q, k, v, dout, cu, bound: int, scale: float, info: dict):
    """(fwd, step) of a cpcompile varlen provider on one whole-sequence block, `prepared` made once up front."""
    impl = get_varlen_kernel(name)
    if reason := impl.supports(q.device, q.dtype):
        raise RuntimeError(reason)
    ranges = torch.stack((cu[:-1], cu[1:], cu[:-1], cu[1:])).long()
    kw = dict(tiled=True, square=True)
    prepared = impl.prepare(ranges, q.shape[0], k.shape[0], bound, **kw)
    args = (ranges, bound, bound, True, scale)

    def fwd():
        return impl.forward(q, k, v, *args, **kw, prepared=prepared)

    def step():
        out, lse = fwd()
        return (out, lse, *impl.backward(dout, q, k, v, out, lse, *args, **kw, prepared=prepared))

    return fwd, step


def aten_method(expand: bool, q, k, v, dout, cu, bound: int, scale: float, info: dict):
    """(fwd, step) of aten's cuDNN ragged ops; `expand`: k/v repeated to Hq heads, dk/dv summed back (fp32)."""
    fwd_op, bwd_op = bind("_cudnn_attention_forward"), bind("_cudnn_attention_backward")
    hkv, group = k.shape[1], q.shape[1] // k.shape[1]
    base = dict(attn_bias=None, cum_seq_q=cu, cum_seq_k=cu, max_q=bound, max_k=bound, dropout_p=0.0,
                is_causal=True, scale=scale)  # fmt: skip

    def fwd():
        kk, vv = (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)) if expand else (k, v)
        values = dict(base, query=q, key=kk, value=vv, compute_log_sumexp=True, return_debug_mask=False)
        return fwd_op(values), kk, vv

    def step():
        res, kk, vv = fwd()
        out, lse = res[0], res[1]
        if "lse_layout" not in info:  # first call: what the op returns
            info.update(lse_shape=list(lse.shape), lse_stride=list(lse.stride()), lse_dtype=str(lse.dtype),
                        lse_layout=lse_layout(lse, q.shape[1], q.shape[0]))  # fmt: skip
        layout = info["lse_layout"]
        ours = to_ours(lse, layout)  # what the executor would merge and hand back
        values = dict(base, grad_out=dout, query=q, key=kk, value=vv, out=out, logsumexp=from_ours(ours, layout),
                      philox_seed=res[6], philox_offset=res[7])  # fmt: skip
        dq, dk, dv = bwd_op(values)
        if expand:
            dk, dv = (g.unflatten(1, (hkv, group)).sum(2, dtype=torch.float32).to(g.dtype) for g in (dk, dv))
        return out, ours, dq, dk, dv

    return fwd, step


def synced_ms(fn, reps: int = 10) -> float:
    """Median wall ms of one call from an idle GPU to a device sync (launch latency and host time included)."""
    return statistics.median(_synced_call(fn)[1] for _ in range(reps))


def _synced_call(fn):
    """(fn's result, wall ms from an idle GPU to a device sync after it)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = fn()
    torch.cuda.synchronize()
    return res, (time.perf_counter() - t0) * 1e3


def profiled_ms(fn) -> float:
    """GPU busy ms of one call by the profiler: the device time of its kernels and copies, summed."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return sum(e.self_device_time_total for e in prof.key_averages() if e.device_type == cuda) / 1e3


def errors(res, ref) -> dict:
    names = ("out", "lse", "dq", "dk", "dv")
    return {n: (a.float() - b.float()).abs().max().item() for n, a, b in zip(names, res, ref)}


def run_case(total: int, mix: str, methods, reps: int) -> list[dict]:
    lengths = doc_lengths(total, mix)
    bound, scale = max(lengths), 1 / math.sqrt(D)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v, dout = (torch.randn(total, h, D, device=DEVICE, dtype=DTYPE, generator=g) for h in (HQ, HKV, HKV, HQ))
    base = dict(T=total, mix=mix, documents=len(lengths), max_doc=bound, hq=HQ, hkv=HKV, head_dim=D)
    records, results, steps = {}, {}, {}
    for name in methods:
        rec = records[name] = dict(base, method=name)
        try:
            info: dict = {}
            make = partial(aten_method, name == "aten_cudnn_expand") if "aten" in name else partial(kernel_method, name)
            fwd, step = make(q, k, v, dout, cu, bound, scale, info)
            res, rec["first_call_ms"] = _synced_call(step)  # cuDNN graphs built here
            results[name] = res
            rec.update(lse_shape=list(res[1].shape), lse_stride=list(res[1].stride()), lse_layout="HT")
            rec.update(info, grad_dtypes=[str(t.dtype) for t in res[2:]])  # aten: the op's own LSE
            steps[name] = (fwd, step)
        except Exception as e:  # noqa: BLE001  a probe: record why and go on
            traceback.print_exc()
            rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
    for name, res in results.items():
        rec = records[name]
        for other in ("flash_varlen", "cudnn_varlen"):
            if other != name and other in results:
                rec[f"err_vs_{other}"] = errors(res, results[other])
        ref = rec.get("err_vs_flash_varlen") or rec.get("err_vs_cudnn_varlen") or {}
        rec["mismatch"] = any(not (e <= TOL) for e in ref.values())  # NaN counts as a mismatch
    for rec in records.values():
        rec["lse_conversion_needed"] = rec["lse_layout"] != "HT" if "lse_layout" in rec else None
    if "aten_cudnn" in records:  # native GQA works / fails where expanded heads work / unknown
        native, expanded = (name in results and not records[name]["mismatch"] for name in METHODS[2:])
        records["aten_cudnn"]["gqa_native"] = True if native else (False if expanded else None)
    results.clear()
    for name, (fwd, step) in steps.items():
        rec = records[name]
        try:
            host, gpu = host_and_gpu_ms(step, reps)
            fwd_host, fwd_gpu = host_and_gpu_ms(fwd, reps)
            rec.update(host_ms=host, gpu_ms=gpu, fwd_host_ms=fwd_host, fwd_gpu_ms=fwd_gpu,
                       gpu_ms_has_host_gaps=host > 90, synced_ms=synced_ms(step),
                       back_to_back_ms=back_to_back_ms(step, 10), profiled_gpu_ms=profiled_ms(step))  # fmt: skip
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rec["timing_error"] = f"{type(e).__name__}: {str(e)[:500]}"
    for rec in records.values():
        for key, val in rec.items():
            if isinstance(val, float):
                rec[key] = round(val, 4)
        _print_row(rec)
    return list(records.values())


def _print_row(rec: dict) -> None:
    head = f"T={rec['T']} {rec['mix']} ({rec['documents']} docs) {rec['method']:<17}"
    errs = rec.get("err_vs_flash_varlen") or rec.get("err_vs_cudnn_varlen") or {}
    if "error" in rec:
        return print(f"{head} ERROR {rec['error'][:300]}", flush=True)
    shown = " ".join(f"{n} {e:.1e}" for n, e in errs.items())
    keys = ("host_ms", "fwd_host_ms", "gpu_ms", "profiled_gpu_ms", "synced_ms", "back_to_back_ms", "first_call_ms")
    times = " | ".join(f"{k[:-3]} {rec[k]:.3f}" for k in keys if k in rec)
    print(f"{head} {times} | lse {rec.get('lse_shape')} {rec.get('lse_stride')} | err {shown or '-'}"
          f"{' MISMATCH' if rec.get('mismatch') else ''}{' ' + rec['timing_error'] if 'timing_error' in rec else ''}",
          flush=True)  # fmt: skip


def environment() -> dict:
    env = dict(torch=torch.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(), schemas={},
               device=torch.cuda.get_device_name() if torch.cuda.is_available() else None)  # fmt: skip
    for op in OPS:
        try:
            env["schemas"][op] = str(getattr(torch.ops.aten, op).default._schema)
        except Exception as e:  # noqa: BLE001
            env["schemas"][op] = f"absent ({type(e).__name__}: {e})"
    return env


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--totals", default="4096,16384", help="packed tokens T per case")
    p.add_argument("--mixes", default="docs-1K,one-doc", help="docs-1K (~1K-token documents), one-doc (one of T)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--reps", type=int, default=5, help="runs behind a GPU sleep per host/GPU time (median)")
    p.add_argument("--out", default=None, help="write {env, records} JSON here")
    args = p.parse_args()
    env = environment()
    for op, schema in env["schemas"].items():
        print(f"{op}: {schema}", flush=True)
    if not torch.cuda.is_available():
        print(f"cudnn_aten_probe: CUDA is not available (torch {torch.__version__}); nothing measured.", flush=True)
        return
    print(f"torch {env['torch']} CUDA {env['cuda']} cuDNN {env['cudnn']} on {env['device']}", flush=True)
    records = []
    for total in (int(t) for t in args.totals.split(",")):
        for mix in args.mixes.split(","):
            records += run_case(total, mix, args.methods.split(","), args.reps)
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(env=env, records=records), f, indent=1)


if __name__ == "__main__":
    main()

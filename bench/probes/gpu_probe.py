"""GPU probe: op schemas, LSE shapes, GQA and strided-input support of each CUDA provider, Triton merge check.

Prints facts used by the providers (run on the GPU machine; every check compares with an fp32 reference).

    python -m bench.probes.gpu_probe          # schemas, LSE shapes, provider checks, merge check and timing
    python -m bench.probes.gpu_probe merge    # the Triton merge tile sweep alone
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from bench.common import time_ms
from cpcompile.executor import merge_triton, merged, summed
from cpcompile.kernels import get_kernel
from cpcompile.kernels.cudnn import CuDNNKernel

aten = torch.ops.aten


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def reference(q, k, v, dout, causal, scale):
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale, enable_gqa=True)
    out.backward(dout.float())
    lse = torch.logsumexp(
        (leaves[0] @ leaves[1].repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2)) * scale
        + (torch.full((q.shape[2], k.shape[2]), float("-inf"), device="cuda").triu(1) if causal else 0),
        dim=-1,
    )
    return out.detach(), lse.detach(), *[t.grad for t in leaves]


def check(name, impl, q, k, v, dout, causal):
    scale = q.shape[-1] ** -0.5
    try:
        out, lse = impl.forward(q, k, v, causal, scale)
        dq, dk, dv = impl.backward(dout, q, k, v, out, lse, causal, scale)
    except Exception as e:  # report, keep probing
        print(f"  {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
        return
    ref = reference(q, k, v, dout, causal, scale)
    errs = [rel(a, b) for a, b in zip((out, lse, dq, dk, dv), ref)]
    ok = all(e < 2e-2 for e in errs)
    print(f"  {name}: {'OK ' if ok else 'BAD'} rel err out/lse/dq/dk/dv " + " ".join(f"{e:.1e}" for e in errs)
          + f" | out strides {tuple(out.stride())} lse {tuple(lse.shape)} dk strides {tuple(dk.stride())}")  # fmt: skip


def merge_outputs(out, lse, outs, lses, fused: bool = True) -> None:
    """The LSE merge into out/lse: merge_triton's kernel (fused), else the executor's pointwise ops."""
    if fused:
        merge_triton.merge(out, lse, outs, lses)
        return
    o, l = merged(outs, lses, out.dtype)
    out.copy_(o)
    lse.copy_(l)


def sum_into(out, parts, fused: bool = True) -> None:
    if fused:
        merge_triton.add(out, parts)
    else:
        out.copy_(summed(parts, out.dtype))


def merge_sweep():
    """Time the fused merge/add at a zigzag rank's size for a few tile configs (and the torch fallback)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    big = [torch.randn(1, 8192, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
           for _ in range(3)]  # fmt: skip
    bl = [torch.randn(1, 32, 8192, device="cuda", generator=g) for _ in range(3)]
    o, lo = torch.empty_like(big[0]), torch.empty(1, 32, 8192, device="cuda")
    for rows_x_dim in (4096, 8192, 16384):
        for warps in (4, 8):
            merge_triton.CONFIG.update(rows_x_dim=rows_x_dim, num_warps=warps)
            res = []
            for k in (2, 3):
                ms = time_ms(lambda k=k: merge_outputs(o, lo, big[:k], bl[:k]), 30, 3)
                res.append(f"merge{k} {ms:.3f} ms {(k + 1) * big[0].numel() * 2 / ms / 1e6:.0f} GB/s")
            ms = time_ms(lambda: sum_into(o, big), 30, 3)
            res.append(f"add3 {ms:.3f} ms {4 * big[0].numel() * 2 / ms / 1e6:.0f} GB/s")
            print(f"tile {rows_x_dim} warps {warps}: " + ", ".join(res))
    res = [
        f"merge{k} {time_ms(lambda k=k: merge_outputs(o, lo, big[:k], bl[:k], False), 30, 3):.3f} ms" for k in (2, 3)
    ]
    print("torch ops: " + ", ".join(res) + f", add3 {time_ms(lambda: sum_into(o, big, False), 30, 3):.3f} ms")


def main():
    if sys.argv[1:] == ["merge"]:
        merge_sweep()
        return
    print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name())
    try:
        import triton

        print("triton", triton.__version__)
    except ImportError:
        print("triton missing")
    ops = ["_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"]
    ops += ["_flash_attention_forward", "_flash_attention_backward", "_scaled_dot_product_flash_attention_backward"]
    for op in ops:
        print(getattr(aten, op).default._schema)
    q0 = torch.randn(1, 32, 512, 128, device="cuda", dtype=torch.bfloat16)
    raw = aten._scaled_dot_product_cudnn_attention(q0, q0, q0, None, True, 0.0, True, False)
    print("cudnn raw lse", tuple(raw[1].shape), tuple(raw[1].stride()), "out strides", tuple(raw[0].stride()))
    raw = aten._scaled_dot_product_flash_attention(q0, q0, q0, 0.0, True, False)
    print("flash raw lse", tuple(raw[1].shape), tuple(raw[1].stride()))
    g = torch.Generator(device="cuda").manual_seed(0)

    def t(b, s, h, d=128):
        return torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)

    providers = {
        "cudnn": get_kernel("cudnn"),
        "cudnn_expand": CuDNNKernel(expand_kv=True),
        "flash": get_kernel("flash"),
    }
    for label, (sq, sk, causal) in {"square causal": (512, 512, True), "rect unmasked": (384, 1152, False)}.items():
        q, dout = t(1, sq, 32), t(1, sq, 32)
        k, v = t(1, sk, 8), t(1, sk, 8)
        buf = torch.randn(sk, 2, 2, 1, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        gk, gv = buf[:, 1, 0].permute(1, 2, 0, 3), buf[:, 1, 1].permute(1, 2, 0, 3)
        for name, impl in providers.items():
            print(label)
            check(f"{name} GQA bshd", impl, q, k, v, dout, causal)
            check(f"{name} GQA gathered-strided kv", impl, q, gk, gv, dout, causal)
            qb = t(1, 2 * sq, 32)
            qv = qb.as_strided((2, 32, sq, 128), (sq * 32 * 128, 128, 32 * 128, 1))
            kb = t(1, 2 * sq, 8)
            kvv = kb.as_strided((2, 8, sq, 128), (sq * 8 * 128, 128, 8 * 128, 1))
            if sq == sk:
                check(f"{name} batched-view", impl, qv, kvv, kvv, qv, causal)
    # merge: Triton vs torch
    parts = [t(1, 1000, 32) for _ in range(3)]
    lses = [torch.randn(1, 32, 1000, device="cuda") * 3 for _ in range(3)]
    for k in (2, 3):
        o1, l1 = torch.empty_like(parts[0]), torch.empty(1, 32, 1000, device="cuda")
        o2, l2 = torch.empty_like(parts[0]), torch.empty(1, 32, 1000, device="cuda")
        merge_outputs(o1, l1, parts[:k], lses[:k])
        merge_outputs(o2, l2, parts[:k], lses[:k], False)
        print(f"merge k={k}: triton vs torch out max diff {(o1.float() - o2.float()).abs().max().item():.2e}"
              f" lse {(l1 - l2).abs().max().item():.2e}")  # fmt: skip
    big = [t(1, 8192, 32) for _ in range(3)]
    bl = [torch.randn(1, 32, 8192, device="cuda") for _ in range(3)]
    o, lo = torch.empty_like(big[0]), torch.empty(1, 32, 8192, device="cuda")
    for k in (2, 3):
        ms = time_ms(lambda k=k: merge_outputs(o, lo, big[:k], bl[:k]), 20, 3)
        ms_t = time_ms(lambda k=k: merge_outputs(o, lo, big[:k], bl[:k], False), 20, 3)
        gb = (k + 1) * big[0].numel() * 2 / 1e9
        print(f"merge k={k} 8192x32x128: triton {ms:.3f} ms ({gb / ms:.0f} GB/s min traffic), torch {ms_t:.3f} ms")


if __name__ == "__main__":
    main()

"""Can flash-linear-attention's Gated DeltaNet kernels train here? One chunk_gated_delta_rule forward and backward
(bf16, an initial state given and the final state asked for, as state passing would call it) for value widths Dv
and Dv + Dk (state passing's widened values), and a packed (cu_seqlens) forward; prints the versions and what ran.

    python -m bench.probes.fla_gdn

On the H200 (torch 2.11.0+cu130, triton 3.6.0, fla-core 0.6.0, 2026-12-02) the backward refused: "Triton >= 3.4.0
and < 3.7.1 on Hopper GPUs produces incorrect results for gated chunk_bwd_dqkwg (see #640)". fla's GPU path is
blocked on that device until its Triton is >= 3.7.1 (or tilelang is installed).
"""

from __future__ import annotations

import time

import torch


def _inputs(length: int, heads: int, dk: int, dv: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    q = torch.randn(1, length, heads, dk, device=dev, dtype=bf16, requires_grad=True)
    k = torch.nn.functional.normalize(torch.randn(1, length, heads, dk, device=dev), dim=-1).to(bf16).requires_grad_()
    v = torch.randn(1, length, heads, dv, device=dev, dtype=bf16, requires_grad=True)
    g = torch.nn.functional.logsigmoid(torch.randn(1, length, heads, device=dev)).requires_grad_()
    beta = torch.rand(1, length, heads, device=dev, dtype=bf16).requires_grad_()
    return q, k, v, g, beta


def main() -> None:
    import triton

    print("torch", torch.__version__, "triton", triton.__version__)
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        print("fla not importable:", e)
        return
    print("fla", fla.__version__)
    length, heads, dk = 8192, 16, 128
    for dv in (dk, 2 * dk):
        q, k, v, g, beta = _inputs(length, heads, dk, dv)
        h0 = torch.randn(1, heads, dk, dv, device="cuda", requires_grad=True)
        try:
            torch.cuda.synchronize()
            start = time.perf_counter()
            o, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
            (o.float().sum() + final.sum()).backward()
            torch.cuda.synchronize()
            print(f"Dv={dv}: forward+backward ran in {(time.perf_counter() - start) * 1e3:.1f} ms (first call)")
        except RuntimeError as e:
            print(f"Dv={dv}: refused: {str(e)[:300]}")
    q, k, v, g, beta = (t.detach() for t in _inputs(length, heads, dk, dk))
    cu = torch.tensor([0, 3000, length], device="cuda")
    try:
        _, final = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)
        print("packed forward ran, final states", tuple(final.shape))
    except RuntimeError as e:
        print(f"packed forward refused: {str(e)[:300]}")


if __name__ == "__main__":
    main()

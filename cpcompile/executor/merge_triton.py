"""Fused Triton LSE merge of up to four partial attention outputs (CUDA only).

Launched through `wrap_triton`, so a trace records the launch (accumulate.py's ops) and Inductor runs it from its
own code; called eagerly it simply launches."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.library import wrap_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _merge_kernel(
        o0, o1, o2, o3, l0, l1, l2, l3, out, lout, H, N, D, S1, N1,
        o0b, o0h, o0s, o1b, o1h, o1s, o2b, o2h, o2s, o3b, o3h, o3s,
        l0b, l0h, l0s, l1b, l1h, l1s, l2b, l2h, l2s, l3b, l3h, l3s,
        ob, oh, osq, lb, lh, lsq,
        K: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        b = (pid // H).to(tl.int64)
        h = (pid % H).to(tl.int64)
        rows = (tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        rmask = rows < N
        mask = rmask[:, None] & (cols[None, :] < D)
        r2, c2 = rows[:, None], cols[None, :]
        p0 = tl.load(o0 + b * o0b + h * o0h + r2 * o0s + c2, mask=mask, other=0.0).to(tl.float32)
        # partial 1 covers rows [S1, S1 + N1) only: elsewhere it reads as no keys (0, lse -inf), an exact no-op
        r1 = rows - S1
        m1 = rmask & (r1 >= 0) & (r1 < N1)
        mask1 = m1[:, None] & (cols[None, :] < D)
        p1 = tl.load(o1 + b * o1b + h * o1h + r1[:, None] * o1s + c2, mask=mask1, other=0.0).to(tl.float32)
        if K > 2:
            p2 = tl.load(o2 + b * o2b + h * o2h + r2 * o2s + c2, mask=mask, other=0.0).to(tl.float32)
        if K > 3:
            p3 = tl.load(o3 + b * o3b + h * o3h + r2 * o3s + c2, mask=mask, other=0.0).to(tl.float32)
        if WEIGHTED:
            ninf = float("-inf")
            x0 = tl.load(l0 + b * l0b + h * l0h + rows * l0s, mask=rmask, other=ninf).to(tl.float32)
            x1 = tl.load(l1 + b * l1b + h * l1h + r1 * l1s, mask=m1, other=ninf).to(tl.float32)
            m = tl.maximum(x0, x1)
            if K > 2:
                x2 = tl.load(l2 + b * l2b + h * l2h + rows * l2s, mask=rmask, other=ninf).to(tl.float32)
                m = tl.maximum(m, x2)
            if K > 3:
                x3 = tl.load(l3 + b * l3b + h * l3h + rows * l3s, mask=rmask, other=ninf).to(tl.float32)
                m = tl.maximum(m, x3)
            m = tl.where(m == ninf, 0.0, m)
            w0 = tl.exp(x0 - m)
            w1 = tl.exp(x1 - m)
            s = w0 + w1
            if K > 2:
                w2 = tl.exp(x2 - m)
                s += w2
            if K > 3:
                w3 = tl.exp(x3 - m)
                s += w3
            inv = tl.where(s > 0, 1.0 / s, 0.0)
            acc = p0 * (w0 * inv)[:, None] + p1 * (w1 * inv)[:, None]
            if K > 2:
                acc += p2 * (w2 * inv)[:, None]
            if K > 3:
                acc += p3 * (w3 * inv)[:, None]
            lse = tl.where(s > 0, m + tl.log(s), ninf)
            tl.store(lout + b * lb + h * lh + rows * lsq, lse, mask=rmask)
        else:
            acc = p0 + p1
            if K > 2:
                acc += p2
            if K > 3:
                acc += p3
        tl.store(out + b * ob + h * oh + r2 * osq + c2, acc.to(out.dtype.element_ty), mask=mask)


CONFIG = {"rows_x_dim": 8192, "num_warps": 4}
"""Tile size (rows * padded head dim) and warps of one program; see bench/probes/gpu_probe.py for the sweep."""


def merge(
    out: torch.Tensor, lse: torch.Tensor, outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor], start: int = 0
) -> None:
    """dense_run.merged on CUDA in one pass, into out/lse; 2 <= len(outs) <= 4, unit last stride everywhere.
    outs[1] / lses[1] may cover only rows [start, start + their length) of the others: rows outside are merged as
    if it had no keys there (the others' merge, exactly), so a partial over some rows is never padded."""
    _launch(out, lse, outs, lses, weighted=True, start=start)


def add(out: torch.Tensor, parts: Sequence[torch.Tensor], start: int = 0) -> None:
    """out = sum(parts) over (B, H, n, D) in fp32 registers, rounded once; 2 <= len(parts) <= 4; parts[1] may
    cover only rows [start, start + its length) (zeros elsewhere)."""
    dummy = out.new_empty(out.shape[:-1], dtype=torch.float32)
    _launch(out, dummy, parts, [dummy] * len(parts), weighted=False, start=start)


def _launch(out, lse, outs, lses, weighted: bool, start: int = 0) -> None:
    k = len(outs)
    os_ = list(outs) + [outs[0]] * (4 - k)
    ls_ = list(lses) + [lses[0]] * (4 - k)
    bsz, heads, n, d = out.shape
    o_strides = [s for o in os_ for s in o.stride()[:3]]
    l_strides = [s for x in ls_ for s in x.stride()]
    block_d = triton.next_power_of_2(d)
    block_m = max(16, CONFIG["rows_x_dim"] // block_d)
    grid = (bsz * heads, triton.cdiv(n, block_m))
    wrap_triton(_merge_kernel)[grid](  # wrap_triton: traceable, so Inductor launches it
        *os_, *ls_, out, lse, heads, n, d, start, outs[1].shape[2], *o_strides, *l_strides, *out.stride()[:3],
        *lse.stride(),
        K=k, WEIGHTED=weighted, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=CONFIG["num_warps"],
    )  # fmt: skip

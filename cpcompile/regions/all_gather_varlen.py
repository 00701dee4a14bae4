"""The all-gather CP region for packed documents (varlen_attn under the thd / thd_zigzag layouts)."""

from __future__ import annotations

import torch

from ..comm import all_gather_dim0 as _gather
from ..comm import grad_reduce_dtype
from ..comm import reduce_scatter_dim0 as _reduce
from ..layouts.thd import get_packed_layout
from ..varlen_executor import encode_blocks  # (importing it registers torch.ops.cpcompile.attend_varlen_blocks)


class _GatherAttend(torch.autograd.Function):
    """All-gather packed K/V (tokens on dim 0), run the varlen blocks; backward keeps dK/dV in fp32 from the
    kernels through the reduce-scatter and rounds once, as a single-device kernel does (a gather and an
    attention op with separate autograd would round each rank's partial dK/dV to the input dtype first)."""

    @staticmethod
    def forward(ctx, q, k, v, spec, scale, kernel, group_name, *ranges):
        fused = k.shape == v.shape and k.dtype == v.dtype
        if fused:
            gathered = _gather(torch.stack((k, v), dim=1), group_name)  # (T, 2, Hkv, D): one collective
            gk, gv = gathered[:, 0], gathered[:, 1]
        else:
            gk, gv = _gather(k, group_name), _gather(v, group_name)
        out, lse = torch.ops.cpcompile.attend_varlen_blocks(q, [k, gk], [v, gv], list(ranges), spec, scale, kernel)
        ctx.save_for_backward(q, k, v, gk, gv, out, lse, *ranges)
        ctx.spec, ctx.scale, ctx.kernel, ctx.group_name, ctx.fused = spec, scale, kernel, group_name, fused
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, gk, gv, out, lse, *ranges = ctx.saved_tensors
        dq, (dk_local, dk_gathered), (dv_local, dv_gathered) = torch.ops.cpcompile.attend_varlen_blocks_backward(
            dout.contiguous(), q, [k, gk], [v, gv], out, lse, ranges, ctx.spec, ctx.scale, ctx.kernel
        )
        acc = grad_reduce_dtype(k.dtype)
        if ctx.fused:
            summed = _reduce(torch.stack((dk_gathered, dv_gathered), dim=1).to(acc), ctx.group_name)
            dk_remote, dv_remote = summed[:, 0], summed[:, 1]
        else:
            dk_remote = _reduce(dk_gathered.to(acc), ctx.group_name)
            dv_remote = _reduce(dv_gathered.to(acc), ctx.group_name)
        dk = (dk_remote + dk_local.to(acc)).to(k.dtype)
        dv = (dv_remote + dv_local.to(acc)).to(v.dtype)
        return (dq.to(q.dtype), dk, dv, None, None, None, None, *([None] * len(ranges)))


def all_gather_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    layout: str,
    causal: bool,
    scale: float,
    kernel: str,
    group_name: str,
    rank: int,
    world: int,
    max_doc: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """varlen_attn of this rank's packed q over every rank's K/V, same document only (causal when asked).

    cu_seqlens are the GLOBAL document offsets. The layout turns them into block ranges with device ops of
    static shape (no host sync, no recompiles when documents change). `max_doc` (the call's max_q/max_k: the
    longest document, the same contract as single-device varlen_attn) tightens the blocks' static length bounds,
    which size the kernels' grids. Returns what torch_attn._varlen_attn returns: (out, lse (Hq, T_local) fp32,
    rng_state), so the node's users are unchanged.
    """
    lay = get_packed_layout(layout)
    lay.device_check(cu_seqlens, world)
    blocks = lay.blocks(cu_seqlens, q.shape[0], world, rank, causal, max_doc)
    spec = encode_blocks(blocks)
    out, lse = _GatherAttend.apply(q, k, v, spec, scale, kernel, group_name, *[b.ranges for b in blocks])
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    return out, lse.to(torch.float32), rng_state

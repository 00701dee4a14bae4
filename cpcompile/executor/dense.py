"""The block executor for dense attention: `attend` / `attend_backward`, what every dense region calls.

`attend(q, ks, vs, blocks, scale, kernel, packed_kv=None, acc_out=False, windows=None, softcap=0.0, sinks=None)`
runs every block (layouts.Block, six ints each by blocks.encode_dense, its window in `windows` where any block
has one; sources are ks/vs, then the slots of packed_kv; scores softcapped when softcap > 0; `sinks` (one logit a
q head, sinks.py) folded in after the merge, for a caller whose blocks hold every key of a row) with the kernel
provider, same-shaped blocks batched into one call (calls.py), and merges partial outputs by LSE in fp32.
Backward calls each block's kernel backward with the FINAL output and LSE, which yields the exact partial
gradients (the ring-attention identity), and sums them per row segment, rounding once; autograd never
differentiates through the merge. `acc_out` / `acc_dq` return out / dq in the accumulation dtype (fp32 for
bf16), for a caller that merges several calls (the ring's steps) and must round once, at the end.

Two ways to run, one body (dense_run.py):
- traced, for providers that say `traceable` (cudnn, flash, cpu_flash, cpu_ref: aten ops on views): the
  calls, views and merges are recorded into the region's graph when aot_autograd traces it, inside an
  autograd.Function whose backward is traced the same way. At run time Inductor launches the kernels from its
  own code and runs the merges as fused Triton kernels: no cpcompile Python per call (docs/architecture.md,
  "The run-time path").
- opaque, for the others (flex_softcap, flash_attn, te): the custom ops `cpcompile::attend_blocks(_backward)`
  run the body eagerly at run time, with the calls spread over two CUDA streams (streams.py).
"""

from __future__ import annotations

from functools import lru_cache, partial
from typing import NamedTuple

import torch

from ..kernels import get_kernel
from ..precision import acc_dtype
from .blocks import decode_dense, decode_windows
from .calls import Call, plan_calls
from .dense_run import call_work, run_backward, run_forward
from .packed_kv import pack_kv, unpack_kv
from .sinks import sinks_grad
from .streams import assign, run_calls


@lru_cache(maxsize=256)
def planned_calls(
    blocks: tuple[int, ...], batch: int, windows: tuple[int, ...] | None = None
) -> tuple[list, list[Call], list[int]]:
    """Decoded blocks, their kernel calls and each call's stream (streams.assign), cached: the region runs the
    same block list every step."""
    decoded = decode_dense(blocks)
    calls = plan_calls(decoded, batch, decode_windows(windows, len(decoded)) if windows is not None else None)
    return decoded, calls, assign(call_work(calls))


def traced(kernel: str) -> bool:
    """Whether blocks on provider `kernel` are recorded into the caller's graph (its `traceable` flag)."""
    return bool(getattr(get_kernel(kernel), "traceable", False))


def with_packed_sources(
    ks: list[torch.Tensor], vs: list[torch.Tensor], packed_kv: torch.Tensor | None, qk_dim: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Append the sources held in a packed all-gather buffer (T, slots, 2, B, H, D) to ks/vs.

    Slot i's K is packed_kv[:, i, 0] and V is packed_kv[:, i, 1] (MLA: (T, slots, B, H, D + Dv), K and V side
    by side, executor.packed_kv), viewed as (B, H, T, D) with no copy. The executor takes the packed buffer
    itself so its backward can write the gradient of every gathered source directly in the layout the
    reduce-scatter sends, in fp32: no rounding before the sum.
    """
    if packed_kv is None:
        return list(ks), list(vs)
    pairs = [unpack_kv(packed_kv[:, i], 1, qk_dim) for i in range(packed_kv.shape[1])]
    return (
        [*ks, *(k.permute(1, 2, 0, 3) for k, _ in pairs)],
        [*vs, *(v.permute(1, 2, 0, 3) for _, v in pairs)],
    )


def packed_sources_grad(dks: list[torch.Tensor], dvs: list[torch.Tensor]) -> torch.Tensor:
    """The gradients of a packed buffer's slots, (B, H, T, D) each, in the buffer's own layout (T, slots, 2, B,
    H, D) (MLA: (T, slots, B, H, D + Dv)): the inverse of with_packed_sources."""
    slots = [pack_kv(dk.permute(2, 0, 1, 3), dv.permute(2, 0, 1, 3), 1) for dk, dv in zip(dks, dvs)]
    return torch.stack(slots, 1)


def _windows_key(windows: list[int] | None) -> tuple[int, ...] | None:
    return None if windows is None else tuple(windows)


def _batch_key(q: torch.Tensor) -> int:
    """The batch as the plan needs it: 1, or 2 for any larger batch. The plan only asks whether it may take the
    batch dim, and a symbolic batch (a dynamic batch dim under torch.compile) must not reach its cache."""
    return 1 if q.shape[0] == 1 else 2


def run_blocks(q, ks, vs, blocks, scale, kernel, packed_kv, acc_out, windows, softcap, sinks, streams: bool):
    """attend's body for either way of running (`streams`: spread the calls over two CUDA streams)."""
    impl = get_kernel(kernel)
    ks, vs = with_packed_sources(ks, vs, packed_kv, q.shape[-1])
    decoded, calls, lanes = planned_calls(tuple(blocks), _batch_key(q), _windows_key(windows))
    run = partial(run_calls, q.device) if streams else None
    extra = {"run": run, "lanes": lanes} if run is not None else {}
    return run_forward(impl, q, ks, vs, decoded, calls, scale, acc_out=acc_out, softcap=softcap, sinks=sinks, **extra)


def run_blocks_backward(
    dout, q, ks, vs, out, lse, blocks, scale, kernel, packed_kv, acc_dq, windows, softcap, streams: bool
):
    """attend_backward's body for either way of running."""
    impl = get_kernel(kernel)
    n_explicit = len(ks)
    ks, vs = with_packed_sources(ks, vs, packed_kv, q.shape[-1])
    decoded, calls, lanes = planned_calls(tuple(blocks), _batch_key(q), _windows_key(windows))
    # explicit sources get gradients in their dtype; packed ones in fp32, straight into the packed layout
    dtypes = [k.dtype for k in ks[:n_explicit]] + [acc_dtype(q.dtype)] * (len(ks) - n_explicit)
    extra = {"run": partial(run_calls, q.device), "lanes": lanes} if streams else {}
    dq, dks, dvs = run_backward(
        impl, dout, q, ks, vs, out, lse, decoded, calls, scale, acc_dq=acc_dq, softcap=softcap,
        source_dtypes=dtypes, **extra,
    )  # fmt: skip
    dpacked = (
        packed_sources_grad(dks[n_explicit:], dvs[n_explicit:])
        if packed_kv is not None
        else q.new_empty((0,), dtype=acc_dtype(q.dtype))
    )
    return dq, dks[:n_explicit], dvs[:n_explicit], dpacked


class _Plan(NamedTuple):
    """What a traced executor call runs, besides its tensors."""

    blocks: tuple[int, ...]
    scale: float
    kernel: str
    acc_out: bool
    windows: tuple[int, ...] | None
    softcap: float
    n_sources: int


class _TracedBlocks(torch.autograd.Function):
    """attend for a traceable provider: forward and backward are the executor's body, recorded into the graph."""

    @staticmethod
    def forward(ctx, plan: _Plan, q, packed_kv, sinks, *kvs):
        ks, vs = list(kvs[: plan.n_sources]), list(kvs[plan.n_sources :])
        windows = list(plan.windows) if plan.windows is not None else None
        out, lse = run_blocks(
            q, ks, vs, plan.blocks, plan.scale, plan.kernel, packed_kv, plan.acc_out, windows, plan.softcap, sinks,
            streams=False,
        )  # fmt: skip
        ctx.save_for_backward(q, out, lse, packed_kv, sinks, *kvs)
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, out, lse, packed_kv, sinks, *kvs = ctx.saved_tensors
        plan = ctx.plan
        ks, vs = kvs[: plan.n_sources], kvs[plan.n_sources :]
        windows = list(plan.windows) if plan.windows is not None else None
        dq, dks, dvs, dpacked = run_blocks_backward(
            dout.to(q.dtype), q, list(ks), list(vs), out.to(q.dtype), lse, plan.blocks, plan.scale, plan.kernel,
            packed_kv, False, windows, plan.softcap, streams=False,
        )  # fmt: skip
        dpacked = dpacked.to(packed_kv.dtype) if packed_kv is not None else None
        dsinks = sinks_grad(dout, out, lse, sinks) if sinks is not None else None
        return None, dq, dpacked, dsinks, *dks, *dvs


def attend(
    q: torch.Tensor,
    ks: list[torch.Tensor],
    vs: list[torch.Tensor],
    blocks: list[int],
    scale: float,
    kernel: str,
    packed_kv: torch.Tensor | None = None,
    acc_out: bool = False,
    windows: list[int] | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q over the blocks (see the module docstring), differentiable in q, ks, vs, packed_kv and
    sinks; recorded into the caller's graph for a traceable provider, else one opaque custom op."""
    if not traced(kernel):
        extra = {"windows": windows} if windows is not None else {}
        if softcap:
            extra["softcap"] = softcap
        if sinks is not None:
            extra["sinks"] = sinks
        return torch.ops.cpcompile.attend_blocks(q, ks, vs, blocks, scale, kernel, packed_kv, acc_out, **extra)
    plan = _Plan(tuple(blocks), scale, kernel, acc_out, _windows_key(windows), softcap, len(ks))
    return _TracedBlocks.apply(plan, q, packed_kv, sinks, *ks, *vs)


def attend_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    ks: list[torch.Tensor],
    vs: list[torch.Tensor],
    out: torch.Tensor,
    lse: torch.Tensor,
    blocks: list[int],
    scale: float,
    kernel: str,
    packed_kv: torch.Tensor | None = None,
    acc_dq: bool = False,
    windows: list[int] | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """(dq, dks, dvs, dpacked) of the blocks given the FINAL out and lse, for a region's own backward: dks/dvs
    of the explicit sources in their dtypes, dpacked the packed buffer's gradient in fp32 (empty without one)."""
    if not traced(kernel):
        extra = {"windows": windows} if windows is not None else {}
        if softcap:
            extra["softcap"] = softcap
        args = (dout, q, ks, vs, out, lse, blocks, scale, kernel, packed_kv, acc_dq)
        return torch.ops.cpcompile.attend_blocks_backward(*args, **extra)
    args = (dout, q, ks, vs, out, lse, blocks, scale, kernel, packed_kv, acc_dq, windows, softcap)
    return run_blocks_backward(*args, streams=False)

"""The opaque dense executor ops, for providers that cannot be traced (dense.py says which run this way).

`cpcompile::attend_blocks(_backward)` run dense.run_blocks(_backward) eagerly at run time, the calls spread over
two CUDA streams. Their outputs are contiguous and of the dtypes their fakes promise (Inductor checks a fallback's
strides but not its dtypes: it reads the buffer as the fake's dtype, so a bf16 output where the fake says fp32 is
read as garbage). The executor body may return a single call's output in the kernel's own dtype (run_forward's
`acc_out` shortcut); the ops cast it here, where the fake cannot know whether one call wrote every row.
"""

from __future__ import annotations

import torch

from ..precision import acc_dtype
from .dense import run_blocks, run_blocks_backward
from .sinks import sinks_grad


@torch.library.custom_op("cpcompile::attend_blocks", mutates_args=())
def attend_blocks(
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
    out, lse = run_blocks(q, ks, vs, blocks, scale, kernel, packed_kv, acc_out, windows, softcap, sinks, True)
    acc_t = acc_dtype(q.dtype)
    return out.to(acc_t if acc_out else q.dtype).contiguous(), lse.to(acc_t).contiguous()


def _out_shape(q: torch.Tensor, vs: list[torch.Tensor], packed_kv: torch.Tensor | None) -> list[int]:
    """q's shape with v's head dim (a packed buffer's V: its last dim minus K's when side by side)."""
    if vs:
        dv = vs[0].shape[-1]
    else:
        dv = packed_kv.shape[-1] if packed_kv.dim() == 6 else packed_kv.shape[-1] - q.shape[-1]
    return [*q.shape[:-1], dv]


@attend_blocks.register_fake
def _attend_blocks_fake(
    q, ks, vs, blocks, scale, kernel, packed_kv=None, acc_out=False, windows=None, softcap=0.0, sinks=None
):
    out = q.new_empty(_out_shape(q, vs, packed_kv), dtype=acc_dtype(q.dtype) if acc_out else q.dtype)
    return out, q.new_empty(q.shape[:-1], dtype=acc_dtype(q.dtype))


@torch.library.custom_op("cpcompile::attend_blocks_backward", mutates_args=())
def attend_blocks_backward(
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
    args = (dout, q, ks, vs, out, lse, blocks, scale, kernel, packed_kv, acc_dq, windows, softcap)
    dq, dks, dvs, dpacked = run_blocks_backward(*args, streams=True)
    acc_t = acc_dtype(q.dtype)
    like = lambda gs, ts: [g.to(t.dtype).contiguous() for g, t in zip(gs, ts)]  # noqa: E731  (as the fake says)
    return (
        dq.to(acc_t if acc_dq else q.dtype).contiguous(),
        like(dks, ks),
        like(dvs, vs),
        dpacked.to(acc_t).contiguous(),
    )


@attend_blocks_backward.register_fake
def _attend_blocks_backward_fake(
    dout, q, ks, vs, out, lse, blocks, scale, kernel, packed_kv=None, acc_dq=False, windows=None, softcap=0.0
):
    dpacked = q.new_empty(packed_kv.shape if packed_kv is not None else (0,), dtype=acc_dtype(q.dtype))
    return (
        q.new_empty(q.shape, dtype=acc_dtype(q.dtype) if acc_dq else q.dtype),
        [k.new_empty(k.shape) for k in ks],
        [v.new_empty(v.shape) for v in vs],
        dpacked,
    )


def _setup_context(ctx, inputs, output):
    q, ks, vs, blocks, scale, kernel, packed_kv, acc_out, windows, softcap, sinks = inputs
    out, lse = output
    ctx.has_packed, ctx.has_sinks = packed_kv is not None, sinks is not None
    extra = [*([packed_kv] if ctx.has_packed else []), *([sinks] if ctx.has_sinks else [])]
    ctx.save_for_backward(q, out, lse, *extra, *ks, *vs)
    ctx.n_sources = len(ks)
    ctx.blocks, ctx.scale, ctx.kernel = blocks, scale, kernel
    ctx.extra = {"windows": windows} if windows is not None else {}
    if softcap:
        ctx.extra["softcap"] = softcap
    # autograd wants one gradient per argument PASSED, and the dispatcher drops trailing defaults: count up to
    # the last optional argument that is not its default
    given = [packed_kv is not None, bool(acc_out), windows is not None, bool(softcap), sinks is not None]
    ctx.n_args = 6 + max((i + 1 for i, g in enumerate(given) if g), default=0)


def _backward(ctx, dout, _dlse):
    q, out, lse, *rest = ctx.saved_tensors
    packed_kv = rest.pop(0) if ctx.has_packed else None
    sinks = rest.pop(0) if ctx.has_sinks else None
    ks, vs = rest[: ctx.n_sources], rest[ctx.n_sources :]
    dq, dks, dvs, dpacked = torch.ops.cpcompile.attend_blocks_backward(
        dout.to(q.dtype), q, ks, vs, out.to(q.dtype), lse, ctx.blocks, ctx.scale, ctx.kernel, packed_kv, **ctx.extra
    )
    dpacked = dpacked.to(packed_kv.dtype) if ctx.has_packed else None
    dsinks = sinks_grad(dout, out, lse, sinks) if ctx.has_sinks else None
    grads = (dq, dks, dvs, None, None, None, dpacked, None, None, None, dsinks)
    return grads[: ctx.n_args]


attend_blocks.register_autograd(_backward, setup_context=_setup_context)

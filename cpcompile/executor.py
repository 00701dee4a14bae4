"""The block executor: one custom op that runs a rank's attention blocks and merges them by log-sum-exp.

`cpcompile::attend_blocks(q, ks, vs, blocks, scale, kernel, packed_kv=None)` runs every block (see
layouts.Block, encoded as six ints each) with the kernel provider and merges partial outputs in fp32 (or
fp64 for fp64 inputs). Its registered backward calls each block's kernel backward with the FINAL output and
LSE, which yields the exact partial gradients (the ring-attention identity); autograd never differentiates
through the merge.
"""

from __future__ import annotations

import torch

from .kernels import get_kernel

BLOCK_FIELDS = 6


def _decode(blocks: list[int]) -> list[tuple[int, int, int, int, int, bool]]:
    it = [blocks[i : i + BLOCK_FIELDS] for i in range(0, len(blocks), BLOCK_FIELDS)]
    return [(a, b, c, d, e, bool(f)) for a, b, c, d, e, f in it]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _empty_like_layout(ref: torch.Tensor, last: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor shaped like `ref` with last dim `last`, laid out in ref's dim order (keeps BSHD cheap)."""
    order = sorted(range(ref.dim()), key=lambda d: (-ref.stride(d), d))
    order.remove(ref.dim() - 1)
    order.append(ref.dim() - 1)
    shape = list(ref.shape[:-1]) + [last]
    t = ref.new_empty([shape[d] for d in order], dtype=dtype)
    inverse = [order.index(d) for d in range(ref.dim())]
    return t.permute(inverse)


def _rows(t: torch.Tensor, start: int, length: int) -> torch.Tensor:
    return t.narrow(-2, start, length)


@torch.library.custom_op("cpcompile::attend_blocks", mutates_args=())
def attend_blocks(
    q: torch.Tensor,
    ks: list[torch.Tensor],
    vs: list[torch.Tensor],
    blocks: list[int],
    scale: float,
    kernel: str,
    packed_kv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    impl = get_kernel(kernel)
    ks, vs = with_packed_sources(ks, vs, packed_kv)
    acc_t = _acc_dtype(q.dtype)
    acc = q.new_zeros((*q.shape[:-1], vs[0].shape[-1]), dtype=acc_t)
    lse = q.new_full(q.shape[:-1], float("-inf"), dtype=acc_t)
    for q0, qn, src, k0, kn, causal in _decode(blocks):
        o, l = impl.forward(_rows(q, q0, qn), _rows(ks[src], k0, kn), _rows(vs[src], k0, kn), causal, scale)
        acc_rows, lse_rows = _rows(acc, q0, qn), lse[..., q0 : q0 + qn]
        l = l.to(acc_t)
        merged = torch.logaddexp(lse_rows, l)
        acc_rows.mul_(torch.exp(lse_rows - merged).unsqueeze(-1))
        acc_rows.add_(o.to(acc_t) * torch.exp(l - merged).unsqueeze(-1))
        lse_rows.copy_(merged)
    out = _empty_like_layout(q, acc.shape[-1], q.dtype)
    out.copy_(acc)
    return out, lse


@attend_blocks.register_fake
def _attend_blocks_fake(q, ks, vs, blocks, scale, kernel, packed_kv=None):
    vs = with_packed_sources(ks, vs, packed_kv)[1]
    out = _empty_like_layout(q, vs[0].shape[-1], q.dtype)
    return out, q.new_empty(q.shape[:-1], dtype=_acc_dtype(q.dtype))


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
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    impl = get_kernel(kernel)
    acc_t = _acc_dtype(q.dtype)
    dq = torch.zeros_like(q, dtype=acc_t)
    n_explicit = len(ks)
    dks = [torch.zeros_like(k, dtype=acc_t) for k in ks]
    dvs = [torch.zeros_like(v, dtype=acc_t) for v in vs]
    dpacked = _packed_grad_like(packed_kv, q)
    if packed_kv is not None:  # gradients of packed sources accumulate straight into the packed layout
        packed_dks, packed_dvs = with_packed_sources([], [], dpacked)
        dks, dvs = dks + packed_dks, dvs + packed_dvs
    ks, vs = with_packed_sources(ks, vs, packed_kv)
    kernel_lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    for q0, qn, src, k0, kn, causal in _decode(blocks):
        dq_b, dk_b, dv_b = impl.backward(
            _rows(dout, q0, qn),
            _rows(q, q0, qn),
            _rows(ks[src], k0, kn),
            _rows(vs[src], k0, kn),
            _rows(out, q0, qn),
            lse[..., q0 : q0 + qn].to(kernel_lse_dtype),
            causal,
            scale,
        )
        _rows(dq, q0, qn).add_(dq_b)
        _rows(dks[src], k0, kn).add_(dk_b)
        _rows(dvs[src], k0, kn).add_(dv_b)
    return (
        _cast_like(dq, q),
        [_cast_like(g, k) for g, k in zip(dks[:n_explicit], ks)],
        [_cast_like(g, v) for g, v in zip(dvs[:n_explicit], vs)],
        dpacked,
    )


def _cast_like(acc: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    res = torch.empty_like(ref)
    res.copy_(acc)
    return res


@attend_blocks_backward.register_fake
def _attend_blocks_backward_fake(dout, q, ks, vs, out, lse, blocks, scale, kernel, packed_kv=None):
    return (
        torch.empty_like(q),
        [torch.empty_like(k) for k in ks],
        [torch.empty_like(v) for v in vs],
        _packed_grad_like(packed_kv, q),
    )


def _packed_grad_like(packed_kv: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """Zeros shaped like the packed buffer in the accumulation dtype (an empty tensor when there is none)."""
    shape = packed_kv.shape if packed_kv is not None else (0,)
    return q.new_zeros(shape, dtype=_acc_dtype(q.dtype))


def with_packed_sources(
    ks: list[torch.Tensor], vs: list[torch.Tensor], packed_kv: torch.Tensor | None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Append the sources held in a packed all-gather buffer (T, slots, 2, B, H, D) to ks/vs.

    Slot i's K is packed_kv[:, i, 0] and V is packed_kv[:, i, 1], viewed as (B, H, T, D) with no copy. The
    executor takes the packed buffer itself so its backward can write the gradient of every gathered source
    directly in the layout the reduce-scatter sends: no pack kernel between them.
    """
    if packed_kv is None:
        return list(ks), list(vs)
    slots = range(packed_kv.shape[1])
    return (
        [*ks, *(packed_kv[:, i, 0].permute(1, 2, 0, 3) for i in slots)],
        [*vs, *(packed_kv[:, i, 1].permute(1, 2, 0, 3) for i in slots)],
    )


def _setup_context(ctx, inputs, output):
    q, ks, vs, blocks, scale, kernel, packed_kv = inputs
    out, lse = output
    ctx.has_packed = packed_kv is not None
    ctx.save_for_backward(q, out, lse, *([packed_kv] if ctx.has_packed else []), *ks, *vs)
    ctx.n_sources = len(ks)
    ctx.blocks, ctx.scale, ctx.kernel = blocks, scale, kernel


def _backward(ctx, dout, _dlse):
    q, out, lse, *rest = ctx.saved_tensors
    packed_kv = rest.pop(0) if ctx.has_packed else None
    ks, vs = rest[: ctx.n_sources], rest[ctx.n_sources :]
    dq, dks, dvs, dpacked = torch.ops.cpcompile.attend_blocks_backward(
        dout, q, ks, vs, out, lse, ctx.blocks, ctx.scale, ctx.kernel, packed_kv
    )
    grads = (dq, dks, dvs, None, None, None)
    return (*grads, dpacked.to(packed_kv.dtype)) if ctx.has_packed else grads


attend_blocks.register_autograd(_backward, setup_context=_setup_context)

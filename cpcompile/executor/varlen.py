"""The varlen block executor: run a rank's varlen blocks and merge them by log-sum-exp.

`attend_varlen(q, ks, vs, ranges, blocks, scale, kernel, meta)` / `attend_varlen_backward`, what the regions call,
run one body two ways, as executor/dense.py does: recorded into the region's graph for a provider that says
`traceable` (all three today: aten's FA2 varlen, cudnn_graph's cuDNN ops, which have fake kernels and stay one node
each, and the CPU reference), else inside the opaque custom op `cpcompile::attend_varlen_blocks(_backward)`.
Arguments: q (Tq, Hq, D) packed
tokens, sources ks/vs (T_src, Hkv, D), one (4, B) int64 ranges tensor per block (see kernels.base), nine ints
per block (blocks.encode_varlen: source, causal, max_q, max_k, window, covers rows, covers keys, square) and
the blocks' metadata (`varlen_meta.prepare_blocks`: masks, cu_seqlens, index maps), which the caller builds
from the ranges once per batch, in its graph, so that each call's host work is the kernel's own.
Block metadata lives in tensors computed on device, so documents can change every batch without recompiling
or syncing. Rows a block does not cover are masked out of the merge (kernels may leave garbage there); rows no
block covers get out = 0, lse = -inf. The registered backward calls each block's kernel backward with the FINAL
out and lse, like executor.attend_blocks. A gradient that sums several blocks comes back in the accumulation
dtype (fp32 for bf16) so a caller can reduce it before rounding; one that a single block writes comes back as
that kernel's backward gives it (`grad_dtype`), with no extra rounding. Every returned tensor is contiguous.

One block (what the THD layouts and a2a run) is the fast path: no merge, and no mask where the layout vouches
that the block covers every q row with at least one key (`covers_rows`) or every key (`covers_keys`); the
kernel's buffers are then returned as they are.
"""

from __future__ import annotations

import torch

from ..kernels import get_varlen_kernel
from ..precision import acc_dtype
from .blocks import decode_varlen
from .varlen_meta import split_blocks


def _grad_dtype(impl, dtype: torch.dtype, contributions: int) -> torch.dtype:
    """The dtype of a gradient that `contributions` blocks of provider `impl` add up."""
    return impl.grad_dtype(dtype) if contributions == 1 else acc_dtype(dtype)


def _contributions(blocks: list[int], n_sources: int) -> tuple[int, list[int]]:
    """How many blocks write dq, and each source's dk/dv."""
    srcs = [b.source for b in decode_varlen(blocks)]
    return len(srcs), [srcs.count(i) for i in range(n_sources)]


def _as_returned(part: torch.Tensor, dtype: torch.dtype, mask: torch.Tensor | None) -> torch.Tensor:
    """`part` where `mask` (rows on dim 0; None: everywhere), else 0, contiguous in `dtype`: the kernel's own
    buffer when nothing needs doing, else one pass (garbage, even NaN, outside the mask never gets through)."""
    ready = part.dtype == dtype and part.is_contiguous()
    if mask is None and ready:
        return part
    if ready:  # a new buffer laid out like `part`: contiguous
        return torch.where(mask.view(-1, 1, 1), part, 0)
    buf = part.new_empty(part.shape, dtype=dtype)
    if mask is None:
        return buf.copy_(part)
    mask = mask.view(-1, 1, 1)
    if part.dtype == dtype:
        return torch.where(mask, part, part.new_zeros(()), out=buf)
    return buf.copy_(part).masked_fill_(~mask, 0)


def run_varlen_blocks(q, ks, vs, ranges, blocks, scale, kernel, meta) -> tuple[torch.Tensor, torch.Tensor]:
    """attend_varlen's body, for either way of running (module docstring)."""
    impl = get_varlen_kernel(kernel)
    acc_t = acc_dtype(q.dtype)
    specs = decode_varlen(blocks)
    metas = split_blocks(meta, specs, impl)
    if len(ranges) == 1:  # one kernel call: its out and lse are final, up to the rows it does not cover
        (b,), (r,), ((rows, _, prepared),) = specs, ranges, metas  # keys: unused here
        o, l = _forward(impl, q, ks, vs, r, b, scale, prepared)
        if rows is None:
            lse = _as_returned(l, acc_t, None)
        else:  # written into a contiguous buffer: kernels return views (cuDNN: (Hq, Tq) of its token-major
            # stats), and the op's outputs must have its fake's strides (Inductor asserts them: ring on the H200)
            lse = l.new_empty(l.shape, dtype=acc_t)
            torch.where(rows, l.to(acc_t), l.new_full((), float("-inf"), dtype=acc_t), out=lse)
        return _as_returned(o, q.dtype, rows), lse
    acc = lse = None
    for r, b, (rows, _, prepared) in zip(ranges, specs, metas):
        o, l = _forward(impl, q, ks, vs, r, b, scale, prepared)
        # rows a block does not cover are masked out of the merge; a block that covers every row has none
        l = l.to(acc_t) if rows is None else torch.where(rows, l.to(acc_t), float("-inf"))
        o = o if rows is None else torch.where(rows.view(-1, 1, 1), o, 0)
        if acc is None:  # the first block is the running result (what merging it into nothing gives, exactly)
            acc, lse = o.to(acc_t), l
            continue
        merged = torch.logaddexp(lse, l)
        safe = torch.where(torch.isinf(merged), 0, merged)
        keep, add = torch.exp(lse - safe).T.unsqueeze(-1), torch.exp(l - safe).T.unsqueeze(-1)
        acc = acc.mul_(keep).addcmul_(o, add)  # in place: fewer passes
        lse = merged
    return _as_returned(acc, q.dtype, None), _as_returned(lse, acc_t, None)


@torch.library.custom_op("cpcompile::attend_varlen_blocks", mutates_args=())
def attend_varlen_blocks(
    q: torch.Tensor,
    ks: list[torch.Tensor],
    vs: list[torch.Tensor],
    ranges: list[torch.Tensor],
    blocks: list[int],
    scale: float,
    kernel: str,
    meta: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    return run_varlen_blocks(q, ks, vs, ranges, blocks, scale, kernel, meta)


def _forward(impl, q, ks, vs, r, b, scale, prepared):
    """One block's kernel forward on its source, with its prepared metadata."""
    kw = b.kernel_kwargs()
    return impl.forward(q, ks[b.source], vs[b.source], r, b.max_q, b.max_k, b.causal, scale, **kw, prepared=prepared)


@attend_varlen_blocks.register_fake
def _attend_varlen_blocks_fake(q, ks, vs, ranges, blocks, scale, kernel, meta):
    out = q.new_empty((*q.shape[:-1], vs[0].shape[-1]))
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=acc_dtype(q.dtype))


def run_varlen_blocks_backward(dout, q, ks, vs, out, lse, ranges, blocks, scale, kernel, meta):
    """attend_varlen_backward's body, for either way of running: (dq, dks, dvs)."""
    impl = get_varlen_kernel(kernel)
    acc_t = acc_dtype(q.dtype)
    n_dq, n_src = _contributions(blocks, len(ks))
    dq: torch.Tensor | None = None
    dks: list[torch.Tensor | None] = [None] * len(ks)
    dvs: list[torch.Tensor | None] = [None] * len(vs)
    kernel_lse = lse.to(acc_t)  # fp32 (fp64 for fp64): what the kernels take

    def add(total: torch.Tensor | None, part: torch.Tensor, mask: torch.Tensor | None, n: int) -> torch.Tensor:
        """The running sum of the masked parts: in the kernel's dtype when `part` is the only one, else fp32."""
        if total is None:
            return _as_returned(part, _grad_dtype(impl, q.dtype, n), mask)
        return total.add_(part if mask is None else torch.where(mask.view(-1, 1, 1), part, 0))  # fp32 (fp64) sum

    specs = decode_varlen(blocks)
    metas = split_blocks(meta, specs, impl)
    for r, b, (rows, keys, prepared) in zip(ranges, specs, metas):
        src, kw = b.source, b.kernel_kwargs()
        dq_b, dk_b, dv_b = impl.backward(
            dout, q, ks[src], vs[src], out, kernel_lse, r, b.max_q, b.max_k, b.causal, scale, **kw, prepared=prepared
        )
        dq = add(dq, dq_b, rows, n_dq)
        dks[src] = add(dks[src], dk_b, keys, n_src[src])
        dvs[src] = add(dvs[src], dv_b, keys, n_src[src])
    dq = q.new_zeros(q.shape, dtype=acc_t) if dq is None else dq
    dks = [k.new_zeros(k.shape, dtype=acc_t) if g is None else g for g, k in zip(dks, ks)]
    dvs = [v.new_zeros(v.shape, dtype=acc_t) if g is None else g for g, v in zip(dvs, vs)]
    return dq, dks, dvs


@torch.library.custom_op("cpcompile::attend_varlen_blocks_backward", mutates_args=())
def attend_varlen_blocks_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    ks: list[torch.Tensor],
    vs: list[torch.Tensor],
    out: torch.Tensor,
    lse: torch.Tensor,
    ranges: list[torch.Tensor],
    blocks: list[int],
    scale: float,
    kernel: str,
    meta: list[torch.Tensor],
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    return run_varlen_blocks_backward(dout, q, ks, vs, out, lse, ranges, blocks, scale, kernel, meta)


@attend_varlen_blocks_backward.register_fake
def _attend_varlen_blocks_backward_fake(dout, q, ks, vs, out, lse, ranges, blocks, scale, kernel, meta):
    impl = get_varlen_kernel(kernel)
    n_dq, n_src = _contributions(blocks, len(ks))
    like = lambda t, n: t.new_empty(t.shape, dtype=_grad_dtype(impl, q.dtype, n))  # noqa: E731  (contiguous)
    return like(q, n_dq), [like(k, n) for k, n in zip(ks, n_src)], [like(v, n) for v, n in zip(vs, n_src)]


def _setup_context(ctx, inputs, output):
    q, ks, vs, ranges, blocks, scale, kernel, meta = inputs
    out, lse = output
    ctx.save_for_backward(q, out, lse, *ks, *vs, *ranges, *meta)
    ctx.n_sources, ctx.n_blocks = len(ks), len(ranges)
    ctx.blocks, ctx.scale, ctx.kernel = blocks, scale, kernel


def _backward(ctx, dout, _dlse):
    q, out, lse, *rest = ctx.saved_tensors
    n, nb = ctx.n_sources, ctx.n_blocks
    ks, vs, ranges, meta = rest[:n], rest[n : 2 * n], rest[2 * n : 2 * n + nb], rest[2 * n + nb :]
    dq, dks, dvs = torch.ops.cpcompile.attend_varlen_blocks_backward(
        dout.contiguous(), q, ks, vs, out, lse, ranges, ctx.blocks, ctx.scale, ctx.kernel, meta
    )
    dq = dq.to(q.dtype)
    dks = [g.to(k.dtype) for g, k in zip(dks, ks)]
    dvs = [g.to(v.dtype) for g, v in zip(dvs, vs)]
    return dq, dks, dvs, [None] * nb, None, None, None, [None] * len(meta)


attend_varlen_blocks.register_autograd(_backward, setup_context=_setup_context)


def traced_varlen(kernel: str) -> bool:
    """Whether varlen blocks on provider `kernel` are recorded into the caller's graph (its `traceable` flag)."""
    return bool(getattr(get_varlen_kernel(kernel), "traceable", False))


class _TracedVarlen(torch.autograd.Function):
    """attend_varlen for a traceable provider: the op's body and its backward, recorded into the graph."""

    @staticmethod
    def forward(ctx, plan, q, *tensors):
        n, nb, blocks, scale, kernel = plan
        ks, vs, ranges, meta = tensors[:n], tensors[n : 2 * n], tensors[2 * n : 2 * n + nb], tensors[2 * n + nb :]
        out, lse = run_varlen_blocks(q, list(ks), list(vs), list(ranges), blocks, scale, kernel, list(meta))
        ctx.save_for_backward(q, out, lse, *tensors)
        ctx.plan = plan
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        n, nb, blocks, scale, kernel = ctx.plan
        q, out, lse, *rest = ctx.saved_tensors
        ks, vs, ranges, meta = rest[:n], rest[n : 2 * n], rest[2 * n : 2 * n + nb], rest[2 * n + nb :]
        dq, dks, dvs = run_varlen_blocks_backward(
            dout.contiguous(), q, list(ks), list(vs), out, lse, list(ranges), blocks, scale, kernel, list(meta)
        )
        dks = [g.to(k.dtype) for g, k in zip(dks, ks)]
        dvs = [g.to(v.dtype) for g, v in zip(dvs, vs)]
        return None, dq.to(q.dtype), *dks, *dvs, *([None] * (nb + len(meta)))


def attend_varlen(
    q: torch.Tensor,
    ks: list[torch.Tensor],
    vs: list[torch.Tensor],
    ranges: list[torch.Tensor],
    blocks: list[int],
    scale: float,
    kernel: str,
    meta: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of packed q over the varlen blocks, differentiable in q, ks and vs: recorded into the caller's
    graph for a traceable provider, else the opaque op `cpcompile::attend_varlen_blocks`."""
    if not traced_varlen(kernel):
        return torch.ops.cpcompile.attend_varlen_blocks(q, ks, vs, ranges, blocks, scale, kernel, meta)
    plan = (len(ks), len(ranges), tuple(blocks), scale, kernel)
    return _TracedVarlen.apply(plan, q, *ks, *vs, *ranges, *meta)


def attend_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    ks: list[torch.Tensor],
    vs: list[torch.Tensor],
    out: torch.Tensor,
    lse: torch.Tensor,
    ranges: list[torch.Tensor],
    blocks: list[int],
    scale: float,
    kernel: str,
    meta: list[torch.Tensor],
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """(dq, dks, dvs) of the varlen blocks given the FINAL out and lse, for a region's own backward (module
    docstring: gradients several blocks sum come back in the accumulation dtype)."""
    args = (dout, q, ks, vs, out, lse, ranges, blocks, scale, kernel, meta)
    if not traced_varlen(kernel):
        return torch.ops.cpcompile.attend_varlen_blocks_backward(*args)
    return run_varlen_blocks_backward(*args)

"""The block executor: one custom op that runs a rank's attention blocks and merges them by log-sum-exp.

`cpcompile::attend_blocks(q, ks, vs, blocks, scale, kernel, packed_kv=None, windows=None, softcap=0.0,
sinks=None)` runs
every block (layouts.Block, six ints each by blocks.encode_dense, its window in `windows` where any block has
one; sources are ks/vs, then the slots of packed_kv; scores softcapped when softcap > 0; `sinks` (one logit a q
head, sinks.py) folded in after the merge, for a caller whose blocks hold every key of a row) with the kernel
provider, same-shaped blocks batched into one call (calls.py), the calls spread over two CUDA streams
(streams), and merges partial outputs by LSE in fp32 registers (merge). Its registered backward calls each
block's kernel backward with the FINAL output and LSE, which yields the exact partial gradients (the
ring-attention identity), and sums them per row segment, rounding once; autograd never differentiates
through the merge. `acc_out` / `acc_dq` return out / dq in the accumulation dtype (fp32 for bf16), for a
caller that merges several calls (the ring's steps) and must round once, at the end.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ..kernels import get_kernel
from ..precision import acc_dtype
from .blocks import decode_dense, decode_windows
from .calls import Call, batched_rows, plan_calls, segments
from .merge import merge_outputs, sum_into
from .packed_kv import unpack_kv
from .sinks import fold_sinks, sinks_grad
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


def _windows_key(windows: list[int] | None) -> tuple[int, ...] | None:
    return None if windows is None else tuple(windows)


def _extra(c: Call, softcap: float) -> dict:
    """The provider's keyword arguments beyond the plain block: `window` and `softcap` only where used, so
    providers without them keep their plain signature (the planner refused them for sites that need them)."""
    extra = {} if c.window is None else {"window": c.window}
    if softcap:
        extra["softcap"] = softcap
    return extra


def _empty_like_layout(ref: torch.Tensor, last: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor shaped like `ref` with last dim `last`, laid out in ref's dim order (keeps BSHD cheap)."""
    order = sorted(range(ref.dim()), key=lambda d: (-ref.stride(d), d))
    order.remove(ref.dim() - 1)
    order.append(ref.dim() - 1)
    shape = list(ref.shape[:-1]) + [last]
    t = ref.new_empty([shape[d] for d in order], dtype=dtype)
    inverse = [order.index(d) for d in range(ref.dim())]
    return t.permute(inverse)


def call_work(calls: list[Call]) -> list[float]:
    """Relative cost of each call (score entries it computes), for balancing calls over streams."""
    return [c.q_len * c.kv_len * len(c.members) * (0.5 if c.causal else 1.0) for c in calls]


def forward_thunks(impl, q, ks, vs, calls: list[Call], scale: float, softcap: float = 0.0) -> list:
    """One zero-argument kernel forward per call (for streams.run_calls); returns (out, lse)."""
    return [
        lambda c=c: impl.forward(
            _q_view(q, c), _kv_view(ks[c.source], c), _kv_view(vs[c.source], c), c.causal, scale, **_extra(c, softcap)
        )
        for c in calls
    ]


def backward_thunks(impl, dout, q, ks, vs, out, lse, calls: list[Call], scale: float, softcap: float = 0.0) -> list:
    """One zero-argument kernel backward per call, given the final out and lse; returns (dq, dk, dv)."""
    return [
        lambda c=c: impl.backward(
            _q_view(dout, c),
            _q_view(q, c),
            _kv_view(ks[c.source], c),
            _kv_view(vs[c.source], c),
            _q_view(out, c),
            _q_view(lse, c, dim=-1),
            c.causal,
            scale,
            **_extra(c, softcap),
        )
        for c in calls
    ]


def _q_view(t: torch.Tensor, c: Call, dim: int = -2) -> torch.Tensor:
    return batched_rows(t, c.q_start, c.q_step, c.q_len, len(c.members), dim)


def _kv_view(t: torch.Tensor, c: Call) -> torch.Tensor:
    return batched_rows(t, c.kv_start, c.kv_step, c.kv_len, len(c.members), -2)


def _unbatch(t: torch.Tensor, c: Call) -> list[torch.Tensor]:
    """Per-block pieces of a call's result (the batch entries, or the whole result for a single block)."""
    return [t] if len(c.members) == 1 else [t[j : j + 1] for j in range(len(c.members))]


def _assemble(dst: torch.Tensor, pieces: list[tuple[int, int, torch.Tensor]], dim: int, reduce) -> None:
    """Fill dst along `dim` from (start, length, partial) pieces: each segment gets reduce(dst_seg, parts)."""
    for a, b, cover in segments(dst.shape[dim], [(s, n) for s, n, _ in pieces]):
        parts = [pieces[i][2].narrow(dim, a - pieces[i][0], b - a) for i in cover]
        reduce(dst.narrow(dim, a, b - a), parts)


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
    impl = get_kernel(kernel)
    ks, vs = with_packed_sources(ks, vs, packed_kv, q.shape[-1])
    decoded, calls, lanes = planned_calls(tuple(blocks), q.shape[0], _windows_key(windows))
    outs: list[tuple[int, int, torch.Tensor]] = []
    lses: list[tuple[int, int, torch.Tensor]] = []
    thunks = forward_thunks(impl, q, ks, vs, calls, scale, softcap)
    for c, (o, lse) in zip(calls, run_calls(q.device, lanes, thunks)):
        for i, o_i, l_i in zip(c.members, _unbatch(o, c), _unbatch(lse, c)):
            outs.append((decoded[i][0], decoded[i][1], o_i))
            lses.append((decoded[i][0], decoded[i][1], l_i))
    out = _empty_like_layout(q, vs[0].shape[-1], acc_dtype(q.dtype) if acc_out else q.dtype)
    lse_all = q.new_empty(q.shape[:-1], dtype=acc_dtype(q.dtype))
    pieces = list(zip(outs, lses))
    for a, b, cover in segments(q.shape[-2], [(s, n) for s, n, _ in outs]):
        o_parts = [pieces[i][0][2].narrow(-2, a - pieces[i][0][0], b - a) for i in cover]
        l_parts = [pieces[i][1][2].narrow(-1, a - pieces[i][1][0], b - a) for i in cover]
        if not cover:
            out.narrow(-2, a, b - a).zero_()
            lse_all.narrow(-1, a, b - a).fill_(float("-inf"))
            continue
        merge_outputs(out.narrow(-2, a, b - a), lse_all.narrow(-1, a, b - a), o_parts, l_parts)
    if sinks is not None:  # every key of every row is in these blocks: the sink is the merge's last term
        sunk, sunk_lse = fold_sinks(out, lse_all, sinks)
        out.copy_(sunk)
        lse_all.copy_(sunk_lse)
    return out, lse_all


@attend_blocks.register_fake
def _attend_blocks_fake(
    q, ks, vs, blocks, scale, kernel, packed_kv=None, acc_out=False, windows=None, softcap=0.0, sinks=None
):
    vs = with_packed_sources(ks, vs, packed_kv, q.shape[-1])[1]
    out = _empty_like_layout(q, vs[0].shape[-1], acc_dtype(q.dtype) if acc_out else q.dtype)
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
    impl = get_kernel(kernel)
    n_explicit = len(ks)
    ks, vs = with_packed_sources(ks, vs, packed_kv, q.shape[-1])
    decoded, calls, lanes = planned_calls(tuple(blocks), q.shape[0], _windows_key(windows))
    kernel_lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse_k = lse.to(kernel_lse_dtype)
    dq_pieces: list[tuple[int, int, torch.Tensor]] = []
    dk_pieces: list[list[tuple[int, int, torch.Tensor]]] = [[] for _ in ks]
    dv_pieces: list[list[tuple[int, int, torch.Tensor]]] = [[] for _ in vs]
    thunks = backward_thunks(impl, dout, q, ks, vs, out, lse_k, calls, scale, softcap)
    for c, (dq_c, dk_c, dv_c) in zip(calls, run_calls(q.device, lanes, thunks)):
        for i, dq_i, dk_i, dv_i in zip(c.members, _unbatch(dq_c, c), _unbatch(dk_c, c), _unbatch(dv_c, c)):
            q0, qn, src, k0, kn, _ = decoded[i]
            dq_pieces.append((q0, qn, dq_i))
            dk_pieces[src].append((k0, kn, dk_i))
            dv_pieces[src].append((k0, kn, dv_i))
    dq = torch.empty_like(q, dtype=acc_dtype(q.dtype) if acc_dq else q.dtype)
    _assemble(dq, dq_pieces, -2, sum_into)
    # explicit sources get gradients in their dtype; packed sources straight into the packed layout, in fp32
    dpacked = _packed_grad_like(packed_kv, q)
    packed_dks, packed_dvs = with_packed_sources([], [], dpacked if packed_kv is not None else None, q.shape[-1])
    dks = [torch.empty_like(k) for k in ks[:n_explicit]] + packed_dks
    dvs = [torch.empty_like(v) for v in vs[:n_explicit]] + packed_dvs
    for src in range(len(ks)):
        _assemble(dks[src], dk_pieces[src], -2, sum_into)
        _assemble(dvs[src], dv_pieces[src], -2, sum_into)
    return dq, dks[:n_explicit], dvs[:n_explicit], dpacked


@attend_blocks_backward.register_fake
def _attend_blocks_backward_fake(
    dout, q, ks, vs, out, lse, blocks, scale, kernel, packed_kv=None, acc_dq=False, windows=None, softcap=0.0
):
    return (
        torch.empty_like(q, dtype=acc_dtype(q.dtype) if acc_dq else q.dtype),
        [torch.empty_like(k) for k in ks],
        [torch.empty_like(v) for v in vs],
        _packed_grad_like(packed_kv, q),
    )


def _packed_grad_like(packed_kv: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """An uninitialised buffer shaped like the packed K/V in the accumulation dtype (empty when there is none)."""
    shape = packed_kv.shape if packed_kv is not None else (0,)
    return q.new_empty(shape, dtype=acc_dtype(q.dtype))


def with_packed_sources(
    ks: list[torch.Tensor], vs: list[torch.Tensor], packed_kv: torch.Tensor | None, qk_dim: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Append the sources held in a packed all-gather buffer (T, slots, 2, B, H, D) to ks/vs.

    Slot i's K is packed_kv[:, i, 0] and V is packed_kv[:, i, 1] (MLA: (T, slots, B, H, D + Dv), K and V side
    by side, executor.packed_kv), viewed as (B, H, T, D) with no copy. The executor takes the packed buffer
    itself so its backward can write the gradient of every gathered source directly in the layout the
    reduce-scatter sends, in fp32: no pack kernel, no rounding before the sum.
    """
    if packed_kv is None:
        return list(ks), list(vs)
    pairs = [unpack_kv(packed_kv[:, i], 1, qk_dim) for i in range(packed_kv.shape[1])]
    return (
        [*ks, *(k.permute(1, 2, 0, 3) for k, _ in pairs)],
        [*vs, *(v.permute(1, 2, 0, 3) for _, v in pairs)],
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

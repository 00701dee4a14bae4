"""The dense block executor's work, written once as plain torch code: kernel calls on views, then the merge.

`run_forward` / `run_backward` take a rank's planned calls (calls.py) and return new tensors, no in-place writes
into shared buffers, so the same code serves two callers:
- traced (executor/dense.py `attend` with a traceable provider): the region's trace records every kernel call,
  view and merge as graph nodes, so Inductor launches them from its own code, fuses the merges into Triton
  kernels and no cpcompile Python runs per call at run time;
- eager, inside the opaque custom op `cpcompile::attend_blocks` (providers that cannot be traced: FlexAttention
  with a softcap, optional packages), where `run` spreads the calls over two CUDA streams (streams.py).

Merges are the LSE merge of executor/merge.py written as pointwise ops (`merged`), in the accumulation dtype;
partial gradients are summed per row segment in it and rounded once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..precision import acc_dtype
from .calls import Call, batched_rows, segments
from .sinks import fold_sinks

Runner = Callable[[Sequence[int], Sequence[Callable[[], object]]], list]
"""How a list of kernel thunks runs: (lanes, thunks) -> results (streams.run_calls, or in order)."""


def in_order(lanes: Sequence[int], thunks: Sequence[Callable[[], object]]) -> list:
    """Every thunk on the current stream, in order (what a trace records)."""
    del lanes
    return [t() for t in thunks]


def call_work(calls: list[Call]) -> list[float]:
    """Relative cost of each call (score entries it computes), for balancing calls over streams."""
    return [c.q_len * c.kv_len * len(c.members) * (0.5 if c.causal else 1.0) for c in calls]


def _extra(c: Call, softcap: float) -> dict:
    """The provider's keyword arguments beyond the plain block: `window` and `softcap` only where used, so
    providers without them keep their plain signature (the planner refused them for sites that need them)."""
    extra = {} if c.window is None else {"window": c.window}
    if softcap:
        extra["softcap"] = softcap
    return extra


def _q_view(t: torch.Tensor, c: Call, dim: int = -2) -> torch.Tensor:
    return batched_rows(t, c.q_start, c.q_step, c.q_len, len(c.members), dim)


def _kv_view(t: torch.Tensor, c: Call) -> torch.Tensor:
    return batched_rows(t, c.kv_start, c.kv_step, c.kv_len, len(c.members), -2)


def forward_thunks(impl, q, ks, vs, calls: list[Call], scale: float, softcap: float = 0.0) -> list:
    """One zero-argument kernel forward per call (for a Runner); returns (out, lse)."""
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


def _rows(t: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """t.narrow(dim, start, length), or t itself when that is all of it (a trace then records no slice)."""
    return t if start == 0 and length == t.shape[dim] else t.narrow(dim, start, length)


def _unbatch(t: torch.Tensor, c: Call) -> list[torch.Tensor]:
    """Per-block pieces of a call's result (the batch entries, or the whole result for a single block)."""
    return [t] if len(c.members) == 1 else [t[j : j + 1] for j in range(len(c.members))]


def merged(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor], out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The LSE merge of partials (o_i, lse_i) over disjoint keys, as new tensors: lse = log(sum exp lse_i), out =
    sum exp(lse_i - lse) * o_i, computed in the accumulation dtype, out rounded once to `out_dtype`. Rows no
    partial saw (all -inf) get out 0 and lse -inf. The arithmetic of merge_triton's kernel, as pointwise ops."""
    acc_t = acc_dtype(outs[0].dtype)
    ls = [x.to(acc_t) for x in lses]
    if len(outs) == 1:
        return outs[0].to(out_dtype), ls[0]
    top = ls[0]
    for x in ls[1:]:
        top = torch.maximum(top, x)
    top = torch.where(top == float("-inf"), 0.0, top)
    weights = [torch.exp(x - top) for x in ls]
    total = weights[0]
    for w in weights[1:]:
        total = total + w
    inv = torch.where(total > 0, 1.0 / total, 0.0)
    acc = outs[0].to(acc_t) * (weights[0] * inv).unsqueeze(-1)
    for o, w in zip(outs[1:], weights[1:]):
        acc = acc + o.to(acc_t) * (w * inv).unsqueeze(-1)
    lse = torch.where(total > 0, top + torch.log(total), float("-inf"))
    return acc.to(out_dtype), lse


def summed(parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """sum(parts) accumulated in the accumulation dtype of `dtype`, rounded once to `dtype`."""
    acc_t = acc_dtype(dtype)
    total = parts[0].to(acc_t)
    for p in parts[1:]:
        total = total + p.to(acc_t)
    return total.to(dtype)


def _assemble(total: int, pieces: list[tuple[int, int, torch.Tensor]], dim: int, dtype, like: torch.Tensor):
    """A tensor of `total` rows along `dim`: each segment the sum of the (start, length, part) pieces covering it
    (zeros where none does), in `dtype`; `like` gives the other dims."""
    out = []
    for a, b, cover in segments(total, [(s, n) for s, n, _ in pieces]):
        if not cover:
            shape = list(like.shape)
            shape[dim] = b - a
            out.append(like.new_zeros(shape, dtype=dtype))
            continue
        out.append(summed([_rows(pieces[i][2], dim, a - pieces[i][0], b - a) for i in cover], dtype))
    return out[0] if len(out) == 1 else torch.cat(out, dim)


def run_forward(
    impl,
    q: torch.Tensor,
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    decoded: list,
    calls: list[Call],
    scale: float,
    *,
    acc_out: bool = False,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    run: Runner = in_order,
    lanes: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q over every block: the calls' partials merged by LSE per row segment; out in q's dtype,
    lse in the accumulation dtype. `acc_out`: for a caller that folds the result into its own running merge
    (regions/partials.py): out in the accumulation dtype, or as the kernel wrote it where one call wrote every row
    (converting it would be a pass that adds no precision). With `sinks`, every key of every row is in these
    blocks, so the sink is the merge's last term (sinks.py)."""
    acc_t = acc_dtype(q.dtype)
    out_t = acc_t if acc_out else q.dtype
    pieces: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
    for c, (o, lse) in zip(calls, run(lanes, forward_thunks(impl, q, ks, vs, calls, scale, softcap))):
        for i, o_i, l_i in zip(c.members, _unbatch(o, c), _unbatch(lse, c)):
            pieces.append((decoded[i][0], decoded[i][1], o_i, l_i))
    whole = len(pieces) == 1 and pieces[0][:2] == (0, q.shape[-2])
    if acc_out and whole and sinks is None:  # one kernel wrote every row: nothing merged, nothing to round
        return pieces[0][2], pieces[0][3].to(acc_t)
    outs, lses = [], []
    for a, b, cover in segments(q.shape[-2], [(p[0], p[1]) for p in pieces]):
        if not cover:
            shape = (*q.shape[:-2], b - a)
            outs.append(q.new_zeros((*shape, vs[0].shape[-1]), dtype=out_t))
            lses.append(q.new_full(shape, float("-inf"), dtype=acc_t))
            continue
        o_parts = [_rows(pieces[i][2], -2, a - pieces[i][0], b - a) for i in cover]
        l_parts = [_rows(pieces[i][3], -1, a - pieces[i][0], b - a) for i in cover]
        o, lse = merged(o_parts, l_parts, out_t)
        outs.append(o)
        lses.append(lse)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, -2)
    lse = lses[0] if len(lses) == 1 else torch.cat(lses, -1)
    if sinks is not None:
        out, lse = fold_sinks(out, lse, sinks)
    return out, lse


def run_backward(
    impl,
    dout: torch.Tensor,
    q: torch.Tensor,
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    out: torch.Tensor,
    lse: torch.Tensor,
    decoded: list,
    calls: list[Call],
    scale: float,
    *,
    acc_dq: bool = False,
    softcap: float = 0.0,
    source_dtypes: Sequence[torch.dtype] | None = None,
    run: Runner = in_order,
    lanes: Sequence[int] = (),
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """(dq, dks, dvs): every call's kernel backward with the FINAL out and lse (the ring-attention identity),
    partial gradients summed per row segment in the accumulation dtype and rounded once: dq to q's dtype (with
    `acc_dq`, for a caller that sums it further: the accumulation dtype, or as the kernel wrote it where one call
    wrote every row), each source's dk/dv to `source_dtypes` (default: the source's own)."""
    kernel_lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    dq_pieces: list[tuple[int, int, torch.Tensor]] = []
    dk_pieces: list[list[tuple[int, int, torch.Tensor]]] = [[] for _ in ks]
    dv_pieces: list[list[tuple[int, int, torch.Tensor]]] = [[] for _ in vs]
    thunks = backward_thunks(impl, dout, q, ks, vs, out, kernel_lse, calls, scale, softcap)
    for c, (dq_c, dk_c, dv_c) in zip(calls, run(lanes, thunks)):
        for i, dq_i, dk_i, dv_i in zip(c.members, _unbatch(dq_c, c), _unbatch(dk_c, c), _unbatch(dv_c, c)):
            q0, qn, src, k0, kn, _ = decoded[i]
            dq_pieces.append((q0, qn, dq_i))
            dk_pieces[src].append((k0, kn, dk_i))
            dv_pieces[src].append((k0, kn, dv_i))
    if acc_dq and len(dq_pieces) == 1 and dq_pieces[0][:2] == (0, q.shape[-2]):
        dq = dq_pieces[0][2]  # one kernel wrote every row, in its own dtype: the caller sums it in fp32
    else:
        dq = _assemble(q.shape[-2], dq_pieces, -2, acc_dtype(q.dtype) if acc_dq else q.dtype, q)
    dtypes = list(source_dtypes) if source_dtypes is not None else [k.dtype for k in ks]
    dks = [_assemble(k.shape[-2], p, -2, t, k) for k, p, t in zip(ks, dk_pieces, dtypes)]
    dvs = [_assemble(v.shape[-2], p, -2, t, v) for v, p, t in zip(vs, dv_pieces, dtypes)]
    return dq, dks, dvs

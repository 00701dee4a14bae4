"""The token guard's rules, one per op family: what an aten op does to the values that hold this rank's tokens.

Each rule gets the op, its arguments (meta tensors), its outputs and `tag(t)` (a value's tags.Seq / Share / Local
or None), and returns a `Verdict`: the tags of the outputs, or a refusal. The families:

- pointwise (torch's `pointwise` op tag, and the like): tokens keep their place (broadcast to the output); two
  inputs holding tokens on different axes meet every token against every token (refused, as attention is);
- reductions (sum, mean, max, ...) and normalisations over feature dims keep the tokens; over the token axis
  sum/mean/max/min give a `Share`, the rest (var, argmax, softmax, layer_norm over tokens) are refused;
- scans and sorts (cumsum, sort, topk) over other dims keep the tokens, over the token axis are refused;
- matmuls: tokens on the rows (or the columns) of one operand stay there; a contraction over tokens, or tokens on
  both sides, is refused;
- views and reshapes: the token axis is followed through the flat index (a `(B*L, H)` flatten and its unflatten
  keep it); a select or a cut of the token axis is refused;
- indexing: a replicated table (embedding, `rope_cache[positions]`, gather) looked up with token-holding indices
  gives token-holding rows; indexing the token axis by value is refused;
- copies into slices (`new_empty` + `copy_`, `index_put_`) hand the source's tokens to the destination;
- factories are replicated, except an arange over the local length (`Local`: local positions).

A `Share` stays a share through linear uses (scaling by a replicated value, adding shares, views, dtype casts,
a sum over other dims); any other use is refused, as is anything that turns a `Local` value into token data.
An op no rule covers returns None (the caller may ask DTensor, then refuses).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import tags as T
from .tags import Local, Seq, Share

aten = torch.ops.aten


@dataclass(frozen=True)
class Verdict:
    outs: tuple = ()
    """One tag (or None) per output tensor, in pytree order."""
    kind: str | None = None
    """None: fine. "gather": needs other ranks' tokens; "partial": a share used as the total; "branch": a share
    that decides a value (a comparison, a Python number); "positions": a value made from the local length used as
    positions; "unknown": cannot follow."""
    pairwise: bool = False
    detail: str = ""


def refuse(kind: str, detail: str, pairwise: bool = False) -> Verdict:
    return Verdict((), kind, pairwise, detail)


def bind_args(func, args, kwargs) -> dict:
    out = dict(kwargs)
    for a, v in zip(func._schema.arguments, args):
        out[a.name] = v
    return out


def norm_dims(dim, ndim: int) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted({d % max(ndim, 1) for d in dims})


def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


def _identity(tag, n: int) -> tuple:
    return (tag,) * n


# --- pointwise ---------------------------------------------------------------------------------------------------

_LINEAR_SUM = {"add", "sub", "add_", "sub_"}
_SCALE = {"mul", "div", "mul_", "div_", "neg", "true_divide"}
_COMPARE = {"gt", "lt", "ge", "le", "eq", "ne", "gt_", "lt_", "ge_", "le_", "eq_", "ne_", "where"}
"""A share compared: each rank decides on its own tokens (HF's dynamic RoPE: max(position_ids) + 1 > n)."""
_KEEP = {"_to_copy", "clone", "alias", "detach", "lift_fresh", "lift_fresh_copy", "copy", "contiguous",
         "to", "type_as", "positive", "_conj", "conj", "resolve_conj", "resolve_neg"}  # fmt: skip


def _broadcast(tag: Seq, ndim_in: int, ndim_out: int) -> Seq:
    shift = ndim_out - ndim_in
    return Seq(tuple(T.Part(p.dim + shift, p.lo, p.hi) for p in tag.parts))


def merge_inputs(func, name: str, inputs: list, out_ndim: int) -> Verdict:
    """Tokens of every input placed on the output (broadcast), shares combined where linear."""
    seqs, shares, locs, plain = [], [], [], 0
    for t, tag in inputs:
        if isinstance(tag, Seq):
            seqs.append(_broadcast(tag, t.dim(), out_ndim))
        elif isinstance(tag, Share):
            shares.append((t, tag))
        elif isinstance(tag, Local):
            locs.append(tag)
        elif t.numel() > 1 or name in _LINEAR_SUM:
            plain += 1
    if shares:
        if seqs:
            return refuse("partial", f"{shares[0][1].describe()} is used per token")
        kinds = {s.op for _, s in shares}
        linear = len(kinds) == 1 and (
            (name in _LINEAR_SUM and not plain and not locs)
            or (name in _SCALE and len(shares) == 1 and not (name.startswith("div") and inputs[0][1] is None))
            or (name in _KEEP)
        )
        if not linear and name in _COMPARE:
            return refuse("branch", f"{shares[0][1].describe()} is compared ({name})")
        if not linear:
            return refuse("partial", f"{shares[0][1].describe()} goes through {name}, which is not linear in it")
        return Verdict((shares[0][1],))
    if seqs and any(s != seqs[0] for s in seqs):
        return refuse("gather", "it combines tokens held on different axes (every token against every token)", True)
    if seqs and locs:
        return refuse("positions", f"a value {locs[0].describe()} is combined with this rank's tokens")
    if seqs:
        return Verdict((seqs[0],))
    return Verdict((locs[0] if locs else None,))


def pointwise(func, args, kwargs, outs, tag) -> Verdict:
    name = func.__name__.split(".")[0]
    inputs = [(t, tag(t)) for t in _tensor_args(args, kwargs)]
    v = merge_inputs(func, name, inputs, max((o.dim() for o in outs), default=0))
    return v if v.kind else Verdict(v.outs * len(outs))


def _tensor_args(args, kwargs):
    for a in (*args, *kwargs.values()):
        if _is_tensor(a):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if _is_tensor(x))


# --- views ---------------------------------------------------------------------------------------------------------


def reshape(func, args, kwargs, outs, tag) -> Verdict:
    src, out = args[0], outs[0]
    t = tag(src)
    if not isinstance(t, Seq):
        return Verdict(_identity(t, len(outs)))
    before, after = tuple(src.shape), tuple(out.shape)
    if src.numel() != out.numel():  # view_as_real / view_as_complex / view.dtype: the innermost dim scales
        flat = T.to_flat(t, before)
        ratio = out.numel() / max(src.numel(), 1)
        new = (
            None
            if flat is None or flat[0] * ratio != int(flat[0] * ratio)
            else T.from_flat(int(flat[0] * ratio), flat[1], after)
        )
    else:
        new = T.reshaped(t, before, after)
    if new is None:
        return refuse("unknown", f"a reshape from {list(before)} to {list(after)} cuts the token axis apart")
    return Verdict(_identity(new, len(outs)))


def permute(func, args, kwargs, outs, tag) -> Verdict:
    src, t = args[0], tag(args[0])
    if not isinstance(t, Seq):
        return Verdict((t,))
    n, b = src.dim(), bind_args(func, args, kwargs)
    if "dims" in b:
        order = [d % n for d in b["dims"]]
    elif "dim0" in b:
        order = list(range(n))
        d0, d1 = b["dim0"] % n, b["dim1"] % n
        order[d0], order[d1] = order[d1], order[d0]
    else:  # t
        order = list(range(n))[::-1]
    return Verdict((t.moved({old: new for new, old in enumerate(order)}),))


def expand(func, args, kwargs, outs, tag) -> Verdict:
    t = tag(args[0])
    if isinstance(t, Share) and outs[0].numel() > args[0].numel():
        return refuse("partial", f"{t.describe()} is broadcast to be used per token")
    if not isinstance(t, Seq):
        return Verdict((t,))
    return Verdict((_broadcast(t, args[0].dim(), outs[0].dim()),))


def _cut(t: Seq, dim: int, start: int, end: int, step: int, size: int) -> str | None:
    """Why slicing dim `dim` to [start:end:step] cuts the token axis (None: it keeps whole tokens)."""
    part = next((p for p in t.parts if p.dim == dim), None)
    if part is None or (start == 0 and end >= size and step == 1):
        return None
    if len(t.parts) == 1 and step == 1 and start % part.hi == 0 and (min(end, size) % part.hi == 0):
        return None  # only the factor outside the tokens (e.g. rows of a batch merged with them) is sliced
    return f"it slices the token axis (dim {dim}, [{start}:{end}:{step}]): it shifts or drops tokens by LOCAL position"


def slice_(func, args, kwargs, outs, tag) -> Verdict:
    src, t = args[0], tag(args[0])
    b = bind_args(func, args, kwargs)
    dim = b.get("dim", 0) % max(src.dim(), 1)
    size = src.shape[dim] if src.dim() else 1
    start, end, step = b.get("start") or 0, b.get("end"), b.get("step", 1)
    end = size if end is None else end
    start, end = (start + size if start < 0 else start), (end + size if end < 0 else end)
    if isinstance(t, Seq):
        why = _cut(t, dim, start, end, step, size)
        return refuse("gather", why) if why else Verdict((t,))
    if t is None and id(src) in STATE and end - start == LOCAL_LENGTH.get(0) and size != end - start:
        return Verdict((Local(f"a tensor sliced to the local length, [{start}:{end}] of {size}"),))
    return Verdict((t,))


def select(func, args, kwargs, outs, tag) -> Verdict:
    src, t = args[0], tag(args[0])
    if not isinstance(t, Seq):
        return Verdict((t,))
    dim = bind_args(func, args, kwargs)["dim"] % src.dim()
    if dim in t.dims:
        return refuse("gather", f"it takes one token by its LOCAL position (dim {dim})")
    return Verdict((t.moved({d: d - (d > dim) for d in range(src.dim()) if d != dim}),))


def split(func, args, kwargs, outs, tag) -> Verdict:
    src, t = args[0], tag(args[0])
    if not isinstance(t, Seq):
        return Verdict(_identity(t, len(outs)))
    dim = bind_args(func, args, kwargs).get("dim", 0) % src.dim()
    if func.__name__.startswith("unbind"):
        if dim in t.dims:
            return refuse("gather", f"it takes tokens apart by LOCAL position (dim {dim})")
        return Verdict(_identity(t.moved({d: d - (d > dim) for d in range(src.dim()) if d != dim}), len(outs)))
    start = 0
    for o in outs:
        n = o.shape[dim]
        why = _cut(t, dim, start, start + n, 1, src.shape[dim])
        if why:
            return refuse("gather", why)
        start += n
    return Verdict(_identity(t, len(outs)))


def cat(func, args, kwargs, outs, tag) -> Verdict:
    b = bind_args(func, args, kwargs)
    tensors = [x for x in b["tensors"] if x.numel() or x.dim() > 1]
    out = outs[0]
    dim = b.get("dim", 0) % out.dim()
    tagged = [(x, tag(x)) for x in tensors]
    seqs = {t for _, t in tagged if isinstance(t, Seq)}
    if not seqs or all(dim not in s.dims for s in seqs):
        return merge_inputs(func, "cat", tagged, out.dim())
    if len(seqs) > 1 or any(t is None for _, t in tagged):
        return refuse("gather", f"it joins tokens with other values along the token axis (dim {dim})")
    t = seqs.pop()
    if len(t.parts) > 1 or any(x.shape[dim] % t.parts[0].hi for x in tensors):
        return refuse("gather", f"it joins pieces along the token axis (dim {dim})")
    return Verdict((t,))


def trailing(func, args, kwargs, outs, tag) -> Verdict:
    """Ops that add or change only dims after the input's (one_hot, unfold over another dim)."""
    t = tag(args[0])
    b = bind_args(func, args, kwargs)
    if isinstance(t, Seq) and "dimension" in b and b["dimension"] % args[0].dim() in t.dims:
        return refuse("gather", "it takes windows along the token axis")
    return Verdict(_identity(t, len(outs)))


RULES: dict[str, Callable] = {}
"""aten op name (packet) -> rule; filled in rules_more.py's families too."""


def register_rule(rule, *names: str) -> None:
    for n in names:
        RULES[n] = rule


register_rule(reshape, "view", "_unsafe_view", "reshape", "view_as_real", "view_as_complex", "squeeze", "unsqueeze",
          "alias", "detach", "clone", "_to_copy", "lift_fresh", "lift_fresh_copy", "contiguous", "flatten",
          "unflatten", "view_as", "_reshape_alias", "squeeze_", "unsqueeze_", "_to_dense")  # fmt: skip
register_rule(permute, "permute", "transpose", "t", "transpose_", "t_", "numpy_T", "mT", "swapaxes", "swapdims")
register_rule(expand, "expand", "expand_as", "broadcast_to")
register_rule(slice_, "slice")
register_rule(select, "select")
register_rule(split, "split", "split_with_sizes", "chunk", "unbind", "tensor_split", "unsafe_split",
          "unsafe_split_with_sizes")  # fmt: skip
register_rule(cat, "cat", "concat", "concatenate")
register_rule(trailing, "one_hot", "unfold")

STATE: set[int] = set()
"""ids of the model state tensors (parameters, buffers) while a graph is analysed: a slice of one to the local
length is a table cut to this rank's length (a position buffer)."""
LOCAL_LENGTH: dict[int, int] = {}
"""{0: this graph's local sequence length} while a graph is analysed (set by the tracker)."""
register_rule(pointwise, "polar", "complex")  # elementwise, without torch's pointwise tag (Llama 4's RoPE: polar)

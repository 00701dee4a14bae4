"""Rules for lookups, writes and factories: a replicated table read at token-holding indices gives token-holding
rows (embedding, `rope_cache[positions]`, gather); indexing the token axis itself by value reads tokens by LOCAL
position (refused); a write of token data into a slice or at indices hands its tokens to the destination; an
arange over the local length makes local positions (`Local`)."""

from __future__ import annotations

from .rules import LOCAL_LENGTH, RULES, Verdict, bind_args, merge_inputs, refuse, register_rule
from .tags import Local, Part, Seq, Share

_BY_POSITION = "it reads tokens by index along the token axis (LOCAL positions)"


def _shift(t: Seq, by: int) -> Seq:
    return Seq(tuple(Part(p.dim + by, p.lo, p.hi) for p in t.parts))


def _positions(t) -> Verdict | None:
    if isinstance(t, Local):
        return refuse("positions", f"positions {t.describe()} index a table")
    if isinstance(t, Share):
        return refuse("partial", f"{t.describe()} is used as an index")
    return None


def embedding(func, args, kwargs, outs, tag) -> Verdict:
    b = bind_args(func, args, kwargs)
    if tag(b["weight"]) is not None:
        return refuse("gather", "the table it reads holds tokens")
    return _positions(tag(b["indices"])) or Verdict((tag(b["indices"]),))


def index(func, args, kwargs, outs, tag) -> Verdict:
    """x[i0, i1, ...] (aten.index.Tensor): the indexed dims become the indices' broadcast shape."""
    b = bind_args(func, args, kwargs)
    src, idx = b["self"], list(b["indices"])
    t_src = tag(src)
    used = [d for d, i in enumerate(idx) if i is not None]
    for i in idx:
        if i is not None and (v := _positions(tag(i))):
            return v
    if isinstance(t_src, Share):
        return Verdict((t_src,))
    if isinstance(t_src, Seq) and t_src.dims & set(used):
        return refuse("gather", _BY_POSITION)
    out = outs[0]
    bdim = max((i.dim() for i in idx if i is not None), default=0)
    adjacent = used == list(range(used[0], used[-1] + 1)) if used else True
    first = used[0] if adjacent and used else 0
    tags = []
    for i in idx:
        if i is not None and isinstance(tag(i), Seq):
            tags.append(_shift(tag(i), first + bdim - i.dim()))
    if isinstance(t_src, Seq):
        rest = [d for d in range(src.dim()) if d not in used]
        where = {}
        for d in rest:
            if not adjacent:
                where[d] = bdim + rest.index(d)
            else:
                where[d] = d if d < (used[0] if used else 0) else d - len(used) + bdim
        tags.append(t_src.moved(where))
    tags = [x for x in tags if x is not None]
    if len(set(tags)) > 1:
        return refuse("gather", "it relates tokens to each other (token-holding indices into token data)", True)
    return Verdict(((tags[0] if tags else None),) + (None,) * (len(outs) - 1)) if out is not None else Verdict()


def index_select(func, args, kwargs, outs, tag) -> Verdict:
    b = bind_args(func, args, kwargs)
    src, dim, i = b["self"], b["dim"] % max(b["self"].dim(), 1), b["index"]
    t_src, t_i = tag(src), tag(i)
    if (v := _positions(t_i)) is not None:
        return v
    if isinstance(t_src, Seq) and dim in t_src.dims:
        return refuse("gather", _BY_POSITION)
    tags = [t_src] if isinstance(t_src, Seq) else []
    tags += [_shift(t_i, dim)] if isinstance(t_i, Seq) else []
    if len(set(tags)) > 1:
        return refuse("gather", "it relates tokens to each other", True)
    return Verdict((tags[0] if tags else (t_src if isinstance(t_src, Share) else None),))


def gather(func, args, kwargs, outs, tag) -> Verdict:
    """gather(self, dim, index): the output has index's shape."""
    b = bind_args(func, args, kwargs)
    src, dim, i = b["self"], b["dim"] % max(b["self"].dim(), 1), b["index"]
    t_src, t_i = tag(src), tag(i)
    if (v := _positions(t_i)) is not None:
        return v
    if isinstance(t_src, Seq) and dim in t_src.dims:
        return refuse("gather", _BY_POSITION)
    return merge_inputs(func, "gather", [(src, t_src), (i, t_i)], outs[0].dim())


def write(func, args, kwargs, outs, tag) -> Verdict:
    """copy_, index_put_, scatter, index_add, slice_scatter, masked_scatter, fill_: the destination (and the
    functional result) holds what is written: the source's tokens, placed where the destination's dims are."""
    b = bind_args(func, args, kwargs)
    dest = b.get("self")
    dim = b.get("dim")
    name = func.__name__.split(".")[0]
    t_dest = tag(dest)
    sources = [v for k, v in b.items() if k != "self" and hasattr(v, "dim")]
    sources += [x for k, v in b.items() if isinstance(v, (list, tuple)) for x in v if hasattr(x, "dim")]
    if dim is not None and isinstance(dim, int) and dest is not None:
        dim %= max(dest.dim(), 1)
        if isinstance(t_dest, Seq) and dim in t_dest.dims and name not in ("slice_scatter",):
            return refuse("gather", _BY_POSITION)
    if name in ("slice_scatter", "select_scatter") and isinstance(t_dest, Seq) and dim in t_dest.dims:
        return refuse("gather", "it writes into part of the token axis (LOCAL positions)")
    for s in sources:
        if (v := _positions(tag(s))) is not None and name not in ("index_put", "index_put_", "_index_put_impl_"):
            return v
    if name in ("index_put", "index_put_", "_index_put_impl_"):
        values = b.get("values")
        idx = [i for i in b.get("indices", ()) if i is not None]
        if isinstance(t_dest, Seq) and any(tag(i) is not None for i in idx):
            return refuse("gather", _BY_POSITION)
        if tag(values) is not None and not isinstance(t_dest, Seq):
            if any(isinstance(tag(i), Seq) for i in idx):
                return refuse("unknown", "it writes token data at token-holding indices")
        sources = [values]
    pieces = [(dest, t_dest)] + [(s, tag(s)) for s in sources if s is not None]
    v = merge_inputs(func, "copy", pieces, dest.dim() if dest is not None else 0)
    if v.kind:
        return v
    return Verdict(v.outs * max(len(outs), 1))


def _unit_step(args, kwargs) -> bool:
    """Positions step by one; an arange with another step (RoPE's frequencies: arange(0, D, 2)) is not positions,
    even when it happens to be as long as the local sequence."""
    step = args[2] if len(args) > 2 else kwargs.get("step", 1)
    return step == 1


def factory(func, args, kwargs, outs, tag) -> Verdict:
    """New tensors are replicated; an arange as long as the local sequence makes local positions."""
    name = func.__name__.split(".")[0]
    length = LOCAL_LENGTH.get(0)
    if (
        name == "arange"
        and length
        and outs
        and outs[0].dim() == 1
        and outs[0].shape[0] == length
        and _unit_step(args, kwargs)
    ):
        return Verdict((Local(f"torch.arange of the local length {length}"),))
    return Verdict((None,) * len(outs))


def to_python(func, args, kwargs, outs, tag) -> Verdict:
    """item(), nonzero, unique: a per-rank value leaves the graph's data (a branch, a size)."""
    t = next((tag(a) for a in args if hasattr(a, "dim") and tag(a) is not None), None)
    what = t.describe() if t is not None else "a value"
    return refuse("branch" if isinstance(t, Share) else "gather", f"{what} decides a Python value or a size here")


register_rule(embedding, "embedding")
register_rule(index, "index", "_unsafe_index")
register_rule(index_select, "index_select")
register_rule(gather, "gather", "take_along_dim")
register_rule(write, "copy_", "copy", "index_put_", "index_put", "_index_put_impl_", "scatter", "scatter_",
          "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_", "index_add", "index_add_",
          "index_copy", "index_copy_", "slice_scatter", "select_scatter", "masked_scatter", "masked_scatter_",
          "fill_", "zero_", "index_fill", "index_fill_", "_unsafe_index_put")  # fmt: skip
register_rule(factory, "arange", "zeros", "ones", "empty", "full", "randn", "rand", "randint", "empty_strided",
          "scalar_tensor", "new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided", "zeros_like",
          "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like", "eye", "linspace",
          "tensor", "_efficientzerotensor", "randperm")  # fmt: skip
register_rule(to_python, "_local_scalar_dense", "nonzero", "unique", "_unique2", "unique_consecutive", "bincount",
          "histc", "masked_select", "argwhere", "nonzero_static")  # fmt: skip
RULES.setdefault("lift_fresh_copy", RULES["lift_fresh"])

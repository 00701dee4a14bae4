"""Rules for ops that work along dims: reductions, scans and sorts, normalisations, losses, matmuls, convolutions
and pooling. Along a feature dim they keep the tokens where they are; along the token axis a sum/mean/max/min
gives a per-rank Share and everything else needs other ranks' tokens (refused)."""

from __future__ import annotations

from .rules import RULES, Verdict, bind_args, norm_dims, refuse, register_rule
from .tags import Part, Seq, Share

SHARE_OF = {"sum": "sum", "nansum": "sum", "mean": "avg", "nanmean": "avg", "amax": "max", "amin": "min",
            "any": "max", "all": "min", "count_nonzero": "sum", "max": "max", "min": "min"}  # fmt: skip


def _dropped(t: Seq, dims: list[int], ndim: int, keepdim: bool) -> Seq:
    if keepdim:
        return t
    return t.moved({d: d - sum(x < d for x in dims) for d in range(ndim) if d not in dims})


def reduction(func, args, kwargs, outs, tag) -> Verdict:
    src, t = args[0], tag(args[0])
    name = func.__name__.split(".")[0]
    b = bind_args(func, args, kwargs)
    dims = norm_dims(b.get("dim"), src.dim())
    keep = bool(b.get("keepdim", False))
    if isinstance(t, Share):
        ok = SHARE_OF.get(name) == t.op or (t.op in ("sum", "avg") and name in ("sum", "mean", "nansum"))
        if ok and len(outs) == 1:
            return Verdict((t,))
        return refuse("partial", f"{t.describe()} is reduced by {name}")
    if not isinstance(t, Seq):
        return Verdict((t,) * len(outs))
    if not t.dims & set(dims):
        return Verdict((_dropped(t, dims, src.dim(), keep),) * len(outs))
    share = SHARE_OF.get(name)
    if share is None or len(outs) > 1:
        return refuse("gather", f"{name} over the token axis needs every rank's tokens")
    return Verdict((Share(share),))


def along(func, args, kwargs, outs, tag) -> Verdict:
    """softmax, scans, sorts, topk: along one dim, output dims like the input's (kthvalue/median/mode drop it)."""
    src, t = args[0], tag(args[0])
    if isinstance(t, Share):
        return refuse("partial", f"{t.describe()} goes through {func.__name__}")
    if not isinstance(t, Seq):
        return Verdict((t,) * len(outs))
    b = bind_args(func, args, kwargs)
    dim = b.get("dim", -1) % max(src.dim(), 1)
    if dim in t.dims:
        return refuse("gather", f"{func.__name__.split('.')[0]} runs along the token axis (dim {dim})")
    same = all(o.dim() == src.dim() for o in outs)
    return Verdict((t if same else _dropped(t, [dim], src.dim(), False),) * len(outs))


def norm(func, args, kwargs, outs, tag) -> Verdict:
    """layer_norm / rms_norm over the last dims, group_norm over channels and space, batch_norm over batch and
    space (in training)."""
    src, t = args[0], tag(args[0])
    if isinstance(t, Share):
        return refuse("partial", f"{t.describe()} is normalised")
    if not isinstance(t, Seq):
        return Verdict((t,) * len(outs))
    name, b, n = func.__name__, bind_args(func, args, kwargs), src.dim()
    if "normalized_shape" in b:
        mixed = set(range(n - len(b["normalized_shape"]), n))
    elif "group" in b:
        mixed = set(range(1, n))
    elif "no_training" in name or b.get("training") is False:
        mixed = set()
    else:
        mixed = {0, *range(2, n)}
    if t.dims & mixed:
        return refuse("gather", f"{name.split('.')[0]} normalises over the token axis")
    return Verdict(tuple(t if o.dim() == n else None for o in outs))


def loss(func, args, kwargs, outs, tag) -> Verdict:
    """nll_loss and the pointwise losses: per token (reduction none) or a Share (sum, mean)."""
    b = bind_args(func, args, kwargs)
    tagged = [tag(x) for x in (b.get("self"), b.get("target")) if x is not None]
    seq = next((x for x in tagged if isinstance(x, Seq)), None)
    if any(isinstance(x, Share) for x in tagged):
        return refuse("partial", "a per-rank partial over tokens goes into a loss")
    src = b["self"]
    if seq is not None and "nll_loss" in func.__name__ and 1 in seq.dims and src.dim() > 1:
        return refuse("gather", "the class dim holds tokens")
    reduction = b.get("reduction", 1)
    if seq is None:
        return Verdict((None,) * len(outs))
    if reduction == 0:
        return Verdict((seq if "nll_loss2d" in func.__name__ or src.dim() == 1 else Seq((Part(0, *_rows(seq)),)),)
                       + (Share("sum"),) * (len(outs) - 1))  # fmt: skip
    return Verdict((Share("avg" if reduction == 1 else "sum"),) + (Share("sum"),) * (len(outs) - 1))


def _rows(seq: Seq) -> tuple[int, int]:
    p = seq.parts[0]
    return p.lo, p.hi


def _operands(b: dict) -> tuple:
    """(left, right, bias) of a matmul's bound arguments."""
    for left, right in (("mat1", "mat2"), ("batch1", "batch2"), ("mat", "vec")):
        if left in b:
            return b[left], b[right], b.get("self")
    return b["self"], b.get("mat2", b.get("vec", b.get("tensor"))), None


def matmul(func, args, kwargs, outs, tag) -> Verdict:
    """mm (m,k)@(k,n), bmm (b,m,k)@(b,k,n), their add* forms, mv, dot."""
    a, c, bias = _operands(bind_args(func, args, kwargs))
    ta, tc, tb = tag(a), tag(c), (tag(bias) if bias is not None else None)
    shares = [x for x in (ta, tc, tb) if isinstance(x, Share)]
    if shares:
        if len(shares) > 1 or any(isinstance(x, Seq) for x in (ta, tc, tb)):
            return refuse("partial", f"{shares[0].describe()} goes into a matmul with other token data")
        return Verdict((shares[0],))
    na, nc, no = a.dim(), c.dim(), outs[0].dim()
    k_c = nc - 2 if nc >= 2 else 0
    mapped = []
    if isinstance(ta, Seq):
        if na - 1 in ta.dims:
            return refuse("gather", _CONTRACT, isinstance(tc, Seq))
        mapped.append(ta)
    if isinstance(tc, Seq):
        if k_c in tc.dims:
            return refuse("gather", _CONTRACT, isinstance(ta, Seq))
        mapped.append(tc.moved({**{d: d for d in range(nc - 2)}, nc - 1: no - 1}))
    if isinstance(tb, Seq):
        mapped.append(Seq(tuple(Part(p.dim + no - bias.dim(), p.lo, p.hi) for p in tb.parts)))
    if len(set(mapped)) > 1:
        return refuse("gather", "it relates tokens to each other, as attention does", True)
    return Verdict((mapped[0] if mapped else None,))


_CONTRACT = "it contracts over the token axis (a sum over this rank's tokens only)"


def convolution(func, args, kwargs, outs, tag) -> Verdict:
    b = bind_args(func, args, kwargs)
    x = b.get("input", args[0])
    t = tag(x)
    if tag(b.get("weight")) is not None:
        return refuse("gather", "its weight holds tokens")
    if not isinstance(t, Seq):
        return Verdict((t,))
    weight = b.get("weight")
    for p in t.parts:
        if p.dim == 1:
            return refuse("gather", "it contracts over channels that hold tokens")
        if p.dim >= 2:
            k = weight.shape[p.dim] if weight is not None else 2
            i = p.dim - 2
            stride, pad = b.get("stride", [1])[i % len(b.get("stride", [1]))], b.get("padding", [0])
            if k != 1 or stride != 1 or (pad and pad[i % len(pad)]):
                return refuse("gather", f"it convolves or pools along the token axis (dim {p.dim})")
    return Verdict((t,))


def pool(func, args, kwargs, outs, tag) -> Verdict:
    t = tag(args[0])
    if isinstance(t, Seq) and any(p.dim >= 2 for p in t.parts):
        return refuse("gather", "it pools along the token axis")
    return Verdict((t,) * len(outs))


def pad(func, args, kwargs, outs, tag) -> Verdict:
    """constant_pad_nd / reflection / replication pads: the pad list runs from the last dim backwards."""
    src, t = args[0], tag(args[0])
    if not isinstance(t, Seq):
        return Verdict((t,))
    widths = list(bind_args(func, args, kwargs).get("pad", ()))
    for i in range(0, len(widths), 2):
        d = src.dim() - 1 - i // 2
        if d in t.dims and (widths[i] or widths[i + 1]):
            return refuse("gather", f"it pads the token axis (dim {d}): it shifts tokens by LOCAL position")
    return Verdict((t,))


def flip(func, args, kwargs, outs, tag) -> Verdict:
    src, t = args[0], tag(args[0])
    b = bind_args(func, args, kwargs)
    dims = norm_dims(b.get("dims", b.get("dim", [])), src.dim())
    if isinstance(t, Seq) and t.dims & set(dims):
        return refuse("gather", f"{func.__name__.split('.')[0]} moves tokens along the token axis")
    if isinstance(t, Seq) and func.__name__.startswith(("tril", "triu")) and t.dims & {src.dim() - 1, src.dim() - 2}:
        return refuse("gather", "a triangle over the token axis uses LOCAL positions")
    return Verdict((t,) * len(outs))


def repeat(func, args, kwargs, outs, tag) -> Verdict:
    src, t = args[0], tag(args[0])
    if not isinstance(t, Seq):
        return Verdict((t,))
    b = bind_args(func, args, kwargs)
    if func.__name__.startswith("repeat_interleave"):
        r, dim = b.get("repeats"), b.get("dim")
        if not isinstance(r, int) or dim is None:
            return refuse("unknown", "repeat_interleave with tensor repeats or no dim over tokens")
        dim %= src.dim()
        return Verdict((Seq(tuple(Part(p.dim, p.lo * r, p.hi * r) if p.dim == dim else p for p in t.parts)),))
    return Verdict((Seq(tuple(Part(p.dim + outs[0].dim() - src.dim(), p.lo, p.hi) for p in t.parts)),))


register_rule(reduction, *SHARE_OF, "argmax", "argmin", "prod", "var", "std", "var_mean", "std_mean", "logsumexp",
          "linalg_vector_norm", "norm", "median", "nanmedian")  # fmt: skip
RULES["max"] = RULES["min"] = reduction
register_rule(along, "_softmax", "softmax", "_log_softmax", "log_softmax", "cumsum", "cumprod", "cummax", "cummin",
          "logcumsumexp", "sort", "argsort", "topk", "kthvalue", "mode", "_safe_softmax", "cumsum_",
          "msort")  # fmt: skip
register_rule(norm, "native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm", "native_group_norm",
          "group_norm", "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
          "_native_batch_norm_legit_functional", "batch_norm", "instance_norm")  # fmt: skip
register_rule(loss, "nll_loss_forward", "nll_loss2d_forward", "nll_loss", "nll_loss_nd", "mse_loss", "l1_loss",
          "smooth_l1_loss", "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
          "kl_div")  # fmt: skip
register_rule(matmul, "mm", "bmm", "addmm", "baddbmm", "mv", "addmv", "dot", "vdot", "_addmm_activation")
register_rule(convolution, "convolution", "_convolution", "conv1d", "conv2d", "conv3d")
register_rule(pool, "avg_pool1d", "avg_pool2d", "avg_pool3d", "max_pool1d", "max_pool2d", "max_pool3d",
          "max_pool2d_with_indices", "max_pool3d_with_indices", "_adaptive_avg_pool2d", "adaptive_avg_pool1d",
          "_adaptive_avg_pool3d", "adaptive_max_pool2d", "adaptive_max_pool1d")  # fmt: skip
register_rule(pad, "constant_pad_nd", "reflection_pad1d", "reflection_pad2d", "replication_pad1d", "replication_pad2d",
          "_pad_circular", "pad")  # fmt: skip
register_rule(flip, "flip", "roll", "tril", "triu", "diagonal", "diag_embed", "fliplr", "flipud", "rot90")
register_rule(repeat, "repeat", "repeat_interleave", "tile")

"""Stand-ins for cpcompile's region calls: the guard does not run a region (it would communicate); it checks
that the region's inputs hold the tokens on its sequence dim and hands back a fresh output of the traced shape
holding them there (an attention region: its family's rule, Family.seq_dim / out_seq_dims; a token mixer's region,
node meta `cpcompile_token_region`: its declared seq dim); a rank_total region's outputs are replicated values."""

from __future__ import annotations

import torch
import torch.fx

from ..families.registry import get_family
from .flow import NodeTracker, fresh, leaves, tensors, traced
from .tags import Share, whole


def region(tracker: NodeTracker, plan, node: torch.fx.Node, args):
    """A CP attention region, by its family's rule (families/family.py): q/k/v must arrive holding tokens on the
    family's sequence dim; the outputs hold them on `out_seq_dims`. Fields the family names untokened (flex's
    score_mod/mask_mod buffers, indexed by GLOBAL position) must not hold the sharded tokens."""
    family = get_family(plan.site.kind)
    seq = family.seq_dim
    call = family.call._make(args[: len(family.call._fields)])
    for t in (call.q, call.k, call.v):
        tag = tracker.tag(t)
        if isinstance(tag, Share):
            tracker.flag("the attention region", "partial", detail=f"{tag.describe()} goes into attention")
        elif tracker.seq_dim(t) != seq:
            tracker.result.inconsistent.append(node)
    out = fresh(traced(node))
    for t in tensors([getattr(call, name) for name in family.untokened_fields], {}):
        if (tag := tracker.tag(t)) is not None:
            tracker.flag(family.untokened_what, "flex_buffer", detail=tag.describe())
    if isinstance(out, torch.Tensor):
        tracker.place(out, whole(family.out_seq_dims[0], out.shape[family.out_seq_dims[0]]))
    else:
        for t, d in zip(out, family.out_seq_dims):
            tracker.place(t, whole(d, t.shape[d]))
    return out


def token_region(tracker: NodeTracker, node: torch.fx.Node, args, kwargs, seq: int):
    """A token mixer's head-parallel region (cpcompile/mixers/): its token inputs must arrive holding tokens on
    `seq` (weights hold none); its outputs hold them there."""
    for t in tensors(args, kwargs):
        tag = tracker.tag(t)
        if isinstance(tag, Share):
            tracker.flag("the token mixer region", "partial", detail=f"{tag.describe()} goes into it")
        elif tag is not None and tracker.seq_dim(t) != seq % t.dim():
            tracker.result.inconsistent.append(node)
    out = fresh(traced(node))
    for t in leaves(out):
        tracker.place(t, whole(seq % t.dim(), t.shape[seq]))
    return out


def rank_total(tracker: NodeTracker, node: torch.fx.Node, args):
    """A rank_total region (cpcompile/rank_total.py): per-rank partial sums (Shares) summed over the CP group, so
    its outputs are whole values every rank holds alike. A token-holding input would be summed with other ranks'
    different tokens: refused."""
    for t in tensors(args, {}):
        tag = tracker.tag(t)
        if tag is not None and not isinstance(tag, Share):
            tracker.flag("the rank_total region", "gather", detail=f"{tag.describe()} goes into a sum over the ranks")
    return fresh(traced(node))

"""Stand-ins for cpcompile's region calls: the guard does not run a region (it would communicate); it checks
that the region's inputs hold the tokens on its sequence dim and hands back a fresh output of the traced shape
holding them there (SDPA out dim 2; varlen out dim 0, lse dim 1; flex out and lse dim 2; a token mixer's region,
node meta `cpcompile_token_region`: its declared seq dim)."""

from __future__ import annotations

import torch
import torch.fx

from .flow import NodeTracker, fresh, leaves, tensors, traced
from .tags import Share, whole


def region(tracker: NodeTracker, plan, node: torch.fx.Node, args):
    """A CP attention region: q/k/v must arrive holding tokens on their sequence dim; the output holds them
    there. A flex region's score_mod/mask_mod buffers must not hold the sharded tokens: the mods index them by
    GLOBAL position."""
    seq = 0 if plan.site.kind == "varlen" else 2
    for t in args[:3]:
        tag = tracker.tag(t)
        if isinstance(tag, Share):
            tracker.flag("the attention region", "partial", detail=f"{tag.describe()} goes into attention")
        elif tracker.seq_dim(t) != seq:
            tracker.result.inconsistent.append(node)
    out = fresh(traced(node))
    if plan.site.kind == "sdpa":
        tracker.place(out, whole(seq, out.shape[seq]))
    elif plan.site.kind == "flex":  # (out, lse, max_scores)
        for t in tensors(args[5:], {}):
            if (tag := tracker.tag(t)) is not None:
                tracker.flag("a flex_attention score_mod/mask_mod buffer", "flex_buffer", detail=tag.describe())
        for t in out:
            tracker.place(t, whole(seq, t.shape[seq]))
    else:
        for t, d in zip(out, (0, 1)):
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

"""The head-parallel (Ulysses) region around a declared token mixer, written once for any mixer.

Before the mixer every token input goes through an all-to-all (exchange.to_heads): each rank then holds the
whole sequence, in global order, for its heads/cp heads (channels); weights that split with the heads are
narrowed to this rank's slice; the mixer's own code runs unchanged on that; every tensor output comes back
(exchange.to_tokens). Autograd differentiates the collectives (each all-to-all's backward is the reverse
all-to-all) and the narrowing (a weight's gradient is this rank's heads' slice, summed over ranks with the other
parameter gradients), so backward needs nothing of its own.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from ..layouts import get_layout
from .declare import MIXERS
from .exchange import to_heads, to_tokens


def mixer_region(
    *flat,
    key: int,
    weight_dims: tuple[int | None, ...],
    call_kwargs: dict,
    layout: str,
    group_name: str,
    rank: int,
    world: int,
):
    """Run declared mixer `key` head-parallel: `flat` = its weights (split along weight_dims, None: shared),
    then its positional arguments; `call_kwargs` its keyword arguments. Tensor arguments hold this rank's tokens."""
    spec = MIXERS[key]
    lay = get_layout(layout)
    n = len(weight_dims)
    weights = []
    for w, d in zip(flat[:n], weight_dims):
        if d is not None:
            part = w.shape[d] // world
            w = w.narrow(d, rank * part, part)
        weights.append(w)

    def heads(x):
        if not isinstance(x, torch.Tensor):
            return x
        return to_heads(x, spec.heads_dim, spec.seq_dim, lay, group_name, world)

    args = pytree.tree_map(heads, tuple(flat[n:]))
    kwargs = pytree.tree_map(heads, dict(call_kwargs))
    out = spec.call(weights, args, kwargs)

    def tokens(y):
        if not isinstance(y, torch.Tensor):
            return y
        return to_tokens(y, spec.heads_dim, spec.seq_dim, lay, group_name, world)

    return pytree.tree_map(tokens, out)

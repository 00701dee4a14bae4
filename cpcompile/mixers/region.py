"""The head-parallel (Ulysses) region around a declared token mixer, written once for any mixer.

Before the mixer every token input goes through an all-to-all (exchange.to_heads): each rank then holds the
whole sequence, in global order, for its heads/cp heads (channels); weights that split with the heads are
narrowed to this rank's slice; the mixer's own code runs unchanged on that; every tensor output comes back
(exchange.to_tokens). Shared inputs (no heads dim, read by every head: Mamba1's B and C) are all-gathered
whole instead (exchange.gather_tokens, whose backward sums the ranks' gradients). Autograd differentiates the
collectives (each all-to-all's backward is the reverse all-to-all) and the narrowing (a weight's gradient is this
rank's heads' slice, summed over ranks with the other parameter gradients), so backward needs nothing of its own.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from ..layouts import get_layout
from .declare import MIXERS
from .exchange import gather_tokens, to_heads, to_tokens


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
        if d is not None and isinstance(w, torch.Tensor):
            part = w.shape[d] // world
            w = w.narrow(d, rank * part, part)
        weights.append(w)

    call_kwargs = dict(call_kwargs)
    shared = {name: call_kwargs.pop(name) for name in spec.shared_inputs if name in call_kwargs}
    shared = {  # every head reads all of their tokens
        name: gather_tokens(t, spec.seq_dim, lay, group_name, world) if isinstance(t, torch.Tensor) else t
        for name, t in shared.items()
    }
    inputs, spec_in = pytree.tree_flatten((tuple(flat[n:]), call_kwargs))
    tensors = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)]
    moved = to_heads([inputs[i] for i in tensors], spec.heads_dim, spec.seq_dim, lay, group_name, world)
    for i, t in zip(tensors, moved):
        inputs[i] = t
    args, kwargs = pytree.tree_unflatten(inputs, spec_in)
    out = spec.call(weights, args, kwargs | shared)
    outputs, spec_out = pytree.tree_flatten(out)
    tensors = [i for i, t in enumerate(outputs) if isinstance(t, torch.Tensor)]
    back = to_tokens([outputs[i] for i in tensors], spec.heads_dim, spec.seq_dim, lay, group_name, world)
    for i, t in zip(tensors, back):
        outputs[i] = t
    return pytree.tree_unflatten(outputs, spec_out)

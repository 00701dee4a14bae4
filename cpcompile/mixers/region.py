"""The head-parallel (Ulysses) region around a declared token mixer, written once for any mixer: comm="a2a"'s
head_parallel (comms/a2a/head_parallel.py) with the mixer as its inner function, through exchange.MixerHeads.

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

from ..comms.a2a.head_parallel import head_parallel
from ..layouts import get_layout
from .declare import MIXERS
from .exchange import MixerHeads, gather_tokens


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
    produced = []  # the mixer's flat outputs and their tree

    def run(*moved: torch.Tensor) -> list[torch.Tensor]:
        """The mixer's own code on every token of this rank's heads; its tensor outputs, in order."""
        for i, t in zip(tensors, moved):
            inputs[i] = t
        args, kwargs = pytree.tree_unflatten(inputs, spec_in)
        outputs, spec_out = pytree.tree_flatten(spec.call(weights, args, kwargs | shared))
        produced.extend((outputs, spec_out))
        return [t for t in outputs if isinstance(t, torch.Tensor)]

    exchange = MixerHeads(spec.heads_dim, spec.seq_dim, lay, group_name, world)
    back = iter(head_parallel(run, [inputs[i] for i in tensors], exchange))
    outputs, spec_out = produced
    outputs = [next(back) if isinstance(t, torch.Tensor) else t for t in outputs]
    return pytree.tree_unflatten(outputs, spec_out)

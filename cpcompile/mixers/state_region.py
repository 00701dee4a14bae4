"""The state-passing regions (comm="state", flat layout: rank r holds tokens [r*L, (r+1)*L)), written once for
any declared mixer of each kind. Every rank runs the mixer on its own tokens, all heads; what the tokens before
them leave behind comes from the earlier ranks.

`halo_region` (a causal conv-like mixer that reads `context` earlier tokens): the previous rank's last `context`
tokens of every token input are put before this rank's (zeros on rank 0: the conv's own zero padding), the mixer
runs, the first `context` outputs are dropped. One send to the next rank a token input, its gradient sent back.

`state_region` (a chunked linear recurrence in flash-linear-attention's convention): the final state is affine in
the initial one, S_out = M @ S_in + B per head (M: Dk x Dk, B: Dk x Dv), and so is every output, o = O + P @ S_in,
column by column of the values. One run of the mixer's own code gets all four: values [v | 0] (Dv + Dk columns)
from the initial state [0 | I] give outputs [O | P] and the final state [B | M]. The (B | M) of every rank are
all-gathered (H x Dk x (Dv + Dk) a rank, whatever the length), composed in rank order in fp32 (or the state's
wider dtype) into this rank's initial state S, and o = O + P @ S. Backward is autograd's: the gather's is a
reduce-scatter (every later rank reads a rank's transition), the rest differentiates the mixer's own code.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from .declare import MIXERS
from .exchange import dense_grad
from .passing import attach, from_previous, gather_states


def halo_region(*flat, key: int, call_kwargs: dict, context: int, group_name: str, rank: int, world: int):
    """Run declared mixer `key` on this rank's tokens with the previous rank's last `context` tokens first."""
    spec = MIXERS[key]
    n = len(spec.weight_names)
    inputs, tree = pytree.tree_flatten((tuple(flat[n:]), dict(call_kwargs)))
    seq = spec.seq_dim
    length = None
    for i, t in enumerate(inputs):
        if isinstance(t, torch.Tensor) and context:
            length = t.shape[seq]
            halo = from_previous(t.narrow(seq, length - context, context), group_name, rank, world)
            inputs[i] = dense_grad(torch.cat([halo, t], dim=seq))
    args, kwargs = pytree.tree_unflatten(inputs, tree)
    out = spec.call(flat[:n], args, kwargs)
    if not context:
        return out
    return pytree.tree_map(
        lambda t: dense_grad(t.narrow(seq, context, length)) if isinstance(t, torch.Tensor) else t, out
    )


def _initial_states(gathered: torch.Tensor, rank: int, dv: int, acc: torch.dtype) -> torch.Tensor | None:
    """This rank's initial state: S_0 = 0, S_{j+1} = M_j @ S_j + B_j over the earlier ranks (None on rank 0)."""
    state = None
    for j in range(rank):
        b, m = gathered[j].to(acc).split([dv, gathered.shape[-1] - dv], dim=-1)
        state = b if state is None else m @ state + b
    return state


def _subscripts(dim: int, heads_dim: int, seq_dim: int, last: str) -> str:
    letters = ["b", "x", "y", last]
    letters[heads_dim % dim], letters[seq_dim % dim] = "h", "l"
    return "".join(letters)


def state_region(
    *flat, key: int, call_kwargs: dict, key_dim: int, state_dtype: torch.dtype, group_name: str, rank: int, world: int
):
    """Run declared linear recurrence `key` on this rank's tokens from the state the earlier ranks leave; returns
    (output, None) as the mixer does with output_final_state=False."""
    spec = MIXERS[key]
    names = spec.state
    n = len(spec.weight_names)
    inputs, tree = pytree.tree_flatten(spec.named(tuple(flat[n:]), dict(call_kwargs)))
    args, kwargs = pytree.tree_unflatten([dense_grad(t) if isinstance(t, torch.Tensor) else t for t in inputs], tree)
    v = kwargs[names.value]
    dv, batch, heads = v.shape[-1], v.shape[0], v.shape[spec.heads_dim]
    kwargs[names.value] = torch.cat([v, v.new_zeros(*v.shape[:-1], key_dim)], dim=-1)
    eye = torch.eye(key_dim, dtype=state_dtype, device=v.device).expand(batch, heads, key_dim, key_dim)
    zeros = torch.zeros(batch, heads, key_dim, dv, dtype=state_dtype, device=v.device)
    kwargs[names.initial_state] = torch.cat([zeros, eye], dim=-1)
    kwargs[names.output_final_state] = True
    out, final = spec.call(flat[:n], args, kwargs)
    acc = torch.promote_types(torch.promote_types(final.dtype, out.dtype), torch.float32)
    gathered = gather_states(final, group_name, world)
    state = _initial_states(gathered, rank, dv, acc)
    o, p = out.split([dv, key_dim], dim=-1)
    if state is None:  # rank 0 starts from zeros, but joins the gather's backward (a reduce-scatter) all the same
        o = attach(o, gathered)
    else:
        sub = _subscripts(o.dim(), spec.heads_dim, spec.seq_dim, "k")
        read = torch.einsum(f"{sub},bhkv->{sub.replace('k', 'v')}", p.to(state.dtype), state)
        o = (o.to(state.dtype) + read).to(o.dtype)
    return dense_grad(o), None

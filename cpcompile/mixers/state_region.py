"""The state-passing regions (comm="state"), written once for any declared mixer of each kind and any chunk
layout. Every rank runs the mixer on its own tokens, all heads, once per chunk it owns (flat: one, zigzag: two,
chunks r and 2cp-1-r); what the tokens before each chunk leave behind comes from the chunk before it in sequence
order (mixers/chain.py: another rank's, or this rank's own).

`halo_region` (a causal conv-like mixer that reads `context` earlier tokens): each chunk gets the last `context`
tokens of the chunk before it put first (zeros before the sequence's first chunk: the conv's own zero padding),
the mixer runs, the first `context` outputs are dropped. The tails travel in one shift per rank offset
(chain.halo_routes; flat: to the next rank; zigzag: to the next and the previous), their gradients sent back; a
region's shifts form one chain, the same on every rank under any inner compiler (passing.py says how).

`state_region` (a chunked linear recurrence in flash-linear-attention's convention): the final state is affine in
the initial one, S_out = M @ S_in + B per head (M: Dk x Dk, B: Dk x Dv), and so is every output, o = O + P @ S_in,
column by column of the values. One run of the mixer's own code a chunk gets all four: values [v | 0] (Dv + Dk
columns) from the initial state [0 | I] give outputs [O | P] and the final state [B | M]. The (B | M) of every
rank's chunks are all-gathered (H x Dk x (Dv + Dk) a chunk, whatever the length), composed in GLOBAL chunk order in
fp32 (or the state's wider dtype) into each chunk's initial state S, and o = O + P @ S. Backward is autograd's: the
gather's is a reduce-scatter (every later chunk reads a chunk's transition), the shifts' the reverse shifts, the
rest differentiates the mixer's own code.

Packed documents (`documents`: the call's keyword holding the GLOBAL offsets; strategy thd runs flat's chunks):
each chunk's mixer call gets the chunk's own offsets, the halo's included, and the scan's [0 | I] goes only to
the document carried into the chunk; its transition is the final state of the document holding its last token
(documents.py says why that resets the state and the halo at every document start).
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from ..layouts import get_layout
from .chain import chunk_owners, halo_routes
from .declare import MIXERS
from .documents import carried, chunk_offsets, containing
from .exchange import dense_grad
from .passing import attach, gather_states, shifts


def _chunks(t: torch.Tensor, dim: int, count: int) -> list[torch.Tensor]:
    """t cut into `count` equal pieces along `dim` (one piece: t itself)."""
    if count == 1:
        return [t]
    size = t.shape[dim] // count
    return [t.narrow(dim, i * size, size) for i in range(count)]


def _joined(pieces: list, dim: int):
    """The per-chunk outputs (same tree) joined along `dim` (one chunk: its output as it is)."""
    if len(pieces) == 1:
        return pieces[0]
    return pytree.tree_map(lambda *ts: torch.cat(ts, dim=dim) if isinstance(ts[0], torch.Tensor) else ts[0], *pieces)


def _sends(tails: list[torch.Tensor], routes) -> list[torch.Tensor]:
    """Per shift of `routes` the tails it carries (`tails`: each local chunk's last `context` tokens). Padding is
    a real tail, never a constant: two layers' shifts of one constant would be one node to Inductor's CSE, and a
    rank that sends only padding would issue fewer collectives than the others."""
    return [torch.stack([tails[0 if s is None else s] for s in slots]) for _, slots in routes.sends]


def _halos(tails: list[torch.Tensor], received: list[torch.Tensor], routes):
    """Per local chunk the tokens before it, and the received tensors no chunk of this rank reads (they still
    need a gradient and must come before the output: see passing.attach)."""
    read = set()
    halos = []
    for source in routes.sources:
        if source.kind == "zero":
            halos.append(torch.zeros_like(tails[0]))
        elif source.kind == "local":
            halos.append(tails[source.index])
        else:
            read.add(source.index)
            halos.append(received[source.index][source.position])
    unread = [r for i, r in enumerate(received) if i not in read]
    return halos, unread


def halo_region(
    *flat,
    key: int,
    call_kwargs: dict,
    context: int,
    group_name: str,
    rank: int,
    world: int,
    layout: str = "flat",
    documents: str | None = None,
):
    """Run declared mixer `key` on each of this rank's chunks with the `context` tokens before it put first
    (`documents`: the keyword of the call's GLOBAL document offsets; each chunk gets its own)."""
    spec = MIXERS[key]
    n = len(spec.weight_names)
    args, kwargs, cu = tuple(flat[n:]), dict(call_kwargs), None
    if documents is not None:  # the offsets are not a token tensor: each chunk gets its own (documents.py)
        args, kwargs = spec.named(args, kwargs)
        cu = kwargs.pop(documents)
    inputs, tree = pytree.tree_flatten((args, kwargs))
    if not context and cu is None:
        return spec.call(flat[:n], args, kwargs)
    lay = get_layout(layout)
    routes = halo_routes(lay, world, rank)
    seq, count, mine = spec.seq_dim, lay.chunks_per_rank, lay.rank_chunks(rank, world)
    per_chunk = [list(inputs) for _ in range(count)]
    tails = {}  # token input index -> each local chunk's last `context` tokens
    length = 0
    for i, t in enumerate(inputs):
        if isinstance(t, torch.Tensor):
            pieces = _chunks(t, seq, count)
            length = pieces[0].shape[seq]
            tails[i] = [p.narrow(seq, length - context, context) for p in pieces]
            for s, piece in enumerate(pieces):
                per_chunk[s][i] = piece
    if not context:  # documents, no halo: each chunk alone, with its own offsets
        tails = {}
    # every input's shifts in ONE chain (passing.shifts: the same order on every rank)
    sends = [x for i in tails for x in _sends(tails[i], routes)]
    width = len(routes.sends)
    received = shifts(sends, [o for _ in tails for o, _ in routes.sends], group_name, rank, world) if sends else []
    unread = []
    for j, i in enumerate(tails):
        halos, missed = _halos(tails[i], received[j * width : (j + 1) * width], routes)
        unread += missed
        for s, halo in enumerate(halos):
            per_chunk[s][i] = dense_grad(torch.cat([halo, per_chunk[s][i]], dim=seq))
    outs = []
    for s, chunk_inputs in enumerate(per_chunk):
        args, kwargs = pytree.tree_unflatten(chunk_inputs, tree)
        if cu is not None:
            kwargs[documents] = chunk_offsets(cu, mine[s] * length, length, lead=context)
        out = spec.call(flat[:n], args, kwargs)
        outs.append(
            pytree.tree_map(
                lambda t: t.narrow(seq, context, t.shape[seq] - context) if isinstance(t, torch.Tensor) else t, out
            )
        )
    out = pytree.tree_map(lambda t: dense_grad(t) if isinstance(t, torch.Tensor) else t, _joined(outs, seq))
    if unread:  # the first tensor output follows every unread tensor (passing.attach)
        leaves, out_tree = pytree.tree_flatten(out)
        first = next(i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor))
        leaves[first] = attach(leaves[first], unread)
        out = pytree.tree_unflatten(leaves, out_tree)
    return out


def initial_states(transition, chunks: tuple[int, ...], dv: int, acc: torch.dtype) -> list[torch.Tensor | None]:
    """Each of `chunks`' initial state: S_0 = 0, S_{c+1} = M_c @ S_c + B_c over the chunks before it in sequence
    order (`transition(c)`: chunk c's (B | M)); None: the sequence's first chunk (no earlier state)."""
    at: dict[int, torch.Tensor | None] = {}
    state = None
    for c in range(max(chunks) + 1):
        at[c] = state
        if c == max(chunks):
            break
        bm = transition(c).to(acc)
        b, m = bm.split([dv, bm.shape[-1] - dv], dim=-1)
        state = b if state is None else m @ state + b
    return [at[c] for c in chunks]


def _subscripts(dim: int, heads_dim: int, seq_dim: int, last: str) -> str:
    letters = ["b", "x", "y", last]
    letters[heads_dim % dim], letters[seq_dim % dim] = "h", "l"
    return "".join(letters)


def chunk_transition(spec, weights, args, kwargs, key_dim: int, state_dtype: torch.dtype, documents=None):
    """One chunk's run from [0 | I] on values [v | 0]: (outputs [O | P], final state [B | M]). `documents`:
    (keyword, GLOBAL offsets, the chunk's first global token): the mixer gets the chunk's own offsets, [0 | I] only
    for the document carried into the chunk (zeros for the others), and the final state is the one of the
    document holding the chunk's last token (documents.py)."""
    names = spec.state
    kwargs = dict(kwargs)
    v = kwargs[names.value]
    dv, batch, heads, length = v.shape[-1], v.shape[0], v.shape[spec.heads_dim], v.shape[spec.seq_dim]
    kwargs[names.value] = torch.cat([v, v.new_zeros(*v.shape[:-1], key_dim)], dim=-1)
    if documents is not None:
        name, cu, start = documents
        batch = cu.shape[0] - 1  # one state a document
        kwargs[name] = chunk_offsets(cu, start, length)
    eye = torch.eye(key_dim, dtype=state_dtype, device=v.device).expand(batch, heads, key_dim, key_dim)
    zeros = torch.zeros(batch, heads, key_dim, dv, dtype=state_dtype, device=v.device)
    initial = torch.cat([zeros, eye], dim=-1)
    if documents is not None:
        initial = initial * carried(cu, start).to(device=v.device, dtype=state_dtype).view(-1, 1, 1, 1)
    kwargs[names.initial_state] = initial
    kwargs[names.output_final_state] = True
    out, final = spec.call(weights, args, kwargs)
    if documents is not None:
        final = final.index_select(0, containing(cu, start + length - 1).to(final.device))
    return out, final


def state_region(
    *flat,
    key: int,
    call_kwargs: dict,
    key_dim: int,
    state_dtype: torch.dtype,
    group_name: str,
    rank: int,
    world: int,
    layout: str = "flat",
    documents: str | None = None,
):
    """Run declared linear recurrence `key` on each of this rank's chunks from the state the chunks before it
    leave; returns (output, None) as the mixer does with output_final_state=False. `documents`: the keyword of the
    call's GLOBAL document offsets (the state resets at every document start: documents.py)."""
    spec = MIXERS[key]
    lay = get_layout(layout)
    mine, count = lay.rank_chunks(rank, world), lay.chunks_per_rank
    n = len(spec.weight_names)
    args, kwargs = spec.named(tuple(flat[n:]), dict(call_kwargs))
    cu = kwargs.pop(documents) if documents is not None else None
    inputs, tree = pytree.tree_flatten((args, kwargs))
    inputs = [dense_grad(t) if isinstance(t, torch.Tensor) else t for t in inputs]
    per_chunk = [list(inputs) for _ in range(count)]
    for i, t in enumerate(inputs):
        if isinstance(t, torch.Tensor):
            for s, piece in enumerate(_chunks(t, spec.seq_dim, count)):
                per_chunk[s][i] = piece
    runs = []
    for s, chunk_inputs in enumerate(per_chunk):
        args, kwargs = pytree.tree_unflatten(chunk_inputs, tree)
        length = kwargs[spec.state.value].shape[spec.seq_dim]
        where = None if cu is None else (documents, cu, mine[s] * length)
        runs.append(chunk_transition(spec, flat[:n], args, kwargs, key_dim, state_dtype, where))
    final, out = runs[0][1], runs[0][0]
    dv = out.shape[-1] - key_dim
    acc = torch.promote_types(torch.promote_types(final.dtype, out.dtype), torch.float32)
    gathered = gather_states(final if count == 1 else torch.stack([f for _, f in runs]), group_name, world)
    owners = chunk_owners(lay, world)

    def transition(c: int) -> torch.Tensor:
        p, slot = owners[c]
        return gathered[p] if count == 1 else gathered[p, slot]

    states = initial_states(transition, mine, dv, acc)
    outs = []
    for (chunk_out, _), state in zip(runs, states):
        o, p = chunk_out.split([dv, key_dim], dim=-1)
        if state is not None:
            sub = _subscripts(o.dim(), spec.heads_dim, spec.seq_dim, "k")
            read = torch.einsum(f"{sub},bhkv->{sub.replace('k', 'v')}", p.to(state.dtype), state)
            o = (o.to(state.dtype) + read).to(o.dtype)
        outs.append(o)
    o = _joined(outs, spec.seq_dim)
    if all(s is None for s in states):  # flat rank 0 starts from zeros, but joins the gather's backward all the same
        o = attach(o, [gathered])
    return dense_grad(o), None

"""Plan one mixer declared with comm="state": check that state passing can run it here, before any collective.

Rules (each violation is one CPCompileError naming the node and its source line): strategy flat, zigzag or thd (each
chunk's state follows the chunk before it in sequence order, wherever that is; thd's ranks hold flat's chunks of the
packed buffer; thd_zigzag and thd_balanced order a rank's tokens by document: refused); packed documents' offsets
(cu_seqlens=, required under thd) only to a mixer declared with documents= (it resets at them in fla's convention,
batch 1; documents.py), per-token document ids (seq_idx=) never; plain tensors; every token tensor with the
declared seq dim and one local length. The mixer runs once per chunk a rank owns (flat: its L
tokens; zigzag: two chunks of L/2), so the dry runs use a chunk's length C. A conv-like mixer (`context`): a context
of 0..C tokens, and a dry run on meta tensors of C + context tokens that gives C + context outputs. A linear
recurrence (`state`): its value argument a 4-D (batch, ..., value dim last) tensor with heads and tokens on the
declared dims, no initial state given, no final state asked for, outputs (output, None); dry runs on meta tensors
read the state's key dim and dtype, then check that the mixer takes values of Dv + Dk columns with an initial state
of as many (one run gives the chunk's transition and its outputs: state_region.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx
from torch.utils import _pytree as pytree

from ..layouts import LAYOUTS
from ..mesh import CPGroup
from .declare import MixerSpec, read_mixer_call
from .plan import example, refuse, token_lengths
from .state_region import halo_region, state_region


@dataclass(frozen=True)
class StatePlan:
    """A comm="state" mixer node's region call."""

    node: torch.fx.Node
    spec: MixerSpec
    local_len: int
    layout: str
    group: CPGroup
    chunk_len: int = 0
    """The tokens of one of a rank's chunks (the mixer runs once a chunk): local_len / chunks a rank."""
    context: int | None = None
    """A conv-like mixer: the earlier tokens an output reads (the halo); None: a linear recurrence."""
    key_dim: int = 0
    state_shape: tuple[int, ...] = ()
    """A linear recurrence: its state (batch, heads, Dk, Dv)."""
    state_dtype: torch.dtype = torch.float32
    documents: str | None = None
    """The call's keyword holding packed documents' GLOBAL offsets (the state and the halo reset at their starts)."""
    note: str = ""
    """What explain() prints: the comm and both comms' bytes (set by the rewrite, before the node is erased)."""
    comm = "state"

    @property
    def region(self):
        return halo_region if self.context is not None else state_region

    def region_kwargs(self) -> dict:
        where = dict(group_name=self.group.name, rank=self.group.rank, world=self.group.size)
        if self.layout != "flat":  # flat's region calls keep the default (their graphs stay as they were)
            where["layout"] = self.layout
        if self.documents is not None:
            where["documents"] = self.documents
        if self.context is not None:
            return dict(key=self.spec.key, call_kwargs=dict(self.node.kwargs), context=self.context, **where)
        return dict(
            key=self.spec.key,
            call_kwargs=dict(self.node.kwargs),
            key_dim=self.key_dim,
            state_dtype=self.state_dtype,
            **where,
        )


def _meta(t, spec: MixerSpec | None = None, extra: int = 0):
    """A meta tensor like t (token tensors: `extra` more tokens)."""
    if not isinstance(t, torch.Tensor):
        return t
    shape = [int(s) for s in t.shape]
    if spec is not None:
        shape[spec.seq_dim] += extra
    return torch.empty(shape, dtype=t.dtype, device="meta")


def _run(node, spec: MixerSpec, weights, args, kwargs, why: str):
    try:
        with torch.no_grad():
            return spec.call([_meta(w) for w in weights], args, kwargs)
    except Exception as e:  # noqa: BLE001
        raise refuse(
            node, spec, f"fails {why} ({type(e).__name__}: {e})", "declare it with comm='a2a', or fix its code"
        ) from e


def _shapes(out) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _plan_halo(node, spec: MixerSpec, weights, args, kwargs, length: int, chunk: int, strategy: str, docs: dict) -> int:
    context = spec.context(dict(zip(spec.weight_names, weights))) if callable(spec.context) else spec.context
    if not isinstance(context, int) or not 0 <= context <= chunk:
        held = f"the {length} tokens a rank holds"
        if chunk != length:
            held = f"the {chunk} tokens of each of a rank's {length // chunk} chunks ({strategy})"
        raise refuse(
            node,
            spec,
            f"reads context={context!r} earlier tokens, not an int from 0 to {held}",
            "declare context= as the conv's kernel size - 1, and give each rank's chunks at least that many tokens",
        )
    grown = pytree.tree_map(lambda t: _meta(t, spec, chunk - length + context), (args, kwargs))
    out = _run(node, spec, weights, grown[0], grown[1] | docs, f"on {chunk} + {context} tokens")
    want = _shapes(pytree.tree_map(lambda t: _meta(t, spec, chunk - length + context), example(node)))
    if _shapes(out) != want:
        raise refuse(
            node,
            spec,
            f"gives outputs of shapes {_shapes(out)} on {chunk} + {context} tokens, not {want}",
            "make it read its length from its inputs' shapes",
        )
    return context


_DOCUMENTS = ("cu_seqlens", "seq_idx")
"""Keyword arguments that carry packed documents' boundaries (fla's and transformers' convs and scans)."""


def _documents(node, spec: MixerSpec, strategy: str, kwargs: dict) -> str | None:
    """The keyword of the call's document offsets, checked (1-D integer, batch-1 token tensors), or None (no
    documents); one CPCompileError where state passing cannot reset the mixer at their starts."""
    given = [name for name in dict.fromkeys((*_DOCUMENTS, spec.documents)) if name and kwargs.get(name) is not None]
    if not given:
        if strategy == "thd":
            raise refuse(
                node,
                spec,
                "runs under strategy 'thd' (packed documents) without the documents' offsets: state passing would "
                "carry its state and conv halo across every document start (transformers' hybrids cannot run "
                "packed documents on their torch fallbacks: those ignore cu_seqlens, so documents mix even in one "
                "process)",
                f"pass the model's cu_seqlens to it ({spec.documents or 'cu_seqlens'}=...) and declare it with "
                "token_mixer(..., documents='cu_seqlens') if it resets at them in flash-linear-attention's "
                "convention",
            )
        return None
    name = given[0]
    if name != spec.documents:
        raise refuse(
            node,
            spec,
            f"is given packed documents' boundaries ({name}=...) but is not declared to reset at them "
            f"(token_mixer(..., documents={spec.documents!r})); state passing hands it one chunk at a time and "
            "must give each chunk its own offsets. transformers' torch fallbacks take cu_seqlens in **kwargs and "
            "ignore it (their documents mix even in one process); per-token document ids (seq_idx=) are not "
            "supported",
            "declare it with documents='cu_seqlens' if it takes fla-style offsets and resets its state and conv "
            "window at them (batch 1, one state a document), or call it without them (one document a sequence)",
        )
    cu = kwargs[name]
    tokens = [t for k, t in kwargs.items() if k != name and isinstance(t, torch.Tensor)]
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.is_floating_point() or cu.shape[0] < 2:
        raise refuse(
            node,
            spec,
            f"is given {name}={_shapes(cu) or cu!r}, not 1-D integer offsets (documents + 1 entries)",
            "pass the packed batch's cu_seqlens (the GLOBAL offsets shard_batch leaves the model)",
        )
    batches = sorted({int(t.shape[0]) for t in tokens if t.dim() >= 2})
    if batches and batches != [1]:
        raise refuse(
            node,
            spec,
            f"is given {name}= with token tensors of batch {batches}, not 1",
            "pack the documents into one row (batch 1), as fla's varlen functions take them",
        )
    if strategy not in ("thd", "flat"):
        raise refuse(
            node,
            spec,
            f"is given packed documents ({name}=) under strategy {strategy!r}; state passing resets at document "
            "starts on contiguous ranks only ('thd', or 'flat' chunks of one packed row)",
            "use strategy='thd' for packed documents",
        )
    return name


def _check_flags(node, spec: MixerSpec, kwargs) -> None:
    """No initial state given, no final state asked for (checked first: a state has no token dim)."""
    names = spec.state
    if kwargs.get(names.initial_state) is not None or kwargs.get(names.output_final_state):
        raise refuse(
            node,
            spec,
            f"is given {names.initial_state} or asked for its final state ({names.output_final_state}=True); under "
            "state passing the state at a rank's edge is the earlier ranks'",
            f"call it with {names.initial_state}=None and {names.output_final_state}=False (training), or declare "
            "it with comm='a2a'",
        )


def _plan_state(
    node, spec: MixerSpec, weights, args, kwargs, cut: int, docs: dict
) -> tuple[int, tuple[int, ...], torch.dtype]:
    """`cut`: the tokens a chunk has fewer than the rank (the dry runs are on one chunk); `docs`: the document
    offsets' keyword -> a meta tensor (none: one document a sequence)."""
    names = spec.state
    args, kwargs = spec.named(args, kwargs)
    v = kwargs.get(names.value)
    dims = {spec.heads_dim % 4, spec.seq_dim % 4} if isinstance(v, torch.Tensor) else None
    if v is None or v.dim() != 4 or dims != {1, 2}:
        raise refuse(
            node,
            spec,
            f"passes state (comm='state') but its argument {names.value!r} is not a (batch, ..., value dim) 4-D "
            f"tensor with heads_dim={spec.heads_dim} and seq_dim={spec.seq_dim} in the middle",
            "name its value argument in StateArgs(value=...), or declare it with comm='a2a'",
        )
    _check_flags(node, spec, kwargs)
    out = example(node)
    if not isinstance(out, (tuple, list)) or len(out) != 2 or out[1] is not None:
        raise refuse(
            node, spec, "does not return (output, None)", "return (output, final state or None) like fla's functions"
        )
    metas = pytree.tree_map(lambda t: _meta(t, spec, -cut), (args, kwargs))
    v = metas[1][names.value]
    out = pytree.tree_map(lambda t: _meta(t, spec, -cut), out)
    plain = _run(
        node, spec, weights, metas[0], metas[1] | docs | {names.output_final_state: True}, "asked for its state"
    )
    final = plain[1] if isinstance(plain, (tuple, list)) and len(plain) == 2 else None
    dv = int(v.shape[-1])
    if not isinstance(final, torch.Tensor) or final.dim() != 4 or int(final.shape[-1]) != dv:
        raise refuse(
            node,
            spec,
            f"returns a final state of shape {_shapes(final)}, not (batch, heads, key dim, {dv})",
            "declare it with comm='a2a'",
        )
    dk = int(final.shape[2])
    wide = dict(metas[1]) | docs
    wide[names.value] = torch.empty([*v.shape[:-1], dv + dk], dtype=v.dtype, device="meta")
    wide[names.initial_state] = torch.empty([*final.shape[:-1], dv + dk], dtype=final.dtype, device="meta")
    wide[names.output_final_state] = True
    got = _run(node, spec, weights, metas[0], wide, f"on values of {dv} + {dk} columns")
    want = [(*out[0].shape[:-1], dv + dk), (*final.shape[:-1], dv + dk)]
    if _shapes(got) != want:
        raise refuse(
            node,
            spec,
            f"gives {_shapes(got)} on values of {dv} + {dk} columns, not {want}",
            "make its value width follow its inputs, or declare it with comm='a2a'",
        )
    shape = tuple(int(s) for s in final.shape)
    return dk, (1, *shape[1:]) if docs else shape, final.dtype  # documents: a chunk passes on one state


def plan_state(node: torch.fx.Node, strategy: str, group: CPGroup) -> StatePlan:
    """The plan of one comm="state" mixer node, or the CPCompileError saying why it cannot pass state here."""
    call = read_mixer_call(node)
    spec = call.spec
    weights = [example(a) for a in call.weights]
    args = tuple(example(a) for a in call.args)
    kwargs = {k: example(v) for k, v in call.kwargs.items()}
    if strategy not in (*LAYOUTS, "thd"):
        raise refuse(
            node,
            spec,
            f"passes state along chunks in sequence order (comm='state'): strategy 'flat', 'zigzag' or 'thd' "
            f"(packed documents, each rank a contiguous slice; the state resets at every document start), not "
            f"{strategy!r}, which orders a rank's tokens by document ('thd_zigzag': every document cut in 2cp "
            "pieces; 'thd_balanced': documents reordered)",
            "use strategy='thd' for packed documents (or 'flat' / 'zigzag' with one document a sequence)",
        )
    named = spec.named(args, kwargs)[1]
    documents = _documents(node, spec, strategy, named)
    if spec.state is not None:
        _check_flags(node, spec, named)
    docs = {}
    if documents is not None:  # the offsets are not a token tensor: left out of the token checks and dry runs
        cu = named[documents]
        docs = {documents: torch.empty(cu.shape, dtype=cu.dtype, device="meta")}
        args, kwargs = spec.named(args, kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k != documents}
    layout = "flat" if strategy == "thd" else strategy  # thd's ranks hold flat's chunks of the packed buffer
    fix = "declare the dim its token tensors hold the tokens on"
    lengths = token_lengths(node, spec, (("tensor argument", t) for t in pytree.tree_leaves((args, kwargs))), fix)
    lengths |= token_lengths(node, spec, (("output", t) for t in pytree.tree_leaves(example(node))), fix)
    if len(lengths) != 1:
        raise refuse(
            node,
            spec,
            f"has tensors of lengths {sorted(lengths)} on seq_dim={spec.seq_dim}",
            "call it on token tensors of this rank's length (tokens on seq_dim)",
        )
    length = lengths.pop()
    count = LAYOUTS[layout].chunks_per_rank
    if length % count:
        raise refuse(
            node,
            spec,
            f"holds {length} tokens a rank, not a multiple of the {count} chunks a rank owns under {strategy!r}",
            "shard the sequence with cpcompile.shard (its length a multiple of the layout's chunk count)",
        )
    chunk = length // count
    where = dict(
        node=node, spec=spec, local_len=length, layout=layout, group=group, chunk_len=chunk, documents=documents
    )
    if spec.context is not None:
        context = _plan_halo(node, spec, weights, args, kwargs, length, chunk, strategy, docs)
        return StatePlan(**where, context=context)
    dk, shape, dtype = _plan_state(node, spec, weights, args, kwargs, length - chunk, docs)
    return StatePlan(**where, key_dim=dk, state_shape=shape, state_dtype=dtype)

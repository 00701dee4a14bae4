"""Plan one declared mixer's node: check that it can run head-parallel here, before any collective runs.

Rules (each violation is one CPCompileError naming the node and its source line): a chunk layout (flat,
zigzag: packed documents run under state passing, plan_state.py); plain tensors (no
DTensor); every token input and output with the declared seq and heads dims, one local length, and a head count
that divides by cp; weights that split with the heads divisible by cp; and a dry run of the mixer's own code on
meta tensors shaped as the region will feed it (the whole sequence, heads/cp heads) that gives outputs of the
expected shapes (code that reads a head count or a length from a constant instead of its inputs fails here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from ..errors import site_error
from ..layouts import LAYOUTS
from ..mesh import CPGroup
from .declare import MixerSpec, read_mixer_call
from .head_check import split_error

_WHAT = "token mixer"


@dataclass(frozen=True)
class MixerPlan:
    """A mixer node's region call: which declaration, how its weights split, on which ranks and layout."""

    node: torch.fx.Node
    spec: MixerSpec
    weight_dims: tuple[int | None, ...]
    heads: int
    local_len: int
    layout: str
    group: CPGroup
    note: str = ""
    """What explain() prints: the comm and its bytes (set by the rewrite, before the node is erased)."""
    comm = "a2a"

    def region_kwargs(self) -> dict:
        return dict(
            key=self.spec.key,
            weight_dims=self.weight_dims,
            call_kwargs=dict(self.node.kwargs),
            layout=self.layout,
            group_name=self.group.name,
            rank=self.group.rank,
            world=self.group.size,
        )


def example(a):
    """A node's traced value (anything else as it is)."""
    return a.meta.get("example_value", a.meta.get("val")) if isinstance(a, torch.fx.Node) else a


def refuse(node: torch.fx.Node, spec: MixerSpec, rule: str, fix: str):
    """The CPCompileError of a mixer node: which node and declaration, the rule, the fix."""
    return site_error(node, f"{spec.name} (declared with cpcompile.token_mixer) {rule}", fix, what=_WHAT)


def _has_dims(t: torch.Tensor, spec: MixerSpec) -> bool:
    n = t.dim()
    ok = all(-n <= d < n for d in (spec.heads_dim, spec.seq_dim))
    return ok and spec.heads_dim % n != spec.seq_dim % n


def _token_shapes(node: torch.fx.Node, spec: MixerSpec, values, cp: int, what: str) -> list[tuple[int, int]]:
    """(heads, length) of each tensor, checked against the declaration."""
    found = []
    for t in values:
        if isinstance(t, DTensor):
            raise refuse(node, spec, f"takes a DTensor {what}", "feed the model plain tensors from shard_batch")
        if not isinstance(t, torch.Tensor):
            continue
        if not _has_dims(t, spec):
            raise refuse(
                node,
                spec,
                f"has a {what} of shape {tuple(t.shape)} without heads_dim={spec.heads_dim} and seq_dim={spec.seq_dim}",
                "declare the dims its token tensors use (every tensor argument and "
                "output of a mixer holds tokens and heads on those dims)",
            )
        h, n = int(t.shape[spec.heads_dim]), int(t.shape[spec.seq_dim])
        if h % cp:
            raise refuse(
                node,
                spec,
                f"has a {what} with {h} heads (channels) on dim {spec.heads_dim}, which do not split "
                f"over {cp} CP ranks",
                f"use a CP size that divides {h}; a causal conv or a chunked linear recurrence can pass state instead "
                "(token_mixer(..., comm='state'), Hugging Face: cpcompile.hf_token_mixers(model, comm='state')), "
                "which splits no heads; else keep this layer out of the CP model",
            )
        found.append((h, n))
    return found


def _weight_dims(node, spec: MixerSpec, weights, heads: set[int], cp: int) -> tuple[int | None, ...]:
    dims = []
    for name, w in zip(spec.weight_names, weights):
        if not isinstance(w, torch.Tensor):  # an absent optional weight (bias=None)
            dims.append(None)
            continue
        d = spec.weight_dims.get(name, 0 if w.dim() and int(w.shape[0]) in heads else None)
        if d is not None and int(w.shape[d]) % cp:
            raise refuse(
                node,
                spec,
                f"has a weight {name} of shape {tuple(w.shape)} split with the heads along dim {d}, "
                f"which does not divide by {cp} CP ranks",
                "set weight_dims={name: None} if it is shared by all heads",
            )
        dims.append(d)
    return tuple(dims)


def _meta(t: torch.Tensor, spec: MixerSpec, cp: int, token: bool, dim: int | None = None) -> torch.Tensor:
    """A meta tensor shaped as the region hands it to the mixer."""
    shape = list(t.shape)
    if token:
        shape[spec.heads_dim] //= cp
        shape[spec.seq_dim] *= cp
    elif dim is not None:
        shape[dim] //= cp
    return torch.empty([int(s) for s in shape], dtype=t.dtype, device="meta", requires_grad=t.requires_grad)


def _whole(t: torch.Tensor, spec: MixerSpec, cp: int) -> torch.Tensor:
    """A meta tensor shaped as a shared input reaches the mixer: every token, no head split."""
    shape = [int(s) for s in t.shape]
    shape[spec.seq_dim] *= cp
    return torch.empty(shape, dtype=t.dtype, device="meta", requires_grad=t.requires_grad)


def token_lengths(node, spec: MixerSpec, named, fix: str) -> set[int]:
    """The local lengths (sizes on seq_dim) of the tensors in `named` ((what it is, value) pairs; values that are
    not tensors are skipped); a DTensor, or a tensor without seq_dim, is refused (`fix`: what to declare instead)."""
    lengths = set()
    for what, t in named:
        if isinstance(t, DTensor):
            raise refuse(node, spec, f"takes a DTensor {what}", "feed the model plain tensors from shard_batch")
        if not isinstance(t, torch.Tensor):
            continue
        if not -t.dim() <= spec.seq_dim < t.dim():
            raise refuse(node, spec, f"has a {what} of shape {tuple(t.shape)} without seq_dim={spec.seq_dim}", fix)
        lengths.add(int(t.shape[spec.seq_dim]))
    return lengths


def _dry_run(node, spec: MixerSpec, weights, weight_dims, args, kwargs, shared, cp: int) -> None:
    """The mixer's code on the region's shapes (meta tensors): it must run and give the expected outputs."""
    metas = [_meta(w, spec, cp, False, d) if isinstance(w, torch.Tensor) else w for w, d in zip(weights, weight_dims)]

    def token(t):
        return _meta(t, spec, cp, True) if isinstance(t, torch.Tensor) else t

    whole = {k: _whole(t, spec, cp) if isinstance(t, torch.Tensor) else t for k, t in shared.items()}
    try:
        with torch.no_grad():
            out = spec.call(metas, pytree.tree_map(token, args), pytree.tree_map(token, kwargs) | whole)
    except Exception as e:  # noqa: BLE001
        raise refuse(
            node,
            spec,
            f"fails on the whole sequence for 1/{cp} of its heads ({type(e).__name__}: {e})",
            "make it read its head (channel) count and its length from its inputs' shapes, e.g. "
            "groups=x.shape[1], x.view(b, n, -1, d), not from constants or config attributes",
        ) from e
    expected = [token(t) for t in pytree.tree_leaves(example(node)) if isinstance(t, torch.Tensor)]
    got = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    if [tuple(t.shape) for t in got] != [tuple(t.shape) for t in expected]:
        raise refuse(
            node,
            spec,
            f"gives outputs of shapes {[tuple(t.shape) for t in got]} on the whole sequence for 1/{cp} "
            f"of its heads, not {[tuple(t.shape) for t in expected]}",
            "make it read its head (channel) count and its length from its inputs' shapes",
        )


def _check_split(node, spec: MixerSpec, weights, weight_dims, args, kwargs, shared, cp: int, heads: int) -> None:
    """The declaration against the mixer's code (head_check.py): the mixer on each rank's block of heads must give
    what it gives on every head."""
    try:
        found = split_error(spec, weights, weight_dims, args, kwargs, shared, cp)
    except Exception as e:  # noqa: BLE001
        raise refuse(
            node,
            spec,
            f"fails on real tensors of this rank's shapes, all {heads} heads or 1/{cp} of them ({type(e).__name__}: "
            f"{e}), where cpcompile checks that its declaration is true",
            "make it run on any length and head count its inputs carry",
        ) from e
    if found is None or found[0] <= found[1]:
        return
    split = {name: d for name, d in zip(spec.weight_names, weight_dims) if d is not None}
    raise refuse(
        node,
        spec,
        f"is not head-local as declared (heads_dim={spec.heads_dim}, weights split with the heads: {split or 'none'}):"
        f" run on each of the {cp} blocks of heads the a2a region gives a rank, its outputs differ from one run on "
        f"all {heads} heads by {found[0]:.3g} (relative to the largest; random inputs of this rank's shapes), so the "
        "region would be silently wrong",
        "declare the dim whose heads (channels) it never mixes as heads_dim, and weight_dims={name: None} for "
        "weights every head shares; a mixer that mixes heads cannot run head-parallel: if it is a causal conv or a "
        "chunked linear recurrence, declare it with comm='state' (every rank runs all heads), else keep it out of "
        "the CP-compiled model",
    )


def plan_mixer(node: torch.fx.Node, strategy: str, group: CPGroup, check: bool = True) -> MixerPlan:
    """The plan of one mixer_call node, or the CPCompileError saying why it cannot run head-parallel. `check`: run
    the mixer on real tensors to check the declaration (head_check.py; explain() computes nothing)."""
    call = read_mixer_call(node)
    spec = call.spec
    weights = [example(a) for a in call.weights]
    args = tuple(example(a) for a in call.args)
    kwargs = {k: example(v) for k, v in call.kwargs.items()}
    shared = {k: kwargs.pop(k) for k in spec.shared_inputs if k in kwargs}
    if strategy not in LAYOUTS:
        raise refuse(
            node,
            spec,
            f"runs head-parallel over the chunk layouts {sorted(LAYOUTS)} only, not {strategy!r} "
            "(the a2a region does not reset its state at document starts)",
            "use strategy='flat' or 'zigzag', or for packed documents (strategy='thd') declare it with "
            "comm='state' and documents='cu_seqlens' (state passing)",
        )
    cp = group.size
    inputs = _token_shapes(node, spec, pytree.tree_leaves((args, kwargs)), cp, "tensor argument")
    outputs = _token_shapes(node, spec, pytree.tree_leaves(example(node)), cp, "output")
    if not inputs:
        raise refuse(node, spec, "has no tensor argument", "call it on the token tensors it mixes")
    lengths = {length for _, length in inputs + outputs} | token_lengths(
        node,
        spec,
        ((f"shared input {name}", t) for name, t in shared.items()),
        "declare as shared_inputs only token tensors (tokens on seq_dim, no heads dim)",
    )
    if len(lengths) != 1:
        raise refuse(
            node,
            spec,
            f"has tensors of different lengths {sorted(lengths)} on seq_dim={spec.seq_dim}",
            "declare the dim that holds the tokens in every tensor argument and output",
        )
    heads = {h for h, _ in inputs}
    weight_dims = _weight_dims(node, spec, weights, heads, cp)
    _dry_run(node, spec, weights, weight_dims, args, kwargs, shared, cp)
    if check:
        _check_split(node, spec, weights, weight_dims, args, kwargs, shared, cp, max(heads))
    return MixerPlan(node, spec, weight_dims, max(heads), lengths.pop(), strategy, group)

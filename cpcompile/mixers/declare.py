"""`cpcompile.token_mixer`: declare a head-local (or channel-local) token mixer, so CP runs it head-parallel.

A token mixer combines tokens along the sequence (a short causal depthwise conv, a linear-attention or SSM scan),
which the token guard refuses on a rank's own tokens. When every head (or channel) of its outputs depends only on
the same head of its inputs and weights, it runs exactly on whole sequences for a subset of the heads: the pass
(mixers/rewrite.py) wraps the call into an all-to-all region (mixers/region.py).

The declared callable becomes ONE node of Dynamo's graph: `mixer_call(key, *weights, *args, **kwargs)`, kept
whole by `torch._dynamo.allow_in_graph`, with the module's weights passed in as tensors (so aot_autograd traces
them as inputs and their gradients flow). Outside a CP-compiled graph the call is the original forward.
"""

from __future__ import annotations

import inspect
import itertools
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import torch
import torch.fx
import torch.nn as nn

T = TypeVar("T")

COMMS = ("a2a", "state", "auto")
"""How a mixer's region communicates: "a2a" trades the sequence for heads (any head-local mixer, any chunk layout);
"state" passes state along a chunk layout's chunks (flat, zigzag; packed documents: thd) in sequence order: a
conv's last `context` tokens to the chunk after them (a halo), or a linear recurrence's chunk transitions
(mixers/state_region.py); "auto": per call, the one whose forward moves fewer bytes a rank among those that can run
it (state passing needs context= or state=)."""


@dataclass(frozen=True)
class StateArgs:
    """Where a chunked linear-attention function (flash-linear-attention's convention, which transformers'
    torch fallbacks follow) takes its state: the argument names of the values (B, L, H, Dv: value dim last), of
    the initial state (B, H, Dk, Dv) and of the flag that returns the final state. The function returns
    (output, final state or None), and both are affine in the initial state, value column by value column (every
    column of the state and the output reads only the same column of the values and the initial state): true of
    the (gated) delta rule, GLA, retention, Mamba2's SSD."""

    value: str = "value"
    initial_state: str = "initial_state"
    output_final_state: str = "output_final_state"


@dataclass
class MixerSpec:
    """One declaration: what to call, where its tensors hold heads and tokens, how its weights split."""

    key: int
    name: str
    heads_dim: int
    seq_dim: int
    weight_names: tuple[str, ...] = ()
    weight_dims: Mapping[str, int | None] = field(default_factory=dict)
    """name -> the dim a weight splits along with the heads (None: shared by every head, not split). A module's
    weights are its parameters and buffers, a function's the arguments named here."""
    fn: Callable | None = None
    module: nn.Module | None = None
    forward: Callable | None = None
    """The module's own forward (bound), run with the weights swapped in."""
    inside: list[int] = field(default_factory=lambda: [0])
    shared_inputs: tuple[str, ...] = ()
    """Token arguments without a heads dim, read by every head (Mamba1's B and C): every rank gets all their
    tokens (an all-gather), and their gradients are summed over the ranks."""
    comm: str = "a2a"
    context: int | Callable[[dict[str, Any]], int] | None = None
    """comm="state", a causal conv-like mixer: how many earlier tokens an output reads (an int, or a function of
    the weights by name: the halo each rank receives from the previous one)."""
    state: StateArgs | None = None
    """comm="state", a chunked linear recurrence: where it takes and returns its state."""
    documents: str | None = None
    """comm="state": the keyword argument that takes packed documents' offsets, which the mixer honours in
    flash-linear-attention's convention (mixers/documents.py); None: a call given documents is refused."""

    def call(self, weights, args, kwargs):
        """The mixer itself on these weights and inputs (any head count, any length the code infers)."""
        if self.module is None:
            return self.fn(*args, **dict(zip(self.weight_names, weights)), **kwargs)
        self.inside[0] += 1
        try:
            return torch.func.functional_call(self.module, dict(zip(self.weight_names, weights)), args, kwargs)
        finally:
            self.inside[0] -= 1

    def named(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """(args, kwargs) with the positional arguments that have names moved into kwargs (a function's named
        arguments already arrive by keyword: see token_mixer's `declared`)."""
        if self.module is None:
            return args, kwargs
        params = inspect.signature(self.forward).parameters.values()
        names = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        k = min(len(names), len(args))
        return args[k:], dict(zip(names, args[:k])) | kwargs


MIXERS: dict[int, MixerSpec] = {}
"""key -> declaration; the key is the first argument of every mixer_call node."""
_KEYS = itertools.count()


def _split(spec: MixerSpec, flat: tuple) -> tuple[tuple, tuple]:
    """(weights, positional arguments) of a mixer_call's arguments after its key."""
    n = len(spec.weight_names)
    return tuple(flat[:n]), tuple(flat[n:])


def mixer_call(key: int, /, *flat, **kwargs):
    """The graph node of a declared mixer: weights first, then the call's positional arguments (`key` is
    positional-only: a mixer may take an argument named key)."""
    spec = MIXERS[key]
    return spec.call(*_split(spec, flat), kwargs)


torch._dynamo.allow_in_graph(mixer_call)


def is_mixer_call(node) -> bool:
    """Whether an FX node is a declared mixer's call (not yet rewritten)."""
    return node.op == "call_function" and node.target is mixer_call


class MixerCall(NamedTuple):
    """A mixer_call node's inputs by name (FX nodes or constants): what the planners, the byte counts and the
    rewrite read, never by position."""

    spec: MixerSpec
    weights: tuple
    args: tuple
    kwargs: dict


def read_mixer_call(node: torch.fx.Node) -> MixerCall:
    """The inputs of a mixer_call node, split as mixer_call splits them (the key, the declaration's weights, then
    the call's positional arguments; its keywords)."""
    key, *flat = node.args
    spec = MIXERS[key]
    return MixerCall(spec, *_split(spec, tuple(flat)), dict(node.kwargs))


def _wrap_module(module: nn.Module, spec: MixerSpec) -> None:
    """Give `module` a forward that calls mixer_call with its own weights (bound to the instance, so a deep copy
    passes the copy's weights; the declaration's module only lends its code and configuration)."""
    forward = module.forward

    def wrapped(self, *args, **kwargs):
        if spec.inside[0]:  # functional_call re-entering: the module's own forward
            return forward(*args, **kwargs)
        state = dict(self.named_parameters()) | dict(self.named_buffers())
        return mixer_call(spec.key, *(state[n] for n in spec.weight_names), *args, **kwargs)

    spec.forward = forward
    module.forward = types.MethodType(wrapped, module)
    module._cpcompile_mixer = spec.key


def token_mixer(
    obj: T,
    *,
    heads_dim: int,
    seq_dim: int = 1,
    weight_dims: Mapping[str, int | None] | None = None,
    shared_inputs: tuple[str, ...] = (),
    comm: str = "a2a",
    context: int | Callable[[dict[str, Any]], int] | None = None,
    state: StateArgs | bool | None = None,
    documents: str | None = None,
) -> T:
    """Declare `obj` (an nn.Module instance, changed in place, or a function: use the returned one) a head-local
    token mixer and return it. Under CP its call runs head-parallel: its tensor arguments (this rank's tokens on
    `seq_dim`, heads or channels on `heads_dim`) go through an all-to-all so each rank holds the whole sequence for
    heads/cp of the heads, the mixer runs on that, and its tensor outputs (the same dims) come back.

    The promise: every head (channel) of the outputs depends only on the same head of the inputs, and the code
    reads its head count and length from its inputs' shapes (e.g. `groups=x.shape[1]`), not from constants.
    A module's parameters and buffers split with the heads along dim 0 when that dim's size is a head count of
    the inputs, else they are shared; `weight_dims` ({name: dim or None}) says otherwise per weight. A function's
    tensor arguments are token inputs except those named in `weight_dims` (its weights, e.g. a conv's weight and
    bias: {"weight": 0, "bias": 0}). `shared_inputs` (a function's argument names) are token inputs with no heads dim
    that every head reads (Mamba1's B and C: (batch, state, L)): each rank gets all their tokens, and their
    gradients are summed over the ranks.

    `comm` picks the region: "a2a" (above; any chunk layout), "auto" (per call, the one that moves fewer bytes) or
    "state" (strategy "flat" or "zigzag": every rank runs the mixer on each of its chunks, all heads, and receives what
    the earlier tokens leave behind). A "state" mixer is
    either a causal conv-like mixer reading `context` earlier tokens (an int, or a function of its weights by name,
    e.g. `lambda w: w["weight"].shape[-1] - 1`), which gets the previous chunk's last `context` tokens, or a chunked
    linear recurrence in flash-linear-attention's convention (`state`: True or a StateArgs naming its value,
    initial_state and output_final_state arguments), whose chunk transitions are all-gathered and composed.
    `documents` (comm="state" or "auto"): the keyword argument through which the mixer takes packed documents'
    offsets (e.g. "cu_seqlens") and honours them in flash-linear-attention's convention: batch 1, offsets of its
    own input (zero-length documents allowed), a state mixer takes and returns one state a document; under
    strategy "thd" (or "flat", one packed row) each rank's chunk gets its own offsets and the state and halo
    reset at document starts (mixers/documents.py). Undeclared, a call given documents is refused.
    """
    if heads_dim == seq_dim:
        raise ValueError("token_mixer: heads_dim and seq_dim must differ")
    state = StateArgs() if state is True else (state or None)
    _check_comm(comm, context, state, shared_inputs)
    if documents is not None and (comm == "a2a" or not isinstance(documents, str)):
        raise ValueError(
            f"token_mixer: documents={documents!r}; name the keyword that takes the offsets (e.g. 'cu_seqlens'), "
            "with comm='state' or 'auto' (the a2a region does not take packed documents)"
        )
    if isinstance(obj, nn.Module) and "_cpcompile_mixer" in obj.__dict__:
        raise ValueError(f"token_mixer: this {type(obj).__name__} is declared already")
    key = next(_KEYS)
    if isinstance(obj, nn.Module):
        if shared_inputs:
            raise ValueError("token_mixer: shared_inputs name a function's arguments; declare the function instead")
        names = tuple(n for n, _ in (*obj.named_parameters(), *obj.named_buffers()))
        unknown = set(weight_dims or ()) - set(names)
        if unknown:
            raise ValueError(f"token_mixer: {sorted(unknown)} are not parameters or buffers of {type(obj).__name__}")
        spec = MixerSpec(
            key, type(obj).__name__, heads_dim, seq_dim, names, dict(weight_dims or {}), module=obj, comm=comm,
            context=context, state=state, documents=documents,
        )  # fmt: skip
        MIXERS[key] = spec
        _wrap_module(obj, spec)
        return obj
    if not callable(obj) or inspect.isclass(obj):
        raise TypeError(f"token_mixer takes an nn.Module instance or a function, not {obj!r}")
    names, defaults = _positional(obj)
    weights = tuple(weight_dims or ())
    missing = [w for w in weights if w not in names and w not in defaults]
    missing += [a for a in shared_inputs if a not in names or a in weights]
    if missing:
        raise ValueError(
            f"token_mixer: {missing} are not arguments of {getattr(obj, '__name__', obj)!r} "
            "(shared_inputs: token arguments, not weights)"
        )
    spec = MixerSpec(
        key, getattr(obj, "__name__", type(obj).__name__), heads_dim, seq_dim, weights, dict(weight_dims or {}), fn=obj,
        shared_inputs=tuple(shared_inputs), comm=comm, context=context, state=state, documents=documents,
    )  # fmt: skip
    MIXERS[key] = spec

    def declared(*args, **kwargs):
        named = dict(zip(names, args))  # every named argument by keyword, so the weights can come out
        named.update(kwargs)
        pulled = [named.pop(w, defaults.get(w)) for w in weights]
        return mixer_call(key, *pulled, *args[len(names) :], **named)

    declared.__name__ = spec.name
    return declared  # type: ignore[return-value]


def _check_comm(comm: str, context, state: StateArgs | None, shared_inputs) -> None:
    if comm not in COMMS:
        raise ValueError(f"token_mixer: comm={comm!r}; use one of {list(COMMS)}")
    if context is not None and state is not None:
        raise ValueError("token_mixer: context= (a causal conv) and state= (a linear recurrence) exclude each other")
    if comm == "state" and (context is None) == (state is None):
        raise ValueError(
            "token_mixer: comm='state' needs exactly one of context= (a causal conv: how many earlier tokens an "
            "output reads) and state= (a chunked linear recurrence: StateArgs)"
        )
    if comm != "a2a" and shared_inputs:
        raise ValueError("token_mixer: shared_inputs go with comm='a2a' (state passing gives every rank all heads)")
    if state is not None and not isinstance(state, StateArgs):
        raise ValueError(f"token_mixer: state={state!r}; pass True or a cpcompile.mixers.StateArgs")


def _positional(fn: Callable) -> tuple[list[str], dict]:
    """The names of fn's positional-or-keyword parameters, in order, and every parameter's default."""
    params = inspect.signature(fn).parameters.values()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD,)
    names = [p.name for p in params if p.kind in kinds]
    if any(p.kind is inspect.Parameter.POSITIONAL_ONLY for p in params):
        raise ValueError("token_mixer: functions with positional-only parameters are not supported; wrap them")
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    return names, defaults

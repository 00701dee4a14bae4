"""Which dim of which input holds the sequence, and the first op that mixes tokens along it.

The rewritten sites give this rank's local length L (SDPA q (B, H, L, D): dim 2; varlen q (T_local, H, D):
dim 0); a token mixer's region counts like a site. Every data input (inputs.py) with a dim of size L is placed
`Shard` on that dim. A dim of size L that is not the sequence (batch == L, hidden == L) is resolved by
consistency: when the first assignment refuses something or leaves a site's q/k/v off their sequence dim, the
other choices of dim for inputs with several size-L dims are tried, and the graph is accepted if one of them places
every site's q/k/v on the sequence dim with nothing refused. An input is never dropped from the assignment to make
a refusal go away (a token mask's cumsum into position ids must stay refused).

Graphs with no site (a separate compiled function, the part of a model after a graph break): their token dims come
from their inputs' marks (token_marks.py: what cpcompile.shard / shard_batch returned, or an earlier compiled
graph's outputs, marked when it ran: the graph-break handoff), else from a local length an earlier graph of the
same backend had; the graph is then checked fully. With none of them the guard cannot tell which dim holds the
tokens: each size of the inputs' dims is tried as the sequence, and an op that mixes tokens under any reading is
refused naming the reading (`Flag.reading`), so a cumsum or a conv over the tokens is never silent (nor is a
Linear, which mixes its hidden dim: read as the sequence, it would; shard_batch's marks tell it). Such a graph is
also kept (`pending`) until a graph of the same backend brings the local length (its attention sites), and then
checked fully at that length: a per-rank max(position_ids) deciding a branch before the first attention graph
(HF's dynamic RoPE) is refused there, before that graph's collectives.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch.fx

from ..errors import CPCompileError
from .flow import Flag, Result
from .inputs import cu_only_inputs, data_inputs, input_marks, mixer_lengths, site_lengths, state_inputs
from .runner import track
from .tags import Part, Seq

log = logging.getLogger("cpcompile")

MAX_ASSIGNMENTS = 16
"""At most this many choices of sequence dims are tried for one graph (ambiguous dims are rare)."""
READINGS_PER_SIZE = 4
"""A graph with no site: at most this many choices of sequence dims are tried per candidate length."""
MAX_PENDING = 64
"""At most this many graphs wait for a length (a model has a few graph breaks before its first attention)."""


def preferred(dims: list[int]) -> list[int]:
    """Candidate dims, the likeliest first: dim 1 ((batch, seq, ...) inputs), then the rest in order."""
    return sorted(dims, key=lambda d: (d != 1, d))


def assignments(inputs, lengths: set[int], skip: set[str]) -> Iterator[dict[str, int]]:
    """Seeds {placeholder: seq dim}: the preferred dims first, then the other choices of ambiguous inputs."""
    choices = []
    for node, value in inputs:
        dims = [d for d, n in enumerate(value.shape) if n in lengths]
        if dims and node.name not in skip:
            choices.append((node.name, preferred(dims)))
    names = [n for n, _ in choices]
    for combo in itertools.islice(itertools.product(*(d for _, d in choices)), MAX_ASSIGNMENTS):
        yield dict(zip(names, combo))


def analyse(gm: torch.fx.GraphModule, seeds: dict[str, int | Seq], length: int | None) -> Result:
    """runner.track; a failure of the analysis itself (an op meta tensors cannot run, a bug) is a refusal: an
    unchecked graph could be silently wrong."""
    try:
        return track(gm, seeds, length, state_inputs(gm))
    except Exception as e:  # noqa: BLE001
        raise CPCompileError(
            f"cpcompile's token guard could not analyse this graph ({type(e).__name__}: {e}), so it cannot tell "
            "whether an op in it mixes tokens across the CP ranks. Fix: mark the code that runs it token-local if "
            "it is (cpcompile.mark_token_local(fn_or_module)), or report the op that fails"
        ) from e


def _clean(result: Result) -> bool:
    return not result.flags and not result.inconsistent


@dataclass(frozen=True)
class GraphCheck:
    """What the guard found in one graph: the first refused op (None: none, or the graph is skipped), and the
    outputs that hold tokens (index, Seq tag), which the compiled graph marks when it runs (token_marks.py)."""

    flag: Flag | None = None
    outputs: tuple = ()


def check_graph(
    gm: torch.fx.GraphModule,
    plans: list,
    seen: set[int] | None = None,
    strategy: str = "zigzag",
    pending: list | None = None,
) -> Flag | None:
    """The first op of `gm` that mixes tokens along the sharded dim (None: none, or the graph is skipped)
    (guard_graph, without the outputs)."""
    return guard_graph(gm, plans, seen, strategy, pending).flag


def guard_graph(
    gm: torch.fx.GraphModule,
    plans: list,
    seen: set[int] | None = None,
    strategy: str = "zigzag",
    pending: list | None = None,
) -> GraphCheck:
    """The first op of `gm` that mixes tokens along the sharded dim, and its token-holding outputs. Its token
    dims come from, in order: its sites' (and mixers') local lengths; its inputs' marks (token_marks.py: shard /
    shard_batch's, or an earlier compiled graph's outputs: the graph-break handoff); `seen`, the local lengths of
    the same backend's earlier graphs (updated with this graph's). With none of them each reading of its dims is
    tried and any op that mixes tokens under one is refused (`Flag.reading`). `pending`: the backend's earlier
    graphs that had no length to check with (graphs before the first attention graph): a graph of the same kind
    is added to it, and a graph that brings a length checks them with it (check_pending)."""
    inputs = data_inputs(gm, strategy)
    if not inputs:
        return GraphCheck()
    if isinstance(inputs[0][1], int):  # DTensor inputs under a permuted layout: their placements say where
        result = analyse(gm, {n.name: d for n, d in inputs}, None)
        return GraphCheck(result.flags[0] if result.flags else None)
    lengths = site_lengths(plans) | mixer_lengths(gm)
    if lengths:
        if seen is not None:
            seen.update(lengths)
        found = _with_lengths(gm, inputs, lengths)
        if found.flag is None and (flag := check_pending(pending, lengths, strategy)) is not None:
            return GraphCheck(flag)
        return found
    marked = {name: Seq(tuple(Part(*p) for p in mark.parts)) for name, mark in input_marks(gm).items()}
    if marked:
        known = {mark.length for mark in input_marks(gm).values()}
        if seen is not None:
            seen.update(known)
        return _with_known(gm, inputs, known, marked)
    sizes = sorted({n for _, v in inputs for n in v.shape if n > 1})
    if (seen or set()) & set(sizes):  # a local length an earlier graph's attention had
        return _with_known(gm, inputs, (seen or set()) & set(sizes))
    if pending is not None:
        pending[:] = [*pending[-MAX_PENDING + 1 :], gm]
    return GraphCheck(_any_reading(gm, inputs, sizes))


def _any_reading(gm: torch.fx.GraphModule, inputs, sizes: list[int]) -> Flag | None:
    """A graph whose token dims nothing tells: each size of its inputs' dims is tried as the sequence (the
    likeliest dims first), and the first op that mixes tokens under any reading is refused, naming the reading."""
    for size in sizes:
        for seeds in itertools.islice(assignments(inputs, {size}, set()), READINGS_PER_SIZE):
            result = analyse(gm, seeds, None)
            if result.flags:
                name, dim = next(iter(seeds.items()))
                reading = f"dim {dim} of the input {name!r} (size {size}) as the sequence"
                return dataclasses.replace(result.flags[0], reading=reading)
    return None


def _with_known(gm: torch.fx.GraphModule, inputs, sizes: set[int], marked: dict[str, Seq] | None = None) -> GraphCheck:
    """A graph with no site, checked fully at known local lengths: an attention graph's of the same backend, or
    its marked inputs' (`marked`: their token axes, kept; the other inputs with a dim of a known length are placed
    there, each reading tried, since they may hold tokens too)."""
    marked = marked or {}
    clean = None
    for size in sorted(sizes):
        for seeds in itertools.islice(assignments(inputs, {size}, set(marked)), READINGS_PER_SIZE):
            result = analyse(gm, {**seeds, **marked}, size)
            if result.flags:
                return GraphCheck(result.flags[0])
            clean = clean or result
    return GraphCheck(None, clean.outputs if clean is not None else ())


def check_pending(pending: list | None, lengths: set[int], strategy: str = "zigzag") -> Flag | None:
    """The first refusal in the graphs compiled before any length was known (HF's dynamic RoPE compares
    max(position_ids) in a graph of its own before the first attention), now checked fully at `lengths`; each is
    checked once. They have run already, but without a collective: refusing now, at the first graph that would
    communicate, is still before any collective, on every rank."""
    while pending:
        gm = pending.pop(0)
        inputs = data_inputs(gm, strategy) or []
        sizes = {n for _, v in inputs if not isinstance(v, int) for n in v.shape} & lengths
        flag = _with_known(gm, inputs, sizes).flag if sizes else None
        if flag is not None:
            pending.clear()
            return flag
    return None


def _with_lengths(gm: torch.fx.GraphModule, inputs, lengths: set[int]) -> GraphCheck:
    """A graph with regions: the first assignment that is clean wins; else the first consistent one's refusal."""
    results = []
    for seeds in assignments(inputs, lengths, cu_only_inputs(gm)):
        result = analyse(gm, seeds, min(lengths))
        if _clean(result) or (not result.flags and not results):
            return GraphCheck(None, result.outputs)  # consistent and clean, or the first choice refuses nothing
        results.append(result)
    flagged = [r for r in results if r.flags]
    chosen = next((r for r in flagged if not r.inconsistent), flagged[0] if flagged else None)
    if chosen is None:
        log.debug("cpcompile token guard: no sequence assignment places every site's q/k/v; skipped")
        return GraphCheck()
    return GraphCheck(chosen.flags[0])

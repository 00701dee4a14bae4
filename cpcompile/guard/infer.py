"""Which dim of which input holds the sequence, and the first op that mixes tokens along it.

The rewritten sites give this rank's local length L (SDPA q (B, H, L, D): dim 2; varlen q (T_local, H, D):
dim 0); a token mixer's region counts like a site. Every data input (inputs.py) with a dim of size L is placed
`Shard` on that dim. A dim of size L that is not the sequence (batch == L, hidden == L) is resolved by
consistency: when the first assignment refuses something or leaves a site's q/k/v off their sequence dim, the
other choices of dim for inputs with several size-L dims are tried, and the graph is accepted if one of them places
every site's q/k/v on the sequence dim with nothing refused. An input is never dropped from the assignment to make
a refusal go away (a token mask's cumsum into position ids must stay refused).

Graphs with no site: the local length is unknown. A length an earlier graph of the same backend had (after a graph
break) is tried first, fully; then each distinct size of the inputs' dims, and a size is taken as the sequence only
when some op makes two values sharded on it meet along it (q @ k^T, SDPA inside nn.MultiheadAttention). Such a
graph is also kept (`pending`) until a graph of the same backend brings the local length (its attention sites),
and then checked fully at that length: a per-rank max(position_ids) deciding a branch before the first attention
graph (HF's dynamic RoPE) is refused there, before that graph's collectives. A graph with no site that no later
graph gives a length is not checked: its sequence dim cannot be told from its batch dim.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator

import torch.fx

from ..errors import CPCompileError
from .flow import Flag, Result
from .inputs import cu_only_inputs, data_inputs, mixer_lengths, site_lengths, state_inputs
from .runner import track

log = logging.getLogger("cpcompile")

MAX_ASSIGNMENTS = 16
"""At most this many choices of sequence dims are tried for one graph (ambiguous dims are rare)."""
MAX_SIZES = 6
"""A graph with no site: at most this many candidate sequence lengths are tried."""
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


def analyse(gm: torch.fx.GraphModule, seeds: dict[str, int], length: int | None) -> Result:
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


def check_graph(
    gm: torch.fx.GraphModule,
    plans: list,
    seen: set[int] | None = None,
    strategy: str = "zigzag",
    pending: list | None = None,
) -> Flag | None:
    """The first op of `gm` that mixes tokens along the sharded dim (None: none, or the graph is skipped).
    `seen`: the local lengths of the same backend's earlier graphs (updated with this graph's). `pending`: the
    backend's earlier graphs that had no length to check with (graphs before the first attention graph): a graph
    of the same kind is added to it, and a graph that brings a length checks them with it (check_pending)."""
    inputs = data_inputs(gm, strategy)
    if not inputs:
        return None
    if isinstance(inputs[0][1], int):  # DTensor inputs under a permuted layout: their placements say where
        result = analyse(gm, {n.name: d for n, d in inputs}, None)
        return result.flags[0] if result.flags else None
    lengths = site_lengths(plans) | mixer_lengths(gm)
    if lengths:
        if seen is not None:
            seen.update(lengths)
        return _with_lengths(gm, inputs, lengths) or check_pending(pending, lengths, strategy)
    sizes = sorted({n for _, v in inputs for n in v.shape if n > 1})
    if (seen or set()) & set(sizes):  # a local length an earlier graph's attention had
        return _with_seen(gm, inputs, (seen or set()) & set(sizes))
    if pending is not None:
        pending[:] = [*pending[-MAX_PENDING + 1 :], gm]
    if len(sizes) > MAX_SIZES:
        return None
    for size in sizes:
        for seeds in itertools.islice(assignments(inputs, {size}, set()), 4):
            result = analyse(gm, seeds, None)
            if any(f.pairwise for f in result.flags):
                return result.flags[0]
    return None


def _with_seen(gm: torch.fx.GraphModule, inputs, sizes: set[int]) -> Flag | None:
    """A graph with no site, checked fully at the local lengths an attention graph of the same backend had."""
    for size in sorted(sizes):
        for seeds in itertools.islice(assignments(inputs, {size}, set()), 4):
            result = analyse(gm, seeds, size)
            if result.flags:
                return result.flags[0]
    return None


def check_pending(pending: list | None, lengths: set[int], strategy: str = "zigzag") -> Flag | None:
    """The first refusal in the graphs compiled before any length was known (HF's dynamic RoPE compares
    max(position_ids) in a graph of its own before the first attention), now checked fully at `lengths`; each is
    checked once. They have run already, but without a collective: refusing now, at the first graph that would
    communicate, is still before any collective, on every rank."""
    while pending:
        gm = pending.pop(0)
        inputs = data_inputs(gm, strategy) or []
        sizes = {n for _, v in inputs if not isinstance(v, int) for n in v.shape} & lengths
        flag = _with_seen(gm, inputs, sizes) if sizes else None
        if flag is not None:
            pending.clear()
            return flag
    return None


def _with_lengths(gm: torch.fx.GraphModule, inputs, lengths: set[int]) -> Flag | None:
    """A graph with regions: the first assignment that is clean wins; else the first consistent one's refusal."""
    results = []
    for seeds in assignments(inputs, lengths, cu_only_inputs(gm)):
        result = analyse(gm, seeds, min(lengths))
        if _clean(result) or (not result.flags and not results):
            return None  # consistent and clean, or the first choice refuses nothing
        results.append(result)
    flagged = [r for r in results if r.flags]
    chosen = next((r for r in flagged if not r.inconsistent), flagged[0] if flagged else None)
    if chosen is None:
        log.debug("cpcompile token guard: no sequence assignment places every site's q/k/v; skipped")
        return None
    return chosen.flags[0]

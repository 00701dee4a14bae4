"""A head-parallel (a2a) declaration checked against the mixer's own code, once, when the graph is compiled.

The a2a region (region.py) runs the mixer on each rank's block of heads (heads [r*H/cp, (r+1)*H/cp) of every token
tensor, the split weights narrowed alike, the shared inputs whole) and puts the blocks' outputs side by side. That
is the one-process result only if the declaration is true: every head of the outputs reads only the same heads of
the inputs (`heads_dim`), and the weights split as declared (`weight_dims`; a module's parameters split along dim 0
when that size is a head count). A mixer that mixes heads declared head-local gave an error of 1.79 against one
process with no message (verify() caught it, the backend did not).

So the plan runs the mixer's code on real tensors of this rank's shapes (the same local tokens, all heads) twice
over: once on every head, once on each of the cp head blocks as the region splits them, and compares the blocks'
outputs put side by side with the whole run's. Inputs and weights are random (a fixed seed: every rank draws the
same values and so reaches the same verdict), floating values at a small scale (the scans' decays stay finite),
integer ones zero, masks true; only entries that are finite in both runs are compared, relative to the largest of
them, within a bound per dtype that the rounding of a head-local mixer's sliced kernels stays far below (a mixer
that mixes heads differs by O(1)). Cost: the mixer's forward on this rank's L tokens for all heads, twice (whole,
then in cp slices; with drawing the inputs, 2.6-3.1 forwards for HF's gated delta rule on CPU), without autograd, on
the device of the traced tensors, once per declaration, cp and shapes in the process (a model's layers calling one
declared function are checked once); the random inputs and outputs are freed after it. A meta-device trace skips
it.
"""

from __future__ import annotations

import functools

import torch
from torch.utils import _pytree as pytree

from .declare import MixerSpec

SCALE = 0.1
"""Random floating values are N(0, SCALE^2): small enough that a scan's exp(A * dt) stays finite over L tokens."""
TOLERANCE = {torch.float64: 1e-6, torch.float32: 2e-2}
"""Largest error (relative to the largest output) a head-local mixer's sliced runs may show, by output dtype (TF32
matmuls on a GPU round at 1e-3); half types: HALF_TOLERANCE."""
HALF_TOLERANCE = 1e-1


def _real(t, gen: torch.Generator):
    """A real tensor shaped like the traced value `t` (anything else as it is)."""
    if not isinstance(t, torch.Tensor):
        return t
    shape = [int(s) for s in t.shape]
    if t.dtype.is_floating_point or t.dtype.is_complex:
        value = torch.randn(shape, generator=gen, dtype=t.dtype) * SCALE
    elif t.dtype == torch.bool:
        value = torch.ones(shape, dtype=torch.bool)
    else:
        value = torch.zeros(shape, dtype=t.dtype)
    return value.to(t.device)


def _on_meta(values) -> bool:
    return any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in pytree.tree_leaves(values))


def _block(t, spec: MixerSpec, cp: int, r: int):
    """Block r of t's heads (a token tensor), contiguous as the a2a region hands it to rank r."""
    if not isinstance(t, torch.Tensor):
        return t
    part = t.shape[spec.heads_dim] // cp
    return t.narrow(spec.heads_dim, r * part, part).contiguous()


def _error(whole: torch.Tensor, joined: torch.Tensor) -> float:
    """The largest difference where both are finite, relative to the largest finite whole value."""
    if whole.dtype.is_floating_point or whole.dtype.is_complex:
        finite = whole.isfinite() & joined.isfinite()
        if not finite.any():
            return 0.0
        diff = (whole - joined).abs()[finite].max()
        return float(diff / whole.abs()[finite].max().clamp_min(torch.finfo(whole.dtype).tiny))
    return float((whole != joined).any())


_VERDICTS: dict[tuple, tuple[float, float]] = {}
"""The verdicts so far, by what determines them (the mixer's code, its dims, cp, the weights' split and the values'
shapes, dtypes, devices and non-tensor arguments): a model's layers share one declared function (HF's fallbacks),
and a recompile meets the same calls again."""


def _signature(spec: MixerSpec, weight_dims, values, cp: int) -> tuple:
    leaves, tree = pytree.tree_flatten(values)
    described = tuple(
        (tuple(int(s) for s in t.shape), t.dtype, str(t.device)) if isinstance(t, torch.Tensor) else repr(t)
        for t in leaves
    )
    code = spec.fn if spec.module is None else spec.key
    return (code, spec.heads_dim, spec.seq_dim, cp, tuple(weight_dims), str(tree), described)


def split_error(spec: MixerSpec, weights, weight_dims, args, kwargs, shared, cp: int) -> tuple[float, float] | None:
    """(error, bound): how far the mixer run on each of the cp head blocks, its outputs side by side, is from the
    mixer run on every head, on random inputs of the traced values' shapes; None where it cannot run (a meta trace).
    `weights`, `args`, `kwargs`, `shared`: the traced values (kwargs without the shared inputs). Computed once per
    signature (_VERDICTS)."""
    if _on_meta((weights, args, kwargs, shared)):
        return None
    key = _signature(spec, weight_dims, (weights, args, kwargs, shared), cp)
    if key not in _VERDICTS:
        _VERDICTS[key] = _split_error(spec, weights, weight_dims, args, kwargs, shared, cp)
    return _VERDICTS[key]


def _split_error(spec: MixerSpec, weights, weight_dims, args, kwargs, shared, cp: int) -> tuple[float, float]:
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        weights, args, kwargs, shared = pytree.tree_map(lambda t: _real(t, gen), (weights, args, kwargs, shared))
        devices = sorted({t.device.index or 0 for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)
                          and t.device.type == "cuda"})  # fmt: skip
        with torch.random.fork_rng(devices=devices):  # the user's random stream stays as it was
            whole = spec.call(weights, args, kwargs | shared)
            blocks = []
            for r in range(cp):
                # the split weights narrowed as region.py narrows them
                part = [w if d is None else w.narrow(d, r * (w.shape[d] // cp), w.shape[d] // cp)
                        for w, d in zip(weights, weight_dims)]  # fmt: skip
                block_args, block_kwargs = pytree.tree_map(functools.partial(_block, spec=spec, cp=cp, r=r),
                                                           (args, kwargs))  # fmt: skip
                blocks.append(spec.call(part, block_args, block_kwargs | shared))
    outs = [t for t in pytree.tree_leaves(whole) if isinstance(t, torch.Tensor)]
    per_block = [[t for t in pytree.tree_leaves(b) if isinstance(t, torch.Tensor)] for b in blocks]
    error = 0.0
    for i, out in enumerate(outs):
        joined = torch.cat([b[i] for b in per_block], dim=spec.heads_dim)
        error = max(error, _error(out, joined) if joined.shape == out.shape else float("inf"))
    dtype = outs[0].dtype if outs else torch.float32
    return error, TOLERANCE.get(dtype, HALF_TOLERANCE)
